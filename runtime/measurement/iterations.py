"""Whole iterations of a runnable graph on the machine: their median time and the peak of their
own memory (on CUDA from the caching allocator, on CPU from the profiler's memory events), and
which device a list of tensors trains on. The per-node profiler, the copy-contention measurement,
calibration and the measured choice all time iterations with these."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mutwo.ir.memory import allocation_size


@dataclass
class IterationMeasurement:
    """Whole iterations through the generated code: median time and the peak of the graph's own memory."""

    seconds: float
    peak_bytes: int | None
    runs: int


def device_of(tensors: list[torch.Tensor]) -> torch.device:
    """The GPU the tensors train on, or the CPU (CPU scalars such as learning rates do not count)."""
    return next((t.device for t in tensors if isinstance(t, torch.Tensor) and t.device.type == "cuda"),
                torch.device("cpu"))  # fmt: skip


def device_bytes(tensors: list[torch.Tensor], device: torch.device) -> int:
    """Bytes the distinct storages of ``tensors`` on ``device`` take in the allocator."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.device == device:
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = allocation_size(storage.nbytes(), str(device))
    return sum(seen.values())


def measure_iterations(module: Callable[..., Any], inputs: list[torch.Tensor], *, runs: int = 10,
                       warmup: int = 3, before_each: Callable[[], None] | None = None) -> IterationMeasurement:
    """Median time of whole iterations of ``module`` on clones of ``inputs``, and on CUDA the peak
    of the iteration's own memory: the allocator's peak minus what was allocated before that is not
    one of the iteration's inputs. ``before_each`` runs before each iteration's clock starts (on
    CUDA: work it enqueues on other streams runs beside the iteration)."""
    device = device_of(inputs)
    cuda = device.type == "cuda"
    state = [t.clone() for t in inputs]
    times: list[float] = []
    peak: int | None = None
    with torch.no_grad():
        for run in range(warmup + runs):
            if cuda:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                baseline = torch.cuda.memory_allocated(device) - device_bytes(state, device)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                if before_each is not None:
                    before_each()
                start.record()
                outputs = module(*state)
                end.record()
                del outputs
                torch.cuda.synchronize(device)
                seconds = start.elapsed_time(end) / 1e3
                run_peak = torch.cuda.max_memory_allocated(device) - baseline
            else:
                if before_each is not None:
                    before_each()
                begin = time.perf_counter()
                outputs = module(*state)
                del outputs
                seconds, run_peak = time.perf_counter() - begin, None
            if run >= warmup:
                times.append(seconds)
                if run_peak is not None:
                    peak = run_peak if peak is None else max(peak, run_peak)
    if peak is not None:  # a CUDA graph allocated the iteration's memory once, when it recorded it
        peak = max(peak, device_bytes(state, device) + getattr(module, "recorded_peak_bytes", 0))
    return IterationMeasurement(statistics.median(times), peak, runs)


def cpu_iteration_peak(run: Callable[..., Any], inputs: list[torch.Tensor]) -> int:
    """Peak bytes one iteration of ``run`` allocates on the CPU beyond its inputs, from the
    profiler's memory events (the CPU allocator keeps no peak statistics): how Inductor's buffer
    lifetimes compare with the plan's without a GPU. Runs once to warm up, then once measured,
    on clones of ``inputs``."""
    from torch.profiler import ProfilerActivity, profile

    state = [t.clone() for t in inputs]
    with torch.no_grad():
        run(*[t.clone() for t in inputs])
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as recorded:
            outputs = run(*state)
            del outputs
    events = [e for e in recorded.profiler.kineto_results.events() if e.name() == "[memory]"]  # type: ignore[union-attr]
    current = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        current += event.nbytes()
        peak = max(peak, current)
    return peak
