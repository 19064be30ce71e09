"""Measuring a training step as a user's loop would run it (``mutwo-experiment``, the benchmarks).

:func:`build_training` builds a config's model, optimizer and batch on its device
(:class:`Training`, whose :meth:`Training.eager_step` is the eager loop); :func:`measure_step`
runs a step for warm-up iterations, then takes the median time of the measured ones and, on CUDA,
their max allocated and max reserved (held) memory, as a plain training loop would read them.
Running out of memory is a result, not a crash. :func:`device_turn` lets processes planning side
by side measure one at a time. ``bench/compare.py``, ``bench/data_parallel.py`` and
``bench/plan_stability.py`` measure their variants with these.
"""

from __future__ import annotations

import contextlib
import fcntl
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mutwo.runtime.capture.batch_call import batch_call
from mutwo.runtime.capture.training import PRECISIONS, TrainingOptions
from mutwo.runtime.measurement.device_memory import free_planning_leftovers
from mutwo.runtime.measurement.expandable_segments import current_settings

OUT_OF_MEMORY = "out of memory"


@contextlib.contextmanager
def device_turn(lock: Path | None) -> Iterator[None]:
    """Hold ``lock`` (an exclusive ``flock`` on that file) while measuring on the device during
    planning, so that processes planning side by side (``bench/compare.py --parallel-planning``)
    measure one at a time: four BERT-base processes calibrating at once on an 80 GB H100 ran out
    of memory (2026-11-26). ``None``: nothing to share the device with."""
    if lock is None:
        yield
        return
    with lock.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            # What the measurement left in the allocator's cache goes back before the next process
            # measures (an Inductor step keeps no recording to release; its blocks stay cached).
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            fcntl.flock(handle, fcntl.LOCK_UN)


def measure_step(step: Callable[[], Any], device: torch.device, *, warmup: int, iterations: int) -> dict[str, Any]:
    """Median time of ``iterations`` whole steps after ``warmup`` and, on CUDA, their memory:
    ``peak_bytes`` (max allocated) and ``held_bytes`` (max reserved: what the process holds).
    On CUDA a step is timed by CUDA events, and ``iteration_wall_ms_all`` gives each step by the
    host's clock too (``bench/plain_loop.py``'s way): ResNet-152's checkpointed step, bound by the
    host's launches, moves by 7% from one process to the next, so the two clocks tell the loop's
    timing from the process's (docs/benchmarks.md).

    Running out of memory is a result, not a crash: it comes back as ``{"error": "out of memory"}``.
    """
    cuda = device.type == "cuda"
    times: list[float] = []
    wall: list[float] = []  # on CUDA, beside the events: the host's clock, as bench/plain_loop.py times
    try:
        for _ in range(warmup):
            step()
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        for _ in range(iterations):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin = time.perf_counter()
                start.record()
                step()
                end.record()
                torch.cuda.synchronize(device)
                wall.append((time.perf_counter() - begin) * 1e3)
                times.append(start.elapsed_time(end))
            else:
                begin = time.perf_counter()
                step()
                times.append((time.perf_counter() - begin) * 1e3)
    except torch.OutOfMemoryError:
        return {"error": OUT_OF_MEMORY}
    return {
        "iteration_ms": statistics.median(times),
        "iteration_ms_all": [round(t, 3) for t in times],
        **({"iteration_wall_ms_all": [round(t, 3) for t in wall]} if wall else {}),
        "peak_bytes": max(torch.cuda.max_memory_allocated(device), getattr(step, "recorded_peak_bytes", 0))
        if cuda else None,
        # What the process held: the allocator's cache and CUDA-graph pools included (the reset
        # above starts it at what warm-up left reserved), what a card runs out at.
        "held_bytes": torch.cuda.max_memory_reserved(device) if cuda else None,
    }


def measure_after_planning(step: Callable[[], Any], device: torch.device, memory_limit: int | None, *,
                           warmup: int, iterations: int, trace: Path | None = None,
                           planned: bool = True) -> dict[str, Any]:  # fmt: skip
    """Free what planning left in the allocator's cache (``planned``: as ``mutwo.optimize`` does
    before it returns), cap memory if asked, and measure; with ``trace``, then profile 3 more
    iterations per stream (:mod:`mutwo.tools.stream_trace`). A step nothing planned (eager,
    checkpointing, ``torch.compile``) gives ``planned=False``: a user's loop empties no cache, and
    what its first steps left cached is part of what it holds (on the H100, emptying the cache
    after BERT-base b64's first eager step lowered the held memory of the steps after it from
    35,306 to 32,474 MiB)."""
    row: dict[str, Any] = {}
    if planned:
        free_planning_leftovers(device)
    if device.type == "cuda":
        row["allocator"] = current_settings()  # expandable segments or not: what the held bytes depend on
        if memory_limit is not None:
            total = torch.cuda.get_device_properties(device).total_memory
            index = device.index if device.index is not None else torch.cuda.current_device()
            torch.cuda.set_per_process_memory_fraction(min(1.0, memory_limit / total), index)
            row["memory_limit_bytes"] = memory_limit
    row.update(measure_step(step, device, warmup=warmup, iterations=iterations))
    if trace is not None and "error" not in row:
        from mutwo.tools.stream_trace import trace_iterations

        row["streams"] = trace_iterations(step, device, trace)
    return row


@dataclass
class Training:
    """A model, its optimizer, a batch and the loss, built from a config and moved to the device."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    batch: Any
    loss_fn: Callable[[Any, Any], torch.Tensor]
    device: torch.device
    options: TrainingOptions = field(default_factory=TrainingOptions)  #: clipping, precision, scaler

    def eager_step(self, model: torch.nn.Module | None = None) -> Callable[[], None]:
        """One eager iteration as a user writes it (``model`` defaults to the built one), with the
        config's autocast, gradient clipping and grad scaler."""
        runner = model if model is not None else self.model
        dtype = PRECISIONS[self.options.precision]
        scaler = self.options.scaler
        call = batch_call(runner, self.batch)  # as the captured step calls them (runtime/capture/batch_call.py)
        args, kwargs = call.model_arguments(self.batch)
        loss_batch = call.loss_batch(self.batch)

        def step() -> None:
            self.optimizer.zero_grad(set_to_none=True)
            with torch.autocast(self.device.type, dtype=dtype, enabled=dtype is not None):
                # The output is not named: held by a local through the backward, the logits of a
                # language model (3,816 MiB for BERT-base b64) would count in eager's peak.
                loss = self.loss_fn(runner(*args, **kwargs), loss_batch)
            (scaler.scale(loss) if scaler is not None else loss).backward()
            if scaler is not None:
                scaler.unscale_(self.optimizer)
            if self.options.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(runner.parameters(), self.options.max_grad_norm,
                                               self.options.norm_type)  # fmt: skip
            if scaler is not None:
                scaler.step(self.optimizer)
                scaler.update()
            else:
                self.optimizer.step()

        return step


def build_training(config_path: str | Path, batch_size: int, device: str | None = None,
                   precision: str | None = None) -> Training:  # fmt: skip
    """Build the config's model, batch and optimizer at ``batch_size`` on its device (``precision``
    overrides the config's)."""
    from mutwo.tools.config import apply_overrides, load_config
    from mutwo.tools.workloads import build_optimizer, build_workload, target_device, to_device, training_options

    config = apply_overrides(load_config(config_path), batch_size=batch_size, device=device, precision=precision)
    target = target_device(config)
    torch.manual_seed(config.seed)
    workload = build_workload(config)
    model = workload.model.to(target)
    return Training(model, build_optimizer(config, model), to_device(workload.batch, target), workload.loss_fn, target,
                    training_options(config, target))  # fmt: skip
