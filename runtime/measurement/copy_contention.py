"""How much host-device copies slow one graph's compute on its GPU: ``select-swap``'s contention.

A swap's copies run on their own CUDA streams beside the compute, and they are not free there:
they take memory bandwidth and copy-engine traffic the kernels would use. How much depends on the
kernels. On the H100 ResNet-152's memory-bound kernels ran 1.08-1.10x longer while a copy was in
flight (docs/benchmarks.md, "Swap and recompute"); BERT-base b64's swap plan under Inductor ran
562.6 ms against 556.4 ms profiled without a plan: with 2.2 ms of recompute, at most 4 ms for
copies in flight about 310 ms (8.6 GB each way), about 1.3% (docs/benchmarks.md, seventh session).
One constant for both priced BERT's swaps about seven times too high, and its planner recomputed
22 matmuls it could have swapped.

So the profile measures it on the graph itself: whole iterations alone, then with copies out
(device to pinned host) kept in flight on a side stream for all of each iteration, then with
copies in. ``slowdown`` is the mean of the two loaded iterations over the plain one, less one
(never below zero): the timeline's ``compute_slowdown``, which prices every interval in which a
copy is in flight (:mod:`mutwo.ir.timeline`). The iterations are the eager executor's; Inductor's
fused kernels read and write less memory, so their slowdown is at most this, as far as memory
bandwidth is the cause.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from mutwo.runtime.measurement.iterations import device_of, measure_iterations

MIB = 2**20
CHUNK_BYTES = 64 * MIB  #: one copy of the load: long enough that its launch is negligible
#: copies enqueued per iteration, against the iteration's time alone: the load must outlast the
#: iteration it slows (an iteration slowed 50% still ends with copies in flight)
LOAD_COVERAGE = 1.5


@dataclass(frozen=True)
class CopyContention:
    """Whole-iteration times of one graph alone and with each direction's copies in flight."""

    plain_seconds: float
    d2h_seconds: float  #: with copies from the device to pinned host memory in flight
    h2d_seconds: float  #: with copies from pinned host memory to the device in flight
    runs: int

    @property
    def slowdown(self) -> float:
        """How much longer compute runs while a copy is in flight (0.02: 2% longer)."""
        return max(0.0, (self.d2h_seconds + self.h2d_seconds) / (2 * self.plain_seconds) - 1)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "slowdown": self.slowdown}

    def text(self) -> str:
        return (f"{self.slowdown * 100:.1f}% (iteration {self.plain_seconds * 1e3:.1f} ms alone, "
                f"{self.d2h_seconds * 1e3:.1f} ms with copies out, {self.h2d_seconds * 1e3:.1f} ms with copies in)")


def _copy_load(device: torch.device, plain_seconds: float) -> tuple[Callable[[], None], Callable[[], None]]:
    """Two loads (out, in), each enqueuing enough 64 MiB copies on a side stream to outlast an
    iteration of ``plain_seconds`` (timed once here)."""
    host = torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=True)
    buffer = torch.empty(CHUNK_BYTES, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device=device)

    def copies(count: int, out: bool) -> None:
        with torch.cuda.stream(stream):
            for _ in range(count):
                (host.copy_(buffer, non_blocking=True) if out else buffer.copy_(host, non_blocking=True))

    def chunk_seconds(out: bool) -> float:
        copies(1, out)  # warm-up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        copies(4, out)
        end.record(stream)
        end.synchronize()
        return start.elapsed_time(end) / 4e3

    counts = [math.ceil(LOAD_COVERAGE * plain_seconds / max(chunk_seconds(out), 1e-6)) + 1 for out in (True, False)]
    return (lambda: copies(counts[0], True)), (lambda: copies(counts[1], False))


def measure_copy_contention(module: Callable[..., Any], inputs: list[torch.Tensor], *,
                            runs: int = 3) -> CopyContention:  # fmt: skip
    """Median whole iterations of ``module`` (on clones of ``inputs``, on their CUDA device)
    alone, with copies out in flight and with copies in in flight; ``runs`` each after one warm-up."""
    device = device_of(inputs)
    if device.type != "cuda":
        raise ValueError(f"copy contention is measured on a CUDA device, not {device}")
    plain = measure_iterations(module, inputs, runs=runs, warmup=1).seconds
    out, into = _copy_load(device, plain)
    loaded = [measure_iterations(module, inputs, runs=runs, warmup=1, before_each=load).seconds for load in (out, into)]
    return CopyContention(plain, loaded[0], loaded[1], runs)
