"""Two or more pipelines of one model at one budget, each planned and trained in a fresh process.

For each ``--passes`` spec, a new Python process builds the config's model, optimizer and batch,
plans the step with ``mutwo.optimize(passes=SPEC, budget=..., backend=...)`` and measures it as a
training loop runs it (``measure_after_planning``: warm-up, then the median step time and, on
CUDA, the max allocated and max reserved bytes over the steady steps). One JSON row per pipeline,
and with ``--out`` each pipeline's log beside it (``OUT-STEM_1.log``, ...):

    python3 bench/pipeline_timing.py --config examples/bert.yaml --batch-size 8 --budget 0.55 \\
        --passes "profile,optimizer,chunk,select,rewrite" \\
        --passes "profile,optimizer,chunk{when=cost},select,rewrite" --out bert_cost.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def one(args: argparse.Namespace) -> dict[str, Any]:
    """Plan and measure ``args.passes`` in this process (the child's side)."""
    import torch

    import mutwo
    from mutwo.tools.experiment_measure import build_training, measure_after_planning

    training = build_training(args.config, args.batch_size, device=args.device)
    started = time.perf_counter()
    step = mutwo.optimize(training.model, training.optimizer, training.batch, training.loss_fn, budget=args.budget,
                          passes=args.passes[0], backend=args.backend, cache=False, verbose=True)  # fmt: skip
    planning = time.perf_counter() - started
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    measured = measure_after_planning(lambda: step(training.batch), device, None, warmup=args.warmup,
                                      iterations=args.steps)  # fmt: skip
    last = step.last
    plan = last.plan if last is not None else None
    chunk = last.context.artifacts.get("chunk") if last is not None else None
    return {"passes": args.passes[0], "planning_seconds": planning, **measured,
            "recomputed": len(plan.entries) if plan is not None else None,
            "predicted_seconds": plan.predicted_seconds if plan is not None else None,
            "sliced": chunk.slices if chunk is not None and chunk.applied else None,
            "chunk": chunk.to_json() if chunk is not None else None}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--budget", required=True)
    parser.add_argument("--passes", action="append", required=True, help="a pipeline; give two or more")
    parser.add_argument("--backend", default="eager")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=None, help="the rows as JSON (the child writes its row to stdout)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(one(args)))
        return 0
    rows = []
    for passes in args.passes:
        command = [sys.executable, __file__, "--child", "--config", args.config, "--batch-size", str(args.batch_size),
                   "--budget", args.budget, "--passes", passes, "--backend", args.backend, "--device", args.device,
                   "--warmup", str(args.warmup), "--steps", str(args.steps)]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True)
        if args.out:  # mutwo's log of the pipeline (its stages, calibration rounds, chunk's reasons)
            Path(args.out).with_name(f"{Path(args.out).stem}_{len(rows) + 1}.log").write_text(done.stderr)
        lines = done.stdout.strip().splitlines()
        row = json.loads(lines[-1]) if done.returncode == 0 and lines else {
            "passes": passes, "error": (done.stderr.strip().splitlines() or ["no output"])[-1][:500]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"config": args.config, "batch_size": args.batch_size,
                                              "budget": args.budget, "backend": args.backend, "rows": rows}, indent=2))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
