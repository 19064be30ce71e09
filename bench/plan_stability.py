"""Do several profiles of one model make one plan? Profiles it ``--profiles`` times in one process,
plans ``select`` at one budget from each profile as measured and pooled (the profile pass's
``pool``, :mod:`mutwo.ir.op_signature`), then times every distinct plan eagerly and the first
``--inductor`` of them compiled by Inductor, all on the same captured graph, machine and budget.

Why: at half of eager's peak, ResNet-152 channels-last b128 under Inductor was planned four times
on the H100 with one budget and ran 124.3, 125.3, 131.0 and 132.4 ms: plans that recomputed 29 or
55 batch norms, predicted 131.6-132.9 ms, in an order unrelated to what they ran
(docs/benchmarks.md, sixth session).

A ``plan_id`` hashes the storages a plan recomputes; it is comparable across runs of this script,
not with mutwo-opt's ``plan_fingerprint`` (another hash of the same facts, from the final graph).

    python bench/plan_stability.py --out $OUT/plan_stability.json --model resnet152-cl:128 \\
        --budget 11825791744 --profiles 3 --inductor 2
"""

from __future__ import annotations

import argparse
import copy
import gc
import hashlib
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from compare import config_path  # noqa: E402

from mutwo.ir.budget import Budget, parse_budget  # noqa: E402
from mutwo.ir.op_signature import pool_times  # noqa: E402
from mutwo.ir.pass_manager import PassManager  # noqa: E402
from mutwo.ir.registry import PassRegistry  # noqa: E402
from mutwo.runtime.execution.backends import backend_services  # noqa: E402
from mutwo.runtime.execution.step import GraphStep  # noqa: E402
from mutwo.runtime.planning.captured import capture_graph, pass_context  # noqa: E402
from mutwo.tools.experiment_measure import build_training, measure_step  # noqa: E402
from mutwo.tools.experiment_planning import PlannedStep  # noqa: E402


def plan(lowered: Any, profile: Any, budget: Budget, backend: str) -> tuple[Any, Any]:
    """``select`` and ``rewrite`` on a copy of the captured graph with ``profile``: (graph, plan)."""
    graph = lowered.graph.copy()
    context = pass_context(lowered, budget)
    context.services.update(backend_services(backend))
    context.artifacts["profile"] = profile
    PassManager(PassRegistry().build_pipeline("select,rewrite", {"profile"})).run(graph, context)
    return graph, context.artifacts["plan"]


def captured(model: str) -> tuple[str, int, Any, Any]:
    """``name:batch`` built from its config and captured: (name, batch, training, lowered)."""
    name, _, batch = model.rpartition(":")
    training = build_training(config_path(name), int(batch))
    lowered = capture_graph(training.model, training.optimizer, training.batch, training.loss_fn, training.options)
    return name, int(batch), training, lowered


def run_header(name: str, batch: int) -> dict[str, Any]:
    """What a results file says about where and when it was measured."""
    return {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"), "model": name, "batch_size": batch}  # fmt: skip


def time_plan(graph: Any, lowered: Any, training: Any, backend: str, iterations: int) -> dict[str, Any]:
    """``graph`` (a plan of ``lowered``'s graph) compiled for ``backend`` and timed on the
    training batch (3 warm-up iterations): its compile record and measurements."""
    step = GraphStep(graph, lowered.captured, lowered.binding, backend)
    compiled = step.compile(step.flat_inputs(training.batch))
    gc.collect()
    torch.cuda.empty_cache()
    row = {"backend": backend, **compiled.describe(),
           **measure_step(PlannedStep(step, training.batch), training.device, warmup=3, iterations=iterations)}
    del step, compiled
    gc.collect()
    return row


def describe(chosen: Any) -> dict[str, Any]:
    """A plan's identity (a hash of the recomputed storages), what it recomputes and predicts."""
    keys = sorted(str(entry["storage"]) for entry in chosen.entries)
    return {"plan_id": hashlib.sha1(",".join(keys).encode()).hexdigest()[:10], "recomputed_tensors": len(keys),
            "recomputed_ops": dict(Counter(e["op"] for e in chosen.entries).most_common()),
            "predicted_iteration_ms": round(chosen.predicted_seconds * 1e3, 3),
            "predicted_added_ms": round(chosen.added_seconds * 1e3, 3),
            "planned_peak_bytes": chosen.predicted_peak}  # fmt: skip


MEMORY_FIELDS = ("allocated_before", "allocated_after", "peak", "workspace")


def hybrid(times: Any, memory: Any) -> Any:
    """A profile with the node times and the iteration of ``times`` and the memory of ``memory``."""
    mixed = copy.deepcopy(times)
    for node_id, measured in mixed.nodes.items():
        other = memory.nodes.get(node_id)
        for name in MEMORY_FIELDS:
            setattr(measured, name, getattr(other, name) if other is not None else getattr(measured, name))
    return mixed


def attribute(lowered: Any, raws: list[Any], budget: Budget) -> list[dict[str, Any]]:
    """For each later profile against the first: how many nodes' memory readings differ, how far the
    times moved, and the plans made from one's times with the other's memory."""
    first, rows = raws[0], []
    for index, other in enumerate(raws[1:], start=1):
        differing = {name: sum(getattr(first.nodes[i], name) != getattr(p, name) for i, p in other.nodes.items()
                               if i in first.nodes) for name in MEMORY_FIELDS}  # fmt: skip
        moved = sorted(abs(p.seconds - first.nodes[i].seconds) / max(first.nodes[i].seconds, 1e-9)
                       for i, p in other.nodes.items() if i in first.nodes)  # fmt: skip
        row = {"profile": index, "memory_fields_differing": differing,
               "time_moved_median": round(moved[len(moved) // 2], 4),
               "time_moved_p90": round(moved[len(moved) * 9 // 10], 4),
               "iteration_ms": [round(r.iteration.seconds * 1e3, 3) if r.iteration else None for r in (first, other)]}
        swapped = ((f"times {index}, memory 0", other, first), (f"times 0, memory {index}", first, other))
        for label, times, memory in swapped:
            row[label] = describe(plan(lowered, hybrid(times, memory), budget, "inductor")[1])["plan_id"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file to write (rewritten after every step)")
    parser.add_argument("--model", default="resnet152-cl:128", help="name:batch, as compare.py's --models")
    parser.add_argument("--budget", required=True, help="the budget every plan is made for, as mutwo-opt's "
                        "--budget takes it: bytes (11825791744, 11GiB) or a fraction of the unoptimized peak")
    parser.add_argument("--profiles", type=int, default=3, help="profiles taken, one after the other")
    parser.add_argument("--inductor", type=int, default=2, help="distinct plans also compiled by Inductor and timed")
    parser.add_argument("--iterations", type=int, default=10, help="measured iterations per timing (3 warm-up)")
    parser.add_argument("--profile-options", default="",
                        help="options of the profile pass, as in a pipeline: 'runs=7' or 'isolate=true'")
    parser.add_argument("--attribute", action="store_true",
                        help="also plan from each later profile's times with the first one's memory and the other "
                             "way round: which of the two moves the plan")  # fmt: skip
    args = parser.parse_args()
    name, batch, training, lowered = captured(args.model)
    budget = parse_budget(args.budget)
    result: dict[str, Any] = {**run_header(name, batch), "budget": args.budget, "plans": [], "timed": []}
    write = lambda: Path(args.out).write_text(json.dumps(result, indent=2))  # noqa: E731
    graphs: dict[str, Any] = {}
    raws: list[Any] = []
    profiling = f"profile{{pool=false{',' + args.profile_options if args.profile_options else ''}}}"
    result["profile"] = profiling
    for index in range(args.profiles):
        context = pass_context(lowered, budget)
        PassManager(PassRegistry().build_pipeline(profiling, set())).run(lowered.graph.copy(), context)
        raw = context.artifacts["profile"]
        raws.append(raw)
        pooled = copy.deepcopy(raw)
        pooling = pool_times(lowered.graph, pooled.nodes)
        for kind, profile in (("measured", raw), ("pooled", pooled)):
            graph, chosen = plan(lowered, profile, budget, "inductor")
            row = {"profile": index, "times": kind, **describe(chosen)}
            if kind == "pooled":
                row["pooling"] = pooling.to_json()
            graphs.setdefault(row["plan_id"], graph)
            result["plans"].append(row)
            print(json.dumps(row), flush=True)
            write()
    if args.attribute:
        result["attribution"] = attribute(lowered, raws, budget)
        write()
    # Pooled plans first: they are the ones the default now makes.
    order = list(dict.fromkeys([r["plan_id"] for r in result["plans"] if r["times"] == "pooled"]
                               + [r["plan_id"] for r in result["plans"]]))  # fmt: skip
    for position, plan_id in enumerate(order):
        for backend in ("eager", "inductor") if position < args.inductor else ("eager",):
            row = {"plan_id": plan_id, **time_plan(graphs[plan_id], lowered, training, backend, args.iterations)}
            result["timed"].append(row)
            print(json.dumps(row), flush=True)
            write()


if __name__ == "__main__":
    main()
