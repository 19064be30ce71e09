"""Which ``select-swap`` options make the fastest swap plan? Captures and profiles one model once,
plans ``select-swap`` at one budget with each option set given, then compiles the first
``--compile`` distinct plans (in the order given) with a backend and times them, all in one
process on one profile, so the rows differ only by their plans.

Why: BERT-base b64's swap+recompute plan under Inductor at per-layer checkpointing's peak ran
602.3 ms against a prediction of 613.3 ms (docs/benchmarks.md, sixth session). 14.6 ms of the
prediction is the copies' contention (kernels priced 10% slower while a copy is in flight, as
measured beside ResNet-152's memory-bound kernels); the plan swapped 3.8 GB where the forward pass
leaves time for about 10 GB and still recomputed 27 matmuls. Whether BERT's GEMMs slow down less
beside a copy, so that a lower ``contention`` plans more swaps and runs faster, is what this
measures.

    python bench/swap_options.py --out $OUT/swap_options_bert.json --model bert:64 \\
        --budget 22425894912 --options ';contention=0.03;contention=0' --compile 3

``--options`` is a list of option sets separated by ``;`` (an empty set is the defaults); each
becomes ``select-swap{SET},insert-swap``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from plan_stability import captured, run_header, time_plan  # noqa: E402

from mutwo.ir.budget import parse_budget  # noqa: E402
from mutwo.ir.pass_manager import PassManager, PipelineFailure  # noqa: E402
from mutwo.ir.registry import PassRegistry  # noqa: E402
from mutwo.runtime.execution.backends import backend_services  # noqa: E402
from mutwo.runtime.planning.captured import pass_context  # noqa: E402
from mutwo.tools.experiment_planning import swap_plan_row  # noqa: E402


def plan_id(plan: Any) -> str:
    """A hash of what the plan swaps and what it recomputes."""
    keys = sorted(f"{e['action']}:{e['storage']}" for e in plan.entries)
    return hashlib.sha1(",".join(keys).encode()).hexdigest()[:10]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file to write (rewritten after every step)")
    parser.add_argument("--model", default="bert:64", help="name:batch, as compare.py's --models")
    parser.add_argument("--budget", required=True, help="the budget every plan is made for, as mutwo-opt's "
                        "--budget takes it: bytes (22425894912, 20GiB) or a fraction of the unoptimized peak")
    parser.add_argument("--options", default="", help="select-swap option sets separated by ';' "
                        "('' is the defaults), e.g. ';contention=0.03;contention=0,refine=64'")
    parser.add_argument("--backend", default="inductor", help="the backend the plans are made for and run by")
    parser.add_argument("--compile", type=int, default=2, help="distinct plans compiled and timed, in the order given")
    parser.add_argument("--iterations", type=int, default=10, help="measured iterations per timing (3 warm-up)")
    args = parser.parse_args()
    name, batch, training, lowered = captured(args.model)
    budget = parse_budget(args.budget)
    result: dict[str, Any] = {**run_header(name, batch), "budget": args.budget, "backend": args.backend,
                              "plans": [], "timed": []}  # fmt: skip
    write = lambda: Path(args.out).write_text(json.dumps(result, indent=2))  # noqa: E731
    context = pass_context(lowered, budget, log=print)
    context.services.update(backend_services(args.backend))
    # Profiled alone, before the select-swap pipelines: asked to measure the copies' contention,
    # which the default option set prices copies with (a pipeline of profile alone skips it).
    PassManager(PassRegistry().build_pipeline("profile{contention=true}", set())).run(lowered.graph.copy(), context)
    profile, transfer = context.artifacts["profile"], None
    graphs: dict[str, Any] = {}
    for options in args.options.split(";"):
        graph = lowered.graph.copy()
        messages: list[str] = []
        planning = pass_context(lowered, budget, log=messages.append)
        planning.services.update(backend_services(args.backend))
        planning.artifacts["profile"] = profile
        if transfer is not None:  # measured once: every plan prices the same copies
            planning.artifacts["transfer"] = transfer
        started = time.perf_counter()
        pipeline = f"select-swap{{{options}}},insert-swap" if options else "select-swap,insert-swap"
        try:
            PassManager(PassRegistry().build_pipeline(pipeline, {"profile"})).run(graph, planning)
        except PipelineFailure as failure:  # one option set's failure is its row, not the campaign's end
            result["plans"].append({"options": options, "error": str(failure)})
            print(json.dumps(result["plans"][-1]), flush=True)
            write()
            continue
        transfer = planning.artifacts["transfer"]
        chosen = planning.artifacts["swap-plan"]
        seconds = round(time.perf_counter() - started, 2)
        row = {"options": options, "plan_id": plan_id(chosen), "planning_seconds": seconds, **swap_plan_row(chosen),
               "log": [m for m in messages if m.startswith("select-swap")]}  # fmt: skip
        graphs.setdefault(row["plan_id"], graph)
        result["plans"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "log"}), *(m.splitlines()[0] for m in row["log"]),
              sep="\n", flush=True)  # fmt: skip
        write()
    order = list(dict.fromkeys(r["plan_id"] for r in result["plans"] if "plan_id" in r))
    for identity in order[:args.compile]:
        row = {"plan_id": identity, **time_plan(graphs[identity], lowered, training, args.backend, args.iterations)}
        result["timed"].append(row)
        print(json.dumps(row), flush=True)
        write()


if __name__ == "__main__":
    main()
