"""Measuring host-device copies on the machine: bandwidth in each direction and latency.

On CUDA: copies between a pinned host buffer and a device buffer on a side stream, timed with
CUDA events (what the swap kernels do); for each direction, ``time = latency + bytes /
bandwidth`` is fitted through a small and a large size (median of a few runs each). Copies
overlap compute (they run on their own streams).

On CPU the swap kernels copy into a separate host buffer on the calling thread, so the model is
stated rather than fitted: one memory bandwidth for both directions, from the median of a few
64 MiB copies, no latency (a small copy's wall-clock time on a shared CPU is mostly noise) and
no overlap (each copy adds its whole time to the iteration).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch

from mutwo.ir.timeline import CUDA_COMPUTE_SLOWDOWN, TransferModel

MIB = 2**20
CUDA_SIZES = (1 * MIB, 128 * MIB)
CPU_SIZE = 64 * MIB


def _fit(sizes: Sequence[int], seconds: Sequence[float]) -> tuple[float, float]:
    """``seconds = latency + size / bandwidth`` through the smallest and the largest size (median
    times, so a noisy middle point cannot tilt it): (bytes per second, latency)."""
    (small, t_small), (large, t_large) = min(zip(sizes, seconds, strict=True)), max(zip(sizes, seconds, strict=True))
    if t_large > t_small:
        bandwidth = (large - small) / (t_large - t_small)
        return bandwidth, max(0.0, t_small - small / bandwidth)
    return large / t_large, 0.0  # the clock could not tell the sizes apart: all of it is bandwidth


def _time_cuda(device: torch.device, nbytes: int, repeats: int) -> tuple[float, float]:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device=device)
    out_times, in_times = [], []
    with torch.cuda.stream(stream):
        for run in range(repeats + 1):  # the first run warms up
            marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            marks[0].record(stream)
            host.copy_(buffer, non_blocking=True)
            marks[1].record(stream)
            buffer.copy_(host, non_blocking=True)
            marks[2].record(stream)
            stream.synchronize()
            if run:
                out_times.append(marks[0].elapsed_time(marks[1]) / 1e3)
                in_times.append(marks[1].elapsed_time(marks[2]) / 1e3)
    return statistics.median(out_times), statistics.median(in_times)


def _time_cpu(nbytes: int, repeats: int) -> float:
    source = torch.ones(nbytes, dtype=torch.uint8)
    target = torch.empty(nbytes, dtype=torch.uint8)
    times = []
    for run in range(repeats + 1):  # the first run warms up (page faults)
        begin = time.perf_counter()
        target.copy_(source)
        if run:
            times.append(time.perf_counter() - begin)
    return statistics.median(times)


def measure_transfers(device: torch.device, *, sizes: Sequence[int] = CUDA_SIZES, repeats: int = 5) -> TransferModel:
    """The transfer model of ``device``'s host-device copies (see the module docstring); ``sizes``
    are the two or more copy sizes fitted on CUDA."""
    if device.type != "cuda":
        rate = CPU_SIZE / _time_cpu(CPU_SIZE, repeats)
        return TransferModel(rate, rate, 0.0, overlap=False, device=str(device))
    if len(set(sizes)) < 2:
        raise ValueError("measuring transfers needs at least two different sizes")
    timed = [_time_cuda(device, n, repeats) for n in sizes]
    d2h, d2h_latency = _fit(sizes, [t[0] for t in timed])
    h2d, h2d_latency = _fit(sizes, [t[1] for t in timed])
    return TransferModel(d2h, h2d, (d2h_latency + h2d_latency) / 2, overlap=True, device=str(device),
                         compute_slowdown=CUDA_COMPUTE_SLOWDOWN)  # fmt: skip
