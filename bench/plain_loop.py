"""The yardstick of the harness: a training loop written as a user writes it, nothing of mutwo's
measuring code in it, eager or with every residual block / encoder layer / GPT-2 block under
per-block checkpointing. Prints (and with ``--out`` writes) one JSON row: the median step time
over the measured steps, and ``torch.cuda.max_memory_allocated`` and
``torch.cuda.max_memory_reserved`` over them, after warm-up. ``bench/compare.py``'s eager and
checkpoint rows must agree with it (issue 41: within 1%); run both on the same machine:

    python3 bench/plain_loop.py --config examples/bert.yaml --batch-size 64 --variant checkpoint --out p.json

The model, optimizer and batch are the config's (built as every harness builds them); how the
model takes the batch is what mutwo's capture decides too (``batch_call``), so that both run the
same call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from compare import checkpoint_blocks  # bench/ is on sys.path when this runs as a script

from mutwo.runtime.capture.batch_call import batch_call
from mutwo.tools.experiment_measure import build_training


def plain_loop(config: str, batch_size: int, variant: str, warmup: int, steps: int) -> dict[str, Any]:
    """Train ``warmup + steps`` steps of the config's model in a plain loop; the row of the measured ones."""
    training = build_training(config, batch_size)
    model, optimizer, loss_fn, batch = training.model, training.optimizer, training.loss_fn, training.batch
    row: dict[str, Any] = {"config": config, "batch_size": batch_size, "variant": variant, "warmup": warmup,
                           "steps": steps, "torch": torch.__version__,
                           "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}  # fmt: skip
    if variant == "checkpoint":
        row["checkpointed_blocks"] = checkpoint_blocks(model)
    call = batch_call(model, batch)
    args, kwargs = call.model_arguments(batch)
    labels = call.loss_batch(batch)
    cuda = training.device.type == "cuda"
    times = []
    for index in range(warmup + steps):
        if index == warmup and cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        begin = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(*args, **kwargs), labels)
        loss.backward()
        optimizer.step()
        if cuda:
            torch.cuda.synchronize()
        if index >= warmup:
            times.append((time.perf_counter() - begin) * 1e3)
    row.update(iteration_ms=statistics.median(times), iteration_ms_all=[round(t, 3) for t in times],
               peak_bytes=torch.cuda.max_memory_allocated() if cuda else None,
               held_bytes=torch.cuda.max_memory_reserved() if cuda else None)  # fmt: skip
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="a YAML config (examples/bert.yaml)")
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--variant", choices=("eager", "checkpoint"), default="eager")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", help="JSON file to write the row to")
    args = parser.parse_args()
    if args.warmup < 0 or args.steps < 1:
        parser.error("--warmup must be at least 0 and --steps at least 1")
    row = plain_loop(args.config, args.batch_size, args.variant, args.warmup, args.steps)
    text = json.dumps(row, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
