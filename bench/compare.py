"""Side-by-side benchmark on one GPU: eager, per-block checkpointing, torch.compile with an
activation-memory budget, mutwo without recompute and mutwo at budgets (the benchmark issue).

Every variant runs in a fresh process: 3 warm-up iterations, then 10 measured ones; peak =
``torch.cuda.max_memory_allocated`` over the measured iterations, time = median CUDA-event time.

    python bench/compare.py --out bench/results/compare_h100.json --models resnet152:32,bert:16
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CONFIGS = {"resnet152": "examples/resnet152.yaml", "bert": "examples/bert.yaml"}
VARIANTS = ["eager", "checkpoint", "compile-0.5", "compile-0.1", "mutwo-none", "mutwo-0.7", "mutwo-0.5"]
WARMUP, MEASURED = 3, 10


class Checkpointed(nn.Module):
    """Runs a block under non-reentrant torch.utils.checkpoint."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return torch.utils.checkpoint.checkpoint(self.inner, *args, use_reentrant=False, **kwargs)


def checkpoint_blocks(model: nn.Module) -> None:
    """Wrap every ResNet bottleneck / BERT encoder layer."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child).__name__ in ("Bottleneck", "BasicBlock", "BertLayer"):
                setattr(module, name, Checkpointed(child))


def workload(name: str, batch_size: int) -> tuple[nn.Module, Any, Any]:
    from tools.config import apply_overrides, load_config
    from tools.workloads import build_workload

    config = apply_overrides(load_config(ROOT / CONFIGS[name]), batch_size=batch_size)
    made = build_workload(config)
    batch = torch.utils._pytree.tree_map(lambda t: t.cuda() if isinstance(t, torch.Tensor) else t, made.batch)
    return made.model.cuda(), batch, made.loss_fn, config


def call(model: nn.Module, batch: Any) -> Any:
    return model(**batch) if isinstance(batch, dict) else model(*batch)


def measure(step: Any) -> dict[str, Any]:
    for _ in range(WARMUP):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(MEASURED):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return {"peak_bytes": torch.cuda.max_memory_allocated(), "iteration_ms": statistics.median(times)}


def worker(name: str, batch_size: int, variant: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model, batch, loss_fn, config = workload(name, batch_size)
    optimizer_cls = torch.optim.AdamW if config.optimizer["name"] == "adamw" else torch.optim.Adam
    options = {k: v for k, v in config.optimizer.items() if k != "name"}
    optimizer = optimizer_cls(model.parameters(), **options)
    result: dict[str, Any] = {"model": name, "batch_size": batch_size, "variant": variant}
    if variant.startswith("mutwo"):
        from runtime.api import optimize

        budget = variant.split("-", 1)[1]
        start = time.perf_counter()
        step_fn = optimize(model, optimizer, batch, loss_fn, passes="stats" if budget == "none" else
                           "profile,select,rewrite", budget=None if budget == "none" else budget)  # fmt: skip
        result["planning_seconds"] = round(time.perf_counter() - start, 2)
        result.update(measure(lambda: step_fn(batch)))
        return result
    if variant == "checkpoint":
        checkpoint_blocks(model)
    runner = model
    if variant.startswith("compile"):
        torch._functorch.config.activation_memory_budget = float(variant.split("-", 1)[1])
        runner = torch.compile(model)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(call(runner, batch), batch).backward()
        optimizer.step()

    start = time.perf_counter()
    step()
    result["first_step_seconds"] = round(time.perf_counter() - start, 2)
    result.update(measure(step))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out")
    parser.add_argument("--models", default="resnet152:32,bert:16", help="name:batch,...")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--worker", nargs=3, metavar=("MODEL", "BATCH", "VARIANT"), help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=int, default=300, help="seconds per variant")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], int(args.worker[1]), args.worker[2])))
        return
    rows = []
    for item in args.models.split(","):
        name, batch = item.split(":")
        for variant in args.variants.split(","):
            try:
                done = subprocess.run([sys.executable, __file__, "--worker", name, batch, variant], cwd=ROOT,
                                      capture_output=True, text=True, timeout=args.timeout)  # fmt: skip
                lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
                row = json.loads(lines[-1]) if done.returncode == 0 and lines else {
                    "model": name, "batch_size": int(batch), "variant": variant,
                    "error": ("out of memory" if "OutOfMemoryError" in done.stderr else done.stderr.strip()[-400:])}
            except subprocess.TimeoutExpired:
                row = {"model": name, "batch_size": int(batch), "variant": variant, "error": "timeout"}
            print(json.dumps(row), flush=True)
            rows.append(row)
            if args.out:
                Path(args.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                                      "date": time.strftime("%Y-%m-%d"), "runs": rows}, indent=2))


if __name__ == "__main__":
    main()
