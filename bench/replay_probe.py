"""How exact and how fast the recompute replays are on this GPU (the replay issue's probe).

For training batch norms at ResNet-152's shapes: is ``batch_norm_from_stats`` (the clone's replay
from the saved mean and inverse std) bitwise equal to the kernel the captured graph calls
(``cudnn_batch_norm``), its largest difference, and both times. For dropout and SDPA with
attention dropout: is the replay with the saved generator state bitwise equal, and its time.

    python bench/replay_probe.py --out bench/results/replay_probe_h100.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from mutwo.ir.replay import batch_norm_from_stats, rng_state, run_with_rng_state

# (batch, channels, height, width) of ResNet-152's batch norms at batch 128: one per stage.
BATCH_NORM_SHAPES = [(128, 64, 112, 112), (128, 256, 56, 56), (128, 512, 28, 28), (128, 1024, 14, 14),
                     (128, 2048, 7, 7)]  # fmt: skip


def cuda_ms(run: Callable[[], Any], repeat: int = 20) -> float:
    """Median CUDA-event time of ``run`` in milliseconds, after two warm-up calls."""
    for _ in range(2):
        run()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def batch_norm_rows() -> list[dict[str, Any]]:
    rows = []
    for shape in BATCH_NORM_SHAPES:
        x = torch.randn(shape, device="cuda")
        c = shape[1]
        weight, bias = torch.randn(c, device="cuda"), torch.randn(c, device="cuda")
        kernel = partial(torch.ops.aten.cudnn_batch_norm, x, weight, bias, torch.zeros(c, device="cuda"),
                         torch.ones(c, device="cuda"), True, 0.1, 1e-5)  # fmt: skip
        out, mean, invstd, _reserve = kernel()
        replay = partial(batch_norm_from_stats, x, weight, bias, mean, invstd)
        (replayed,) = replay()
        rows.append({"shape": list(shape), "bitwise": bool(torch.equal(out, replayed)),
                     "max_abs_diff": float((out - replayed).abs().max()),
                     "kernel_ms": cuda_ms(kernel), "replay_ms": cuda_ms(replay)})  # fmt: skip
    return rows


def random_rows() -> list[dict[str, Any]]:
    x = torch.randn(64, 512, 768, device="cuda")
    q, k, v = (torch.randn(64, 12, 512, 64, device="cuda") for _ in range(3))
    calls = {
        "native_dropout": partial(torch.ops.aten.native_dropout.default, x, 0.1, True),
        "sdpa_efficient": partial(torch.ops.aten._scaled_dot_product_efficient_attention.default, q, k, v, None,
                                  True, 0.1),  # fmt: skip
    }
    rows = []
    for name, kernel in calls.items():
        replay = partial(run_with_rng_state, rng_state("cuda"), kernel.func, *kernel.args)
        first, again = kernel(), replay()
        equal = all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
                    for a, b in zip(first, again, strict=True))  # fmt: skip
        rows.append({"op": name, "bitwise": equal, "kernel_ms": cuda_ms(kernel), "replay_ms": cuda_ms(replay)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("replay_probe: needs a GPU; run it on the GPU machine")
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
              "batch_norm": batch_norm_rows(), "random": random_rows()}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
