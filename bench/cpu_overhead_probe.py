"""Where the captured step's time goes against eager's on the CPU, op by op (issue 40: resnet18's
captured step without recompute ran about 20% slower than its eager loop on this CPU).

One process builds the model twice from one seed, captures one copy with ``mutwo.optimize`` (no
budget, the eager backend: the graph as captured, nothing recomputed) and trains the other
eagerly; it alternates their steps (so that whatever else the machine runs slows both alike),
then profiles a few steps of each with ``torch.profiler`` and writes the median step times and
the ops whose self CPU time differs most between the two, with their call counts:

    python bench/cpu_overhead_probe.py --model resnet18 --batch-size 8 --out probe.json
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torchvision
from torch.nn import functional as F
from torch.profiler import ProfilerActivity, profile

import mutwo


def _op_times(step: Callable[[], Any], steps: int) -> dict[str, tuple[float, int]]:
    """Self CPU milliseconds per step and calls per step of every op over ``steps`` profiled steps."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    return {e.key: (e.self_cpu_time_total / 1e3 / steps, e.count // steps) for e in prof.key_averages()}


def probe(model_name: str, batch_size: int, steps: int, threads: int | None) -> dict[str, Any]:
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = getattr(torchvision.models, model_name)(num_classes=100)
    mine = copy.deepcopy(model)
    images, labels = torch.randn(batch_size, 3, 64, 64), torch.randint(0, 100, (batch_size,))
    eager_opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    my_opt = torch.optim.Adam(mine.parameters(), lr=1e-3)
    captured = mutwo.optimize(mine, my_opt, (images, labels), F.cross_entropy, backend="eager")

    def eager() -> None:
        eager_opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(images), labels).backward()
        eager_opt.step()

    def mutwo_step() -> None:
        captured((images, labels))

    for _ in range(3):  # warm-up
        eager()
        mutwo_step()
    times: dict[str, list[float]] = {"eager": [], "mutwo": []}
    for _ in range(steps):
        for name, step in (("eager", eager), ("mutwo", mutwo_step)):
            begin = time.perf_counter()
            step()
            times[name].append((time.perf_counter() - begin) * 1e3)
    medians = {name: statistics.median(values) for name, values in times.items()}
    ops = {"eager": _op_times(eager, 3), "mutwo": _op_times(mutwo_step, 3)}
    names = set(ops["eager"]) | set(ops["mutwo"])
    differences = sorted(((ops["mutwo"].get(n, (0.0, 0))[0] - ops["eager"].get(n, (0.0, 0))[0], n) for n in names),
                         reverse=True)  # fmt: skip
    top = [{"op": n, "extra_ms_per_step": round(d, 3), "eager_ms": round(ops["eager"].get(n, (0.0, 0))[0], 3),
            "mutwo_ms": round(ops["mutwo"].get(n, (0.0, 0))[0], 3), "eager_calls": ops["eager"].get(n, (0, 0))[1],
            "mutwo_calls": ops["mutwo"].get(n, (0, 0))[1]} for d, n in differences[:15]]  # fmt: skip
    fewer = [{"op": n, "saved_ms_per_step": round(-d, 3), "eager_calls": ops["eager"].get(n, (0, 0))[1],
              "mutwo_calls": ops["mutwo"].get(n, (0, 0))[1]} for d, n in differences[::-1][:8] if d < 0]  # fmt: skip
    return {"model": model_name, "batch_size": batch_size, "threads": torch.get_num_threads(),
            "torch": torch.__version__, "median_ms": medians, "ratio": medians["mutwo"] / medians["eager"],
            "times_ms": {k: [round(t, 2) for t in v] for k, v in times.items()},
            "ops_costing_more": top, "ops_costing_less": fewer}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18", help="a torchvision model name")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=15, help="measured steps of each, alternated")
    parser.add_argument("--threads", type=int, help="torch's intra-op threads (default: torch's)")
    parser.add_argument("--out", help="JSON file to write")
    args = parser.parse_args()
    row = probe(args.model, args.batch_size, args.steps, args.threads)
    text = json.dumps(row, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
