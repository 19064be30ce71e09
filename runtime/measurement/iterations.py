"""Whole iterations of a runnable graph on the machine: their median time and the peak of their
own memory (on CUDA from the caching allocator, on CPU from the profiler's memory events), on
CUDA also what they made the process hold, and which device a list of tensors trains on. The
per-node profiler, the copy-contention measurement, calibration and the measured choice all time
iterations with these."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mutwo.ir.memory import allocation_size


@dataclass
class IterationMeasurement:
    """Whole iterations through the generated code: median time, the peak of the graph's own memory
    (allocated bytes) and, on CUDA, the peak of what the iterations made the process hold
    (``held_bytes``: the allocator's reserved bytes, cached blocks and CUDA-graph pools included,
    which is what ``torch.cuda.set_per_process_memory_fraction`` caps and what a user's
    ``torch.cuda.max_memory_reserved()`` reports)."""

    seconds: float
    peak_bytes: int | None
    runs: int
    held_bytes: int | None = None


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
                       warmup: int = 3, before_each: Callable[[], None] | None = None,
                       on_inputs: bool = False) -> IterationMeasurement:  # fmt: skip
    """Median time of whole iterations of ``module`` on clones of ``inputs``, and on CUDA the peak
    of the iteration's own memory: the allocator's peak minus what was allocated before that is not
    one of the iteration's inputs. Held memory is counted the same way from the allocator's
    reserved bytes, over every iteration, warm-up included (a CUDA graph's pool is made then and
    stays), after the cache is emptied of what others left (see :func:`held_baseline`).
    ``before_each`` runs before each iteration's clock starts (on CUDA: work it enqueues on other
    streams runs beside the iteration).

    ``on_inputs``: run on ``inputs`` themselves, their values kept in host memory meanwhile and put
    back after, instead of on device clones. The process then holds what a training loop holds
    (one copy of the model and optimizer state), which is what a step planned under a memory limit
    must be measured with: a second copy on the device ran Llama-0.5B's measurement out of memory
    under a 12 GiB limit, and made BERT-base's miss its limit by the copy. Held memory is then
    what the process holds in all, as a user's ``torch.cuda.max_memory_reserved()`` reads it: the
    segments the inputs live in hold more than their bytes (on the H200 a CUDA-graph step held 4%
    more in a training loop than its iterations' reserved bytes above them with the inputs counted
    by their bytes)."""
    device = device_of(inputs)
    cuda = device.type == "cuda"
    released = held_baseline(device) if cuda else 0
    if not on_inputs:
        return _measure(module, [t.clone() for t in inputs], device, runs, warmup, before_each, released)
    with values_kept_on_host(inputs):
        return _measure(module, list(inputs), device, runs, warmup, before_each, 0)


@contextlib.contextmanager
def values_kept_on_host(tensors: Sequence[torch.Tensor]) -> Iterator[None]:
    """Run the body on ``tensors`` themselves and put their values back when it ends, however it
    ends (out of memory half-way included): the old values wait in host memory, not as device
    copies, which a memory limit at the budget has no room for."""
    saved = [t.to("cpu", copy=True) for t in tensors]
    try:
        yield
    finally:
        with torch.no_grad():
            for tensor, old in zip(tensors, saved, strict=True):
                tensor.copy_(old)


def _measure(module: Callable[..., Any], state: list[torch.Tensor], device: torch.device, runs: int, warmup: int,
             before_each: Callable[[], None] | None, held_base: int) -> IterationMeasurement:  # fmt: skip
    """:func:`measure_iterations` on ``state`` as given."""
    cuda = device.type == "cuda"
    times: list[float] = []
    peak: int | None = None
    held: int | None = None
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
                held = max(held or 0, torch.cuda.max_memory_reserved(device) - held_base)
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
    return IterationMeasurement(statistics.median(times), peak, runs, held)


def held_baseline(device: torch.device) -> int:
    """What the process holds on ``device`` before an iteration is measured, with the allocator's
    cache emptied first: blocks others freed (a profile, another plan's step) would otherwise be
    reused by the iteration and hide what it makes the process reserve."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved(device)


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
