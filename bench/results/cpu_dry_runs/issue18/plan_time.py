"""Time select-swap (with its recompute-only alternative) on a real graph at a large batch, with a
synthetic GPU-like profile built from a small-batch CPU profile of the same model (node times x
batch ratio; a measured iteration = 0.42 x their sum; transfer 54 GB/s, 8 us, overlapping).

The pipeline comes from the PIPE environment variable (default select-swap,insert-swap).
Usage: plan_time.py CONFIG BATCH SMALL_BATCH SMALL_PROFILE_JSON OUT_JSON {cprofile|plain} BUDGET...
"""
import cProfile
import json
import pstats
import sys
import time

from mutwo.ir.budget import parse_budget
from mutwo.ir.pass_manager import PassManager
from mutwo.ir.printer import fingerprint
from mutwo.ir.registry import PassRegistry
from mutwo.ir.timeline import TransferModel
from mutwo.runtime.api import capture_graph, pass_context
from mutwo.runtime.profiler import IterationMeasurement, NodeProfile, Profile
from mutwo.tools.experiment import build_training

config, batch, small, small_profile, out, mode = sys.argv[1:7]
budgets = sys.argv[7:] or ["0.5"]


def lowered_at(size: int):
    training = build_training(config, size)
    start = time.perf_counter()
    lowered = capture_graph(training.model, training.optimizer, training.batch, training.loss_fn, training.options)
    print(f"capture b{size}: {time.perf_counter() - start:.1f} s, {len(lowered.graph)} nodes", flush=True)
    return lowered


lowered = lowered_at(int(batch))
graph = lowered.graph
measured = Profile.from_json(json.load(open(small_profile)))
# times scaled so that the calibrated iteration is ITERATION seconds (ResNet-152 b128 on the H100: 0.155)
ITERATION = float(__import__("os").environ.get("ITERATION", "0.155"))
ratio = ITERATION / 0.42 / sum(p.seconds for p in measured.nodes.values())
nodes = {i: NodeProfile(p.seconds * ratio, replay_seconds=None if p.replay_seconds is None else p.replay_seconds * ratio)
         for i, p in measured.nodes.items()}
assert set(nodes) <= {n.id for n in graph}, "the small-batch profile's node ids are not this graph's"
total = sum(p.seconds for p in nodes.values())
profile = Profile("cpu", fingerprint(graph), nodes, 1, IterationMeasurement(0.42 * total, None, 1))
results = {}
for budget in budgets:
    ctx = pass_context(lowered, parse_budget(budget))
    ctx.artifacts["profile"] = profile
    ctx.artifacts["transfer"] = TransferModel(54e9, 54e9, 8e-6, overlap=True, device=str(lowered.device))
    copy = graph.copy()
    prof = cProfile.Profile() if mode == "cprofile" else None
    start = time.perf_counter()
    if prof:
        prof.enable()
    PassManager(PassRegistry().build_pipeline(__import__("os").environ.get("PIPE", "select-swap,insert-swap"), {"profile"})).run(copy, ctx)
    if prof:
        prof.disable()
    seconds = time.perf_counter() - start
    plan = ctx.artifacts["swap-plan"]
    print(f"budget {budget}: select-swap+insert-swap {seconds:.1f} s; {len(plan.of('swap'))} swaps, "
          f"{len(plan.of('recompute'))} recomputes, predicted {plan.predicted_seconds:.4f} s (stall "
          f"{plan.stall_seconds:.4f}), peak {plan.predicted_peak / 2**20:.0f} of {plan.unoptimized_peak / 2**20:.0f} MiB, "
          f"scale {plan.time_scale:.3f}, alternative {plan.alternative}", flush=True)
    results[budget] = {"seconds": seconds, "entries": plan.entries, "predicted": plan.predicted_seconds,
                       "peak": plan.predicted_peak, "alternative": plan.alternative}
    if prof:
        pstats.Stats(prof).sort_stats("cumulative").print_stats(40)
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
json.dump(results, open(out, "w"), indent=1, default=str)
