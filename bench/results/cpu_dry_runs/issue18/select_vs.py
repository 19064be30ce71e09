"""On the synthetic b128 profile: select's recompute-only plan vs select-swap's plans (predicted, same time model)."""
import json, sys, time, os
from mutwo.ir.budget import parse_budget
from mutwo.ir.pass_manager import PassManager
from mutwo.ir.printer import fingerprint
from mutwo.ir.registry import PassRegistry
from mutwo.ir.timeline import TransferModel, graph_timeline
from mutwo.ir.time_model import TimeModel
from mutwo.runtime.api import capture_graph, pass_context
from mutwo.runtime.profiler import IterationMeasurement, NodeProfile, Profile
from mutwo.tools.experiment import build_training
config, batch, small_profile = sys.argv[1:4]
training = build_training(config, int(batch))
lowered = capture_graph(training.model, training.optimizer, training.batch, training.loss_fn, training.options)
graph = lowered.graph
measured = Profile.from_json(json.load(open(small_profile)))
ratio = 0.155 / 0.42 / sum(p.seconds for p in measured.nodes.values())
nodes = {i: NodeProfile(p.seconds * ratio, replay_seconds=None if p.replay_seconds is None else p.replay_seconds * ratio) for i, p in measured.nodes.items()}
profile = Profile("cpu", fingerprint(graph), nodes, 1, IterationMeasurement(0.42 * sum(p.seconds for p in nodes.values()), None, 1))
for budget in sys.argv[4:]:
    for pipeline in ("select,rewrite", "select-swap,insert-swap"):
        ctx = pass_context(lowered, parse_budget(budget))
        ctx.artifacts["profile"] = profile
        ctx.artifacts["transfer"] = TransferModel(54e9, 54e9, 8e-6, overlap=True, device="cpu")
        copy = graph.copy()
        PassManager(PassRegistry().build_pipeline(pipeline, {"profile"})).run(copy, ctx)
        t = graph_timeline(copy, TimeModel.of(graph, profile), None)
        plan = ctx.artifacts.get("plan") or ctx.artifacts.get("swap-plan")
        print(budget, pipeline, f"timeline {t.seconds*1e3:.1f} ms, peak {plan.predicted_peak/2**20:.0f} MiB, entries {len(plan.entries)}", flush=True)
