"""What a training loop's unrecorded first call leaves held (session 33: BERT-base b64's restarts
held 2 MiB more with it than when the step recorded at its first call).

For each mode, in one fresh process each (``--record-at-first-call`` for the old one): build the
config's model, ``mutwo.optimize`` it under a CUDA-graph backend with no budget (nothing runs
the step in planning, so the first call is the training loop's), train 3 steps with allocation
history recorded, and write the allocator's state after them: reserved and allocated, and every
block still allocated outside CUDA-graph pools with the Python frames that allocated it.

    python3 bench/first_call_held_probe.py --config examples/bert.yaml --batch-size 8 --out unrecorded.json
    python3 bench/first_call_held_probe.py --config examples/bert.yaml --batch-size 8 --record-at-first-call \\
        --out recorded.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

import mutwo
from mutwo.tools.experiment_measure import build_training

MIB = 2**20


def live_blocks_outside_graph_pools(snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    """Every allocated block of the default pool, with the Python frames that allocated it."""
    blocks = []
    for segment in snapshot["segments"]:
        if tuple(segment.get("segment_pool_id", (0, 0))) != (0, 0):
            continue
        for block in segment["blocks"]:
            if block["state"] != "active_allocated":
                continue
            frames = [f"{f['filename'].split('site-packages/')[-1]}:{f['line']} {f['name']}"
                      for f in block.get("frames", []) if f["filename"].endswith(".py")][:12]  # fmt: skip
            blocks.append({"bytes": block["size"], "segment_bytes": segment["total_size"],
                           "stream": segment["stream"], "frames": frames})  # fmt: skip
    return sorted(blocks, key=lambda b: -b["bytes"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--backend", default="cudagraphs")
    parser.add_argument("--record-at-first-call", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    training = build_training(args.config, args.batch_size, device="cuda")
    step = mutwo.optimize(training.model, training.optimizer, training.batch, training.loss_fn,
                          backend=args.backend, cache=False)  # fmt: skip
    assert step.last is not None and step.last.step is not None and step.last.step.compiled is not None
    runner = step.last.step.compiled.run
    runner.defer_recording = not args.record_at_first_call
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    rows = []
    for _ in range(3):
        step(training.batch).item()
        torch.cuda.synchronize()
        rows.append({"reserved_mib": torch.cuda.memory_reserved() / MIB, "recordings": runner.recordings,
                     "allocated_mib": torch.cuda.memory_allocated() / MIB})  # fmt: skip
    blocks = live_blocks_outside_graph_pools(torch.cuda.memory._snapshot())
    torch.cuda.memory._record_memory_history(enabled=None)
    result = {"config": args.config, "batch_size": args.batch_size, "backend": args.backend,
              "recorded_at_first_call": args.record_at_first_call, "torch": torch.__version__,
              "after_each_step": rows, "default_pool_live_blocks": len(blocks),
              "default_pool_live_bytes": sum(b["bytes"] for b in blocks), "blocks": blocks[:60]}  # fmt: skip
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "blocks"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
