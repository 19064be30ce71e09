"""The largest batch size whose optimized iteration fits a memory limit (``mutwo.fit_batch``,
``mutwo-opt --fit 16GiB``).

The search predicts, then measures. For each batch size tried, the iteration is captured (traced
over fake tensors: of that size only the batch itself is allocated) and the pipeline
``optimizer,select`` plans it against a *planning budget*: the limit less a safety margin (10% by
default) for what the simulator does not see — the allocator's rounding and fragmentation between
large blocks, library workspaces. The largest batch whose plan fits is found by doubling, then
bisection (:mod:`mutwo.runtime.planning.fit_search`), each try planned from the per-op profile of
the nearest batch size profiled so far, scaled linearly: a cheap heuristic.

The batch the search finds is then profiled at its own size — in memory when its unoptimized step
fits under the limit, out of core otherwise — and planned again from that profile
(:mod:`mutwo.runtime.planning.fit_planner`). Where that plan no longer fits the planning budget
(a workspace or a time that grows faster than the batch), the search steps back below it at the
same budget, now scaling from that profile. So every batch returned or measured is planned from a
profile measured at its own size, each size profiled at most once, and its predicted peak and time
come from that profile; ``FitPoint.profile`` says which profile each plan came from.

On a GPU the batch found is then rewritten and run, the process capped at the limit with
``torch.cuda.set_per_process_memory_fraction``. When that measured run runs out of memory or
peaks above the limit, the search steps back: it plans again with a lower budget (lowered by the
measured overshoot, or by a fixed step when the run ran out of memory) below the batch that
failed, and measures that (profiled at its own size first). After a failure followed by a success
it bisects the budget between them while measured runs remain (4 at most). Every attempt is
reported. On a CPU nothing is measured: the answer is the prediction at the planning budget, from
the batch's own profile.

What the prediction assumes, and says in fit.json (``ASSUMPTIONS``): per-op times and workspaces
of a batch only tried are scaled linearly from the nearest batch size profiled (the graph of every
batch size must have the same nodes; the search refuses otherwise); those of the batch returned
are its own.
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from mutwo.ir import to_fx
from mutwo.ir.budget import BudgetError, parse_bytes, readable_bytes
from mutwo.passes.select import Plan
from mutwo.runtime.capture.iteration import LossFn
from mutwo.runtime.measurement.equivalence import random_stream_kept
from mutwo.runtime.measurement.iterations import device_bytes, measure_iterations
from mutwo.runtime.planning.captured import CapturedGraph, capture_graph
from mutwo.runtime.planning.fit_planner import BatchProfiles, Planner
from mutwo.runtime.planning.fit_search import (
    ASSUMPTIONS,
    Attempt,
    FitError,
    FitPoint,
    FitResult,
    Search,
    search,
)

__all__ = ["ASSUMPTIONS", "Attempt", "FitError", "FitPoint", "FitResult", "Fitted", "Measure", "Measured",
           "check_max_slowdown", "fit", "fit_batch", "measure_capped", "parse_limit", "search"]  # fmt: skip

#: The share of the limit kept free of the plan, for what the simulator does not see (docs/fit.md).
DEFAULT_MARGIN = 0.1
#: Measured runs at most: each costs a capture, a plan and two iterations at the batch tried.
MAX_RUNS = 4
#: After a run out of memory (whose peak is unknown), the next planning budget is this share of the last.
OOM_STEP = 0.8
#: After a run over the limit, the next planning budget is the last one scaled by limit / peak, times this.
OVER_STEP = 0.95
#: Bisection between a failed and a fitting budget stops when they are this share of the limit apart.
RESOLUTION = 0.04


@dataclass
class Measured:
    """One measured run: its peak and time per iteration, or why it failed (out of memory)."""

    peak: int | None
    seconds: float | None
    error: str = ""
    #: times the caching allocator emptied its cache and retried an allocation during the run: each
    #: one synchronises the GPU, so near the limit a fragmented cache slows every iteration
    allocator_retries: int | None = None
    reserved_peak: int | None = None  #: the allocator's peak of reserved (allocated + cached) bytes


#: Runs the rewritten iteration at a batch size, capped at the limit: ``measure(batch, lowered,
#: limit_bytes)``; the default on CUDA is :func:`measure_capped`. Tests inject one that fails.
Measure = Callable[[int, CapturedGraph, int], Measured]


def measure_capped(batch: int, lowered: CapturedGraph, limit_bytes: int) -> Measured:
    """Whole iterations of ``lowered`` (at ``batch``) on its GPU (1 warm-up, 1 measured), the process capped at
    the limit. The run uses clones of the state (parameters, optimizer state), so what the process
    already holds is allowed on top of the limit: the live originals, which a training process
    would not hold twice, and whatever else it keeps (another model; a CUDA graph's private pool,
    which emptying the cache does not return, left 256 MiB runs of a tiny MLP out of memory after
    the other GPU tests). The peak it reports is the iteration's own, clones included."""
    device = lowered.device
    gc.collect()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    # The cap counts the allocator's reserved memory, so what is reserved now goes on top.
    allowed = limit_bytes + max(torch.cuda.memory_reserved(device), device_bytes(lowered.inputs, device))
    torch.cuda.set_per_process_memory_fraction(min(1.0, allowed / total), device)
    torch.cuda.reset_peak_memory_stats(device)
    retries_before = torch.cuda.memory_stats(device).get("num_alloc_retries", 0)

    def allocator(failed: bool) -> tuple[int, int, str]:
        """Retries during the run, the reserved peak, and what the cache held beyond live tensors.
        The allocation that fails counts one retry (the allocator empties its cache before giving
        up): a failed run's own last retry is not thrashing."""
        stats = torch.cuda.memory_stats(device)
        reserved, allocated = stats.get("reserved_bytes.all.peak", 0), stats.get("allocated_bytes.all.peak", 0)
        held = (f"; the allocator had reserved {readable_bytes(reserved)} for a peak of {readable_bytes(allocated)} "
                "allocated" if reserved > 1.05 * allocated else "")  # fmt: skip  (segments round up by a few percent)
        return max(0, stats.get("num_alloc_retries", 0) - retries_before - failed), reserved, held

    try:
        measured = measure_iterations(to_fx(lowered.graph), lowered.inputs, runs=1, warmup=1)
    except torch.OutOfMemoryError:
        retries, reserved, held = allocator(failed=True)
        return Measured(None, None, f"out of memory under the cap{held}", retries, reserved)
    except RuntimeError as error:  # cuBLAS and cuDNN report a failed allocation in their own words
        first = (str(error).strip().splitlines() or [""])[0]
        if not any(sign in first for sign in ("out of memory", "ALLOC_FAILED")):
            raise
        retries, reserved, held = allocator(failed=True)
        return Measured(None, None, f"out of memory under the cap ({first[:120]}){held}", retries, reserved)
    else:
        retries, reserved, _ = allocator(failed=False)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        gc.collect()
        torch.cuda.empty_cache()
    return Measured(measured.peak_bytes, measured.seconds, "", retries, reserved)


def parse_limit(memory: str | int) -> int:
    """A memory limit in bytes, from bytes or text with a unit (``16GiB``)."""
    if isinstance(memory, int):
        return memory
    try:
        return parse_bytes(memory)
    except BudgetError as error:
        raise FitError(f"memory limit: {error}") from None


def check_max_slowdown(max_slowdown: float | None) -> float | None:
    """The bound on a plan's predicted slowdown: at least 1 (the step without recomputation), or None."""
    if max_slowdown is not None and not max_slowdown >= 1:
        raise FitError(f"max slowdown {max_slowdown} is below 1, the time of the step without recomputation: "
                       "give a factor like 1.3 (at most 30% slower)")  # fmt: skip
    return max_slowdown


def check_margin(margin: float) -> float:
    """The safety margin, a share of the limit in [0, 1)."""
    if not 0 <= margin < 1:
        raise FitError(f"margin {margin} is not a share of the limit: give a number from 0 (none) to below 1, "
                       f"like {DEFAULT_MARGIN}")  # fmt: skip
    return margin


@dataclass
class Fitted:
    """A finished search: the result, and the plan of the batch found (None when none was)."""

    result: FitResult
    plan: Plan | None


def fit(capture_at: Callable[[int], CapturedGraph], start: int, limit_bytes: int, *,
        margin: float = DEFAULT_MARGIN, max_slowdown: float | None = None, measure: Measure | None = None,
        max_runs: int = MAX_RUNS, log: Callable[[str], None] = lambda message: None,
        progress: Callable[[FitResult], None] = lambda result: None,
        timed: Callable[[str], AbstractContextManager[object]] = lambda phase: nullcontext()) -> Fitted:  # fmt: skip
    """Profile the iteration at ``start``, search (``capture_at(batch)`` captures it at a batch
    size), profile the batch found at its own size and plan it again from that profile, stepping
    back below it when it no longer fits; rewrite it and, with ``measure`` (given, or by default on
    a GPU), run it capped at the limit, stepping back after a failed run (see the module docstring).
    ``result.best`` is None when no batch measured within the limit; ``result.failure`` says why.
    ``progress`` sees the result so far after every search, re-plan and measured run. With
    ``max_slowdown``, a batch fits only if its plan also predicts at most that many times the time
    of the step without recomputation. ``timed(phase)`` surrounds its phases, ``profile``,
    ``plan`` (which captures the batch sizes it tries with ``capture_at``) and ``measure``, for a
    caller that times them (``--time-passes``)."""
    budget = int(limit_bytes * (1 - check_margin(margin)))
    check_max_slowdown(max_slowdown)
    began = time.perf_counter()

    def note(message: str) -> None:
        log(f"fit [{time.perf_counter() - began:6.1f} s] {message}")

    base = capture_at(start)
    if measure is None and base.device.type == "cuda":
        measure = measure_capped
    note(f"profiling batch size {start} first: the search scales the nearest batch size profiled to the sizes it "
         "tries, and profiles each batch it finds at its own size")  # fmt: skip
    planner = Planner(capture_at, BatchProfiles(limit_bytes, note, timed), note, max_slowdown)
    planner.start(start, base)
    del base
    result = FitResult(limit_bytes, start, margin, budget, max_slowdown)
    result.profiles = planner.profiles.records()
    kept: Plan | None = None  # the plan of ``fitting`` (no tensors: a later run must not pay for them)
    fitting: Attempt | None = None  # the largest batch measured within the limit
    failed: Attempt | None = None  # the smallest batch whose measured run failed
    top: int | None = None  # the largest batch left to try: below the smallest that failed, re-planned or run
    guess = start
    while True:
        with timed("plan"):
            found = search(lambda batch, at=budget: planner.predict(batch, at), guess, budget, top,
                           frozenset(planner.graphs), limit_bytes)  # fmt: skip
        result.tried.extend(found.tried)
        result.stopped_at_max_batch = found.capped
        progress(result)
        if found.best is None or (fitting is not None and found.best.batch_size <= fitting.batch_size):
            break  # nothing new to measure at this budget
        with timed("plan"):
            planned = planner.rewrite(found.best.batch_size, budget)
        point = planned.point
        result.tried.append(point)
        result.profiles = planner.profiles.records()
        progress(result)
        if not point.fits:
            # Planned from its own profile, the batch is no longer the search's answer: search
            # again below it at the same budget, as after a failed run, from the nearest profile,
            # and no higher than halfway down to the largest batch whose own profile fits: where
            # that profile says little (none could be measured), bisecting profiles a few batches
            # instead of stepping down one at a time.
            del planned  # its batch's tensors: the next search should not hold them
            top = guess = _halfway_below(point, result.tried)
            note(f"batch {point.batch_size} does not fit once profiled at its own size: searching again up to "
                 f"batch {top}")  # fmt: skip
            if top < 1:
                found = Search(failure=f"not even batch size 1 fits: {point.shortfall(limit_bytes)}, planned from "
                                       f"its own profile; give it more memory or train a smaller model; planning "
                                       f"batch 1: {point.note}")  # fmt: skip
                break
            continue
        if measure is None:
            result.best = point
            return Fitted(result, planned.plan)
        note(f"measuring batch {point.batch_size} capped at {readable_bytes(limit_bytes)}")
        with timed("measure"):
            attempt = Attempt.of(point, measure(point.batch_size, planned.lowered, limit_bytes), limit_bytes)
        result.attempts.append(attempt)
        progress(result)
        note(attempt.describe())
        if attempt.fits:
            fitting, result.best, kept = attempt, point, planned.plan
        else:
            failed, top = attempt, attempt.batch_size - 1
        del planned
        next_budget = _next_budget(fitting, failed, limit_bytes)
        if next_budget is None or len(result.attempts) >= max_runs:
            break
        guess = max(1, int(attempt.batch_size * next_budget / budget))
        budget = next_budget
    if fitting is None:
        result.failure = _nothing_fits(result, found)
        return Fitted(result, None)
    result.measured_peak, result.measured_seconds = fitting.measured_peak, fitting.measured_seconds
    return Fitted(result, kept)


def _halfway_below(failed: FitPoint, tried: list[FitPoint]) -> int:
    """The largest batch the search may try after ``failed`` did not fit from its own profile:
    halfway between it and the largest batch that fit from its own profile at the same budget
    (0 if none did), and below it."""
    fitting = [p.batch_size for p in tried if p.fits and p.profiled_at == p.batch_size and p.budget == failed.budget
               and p.batch_size < failed.batch_size]  # fmt: skip
    low = max(fitting, default=0)
    return (low + failed.batch_size) // 2 if low < failed.batch_size - 1 else failed.batch_size - 1


def _next_budget(fitting: Attempt | None, failed: Attempt | None, limit: int) -> int | None:
    """The planning budget of the next measured run, or None when the search is done: below a
    failure with nothing measured to fit yet, lowered by its overshoot (by a fixed step when the
    run ran out of memory); between a failure and a success, their middle."""
    if failed is None:
        return None  # the first run fit: the simulator's answer with its margin stands
    if fitting is None:
        peak = failed.measured_peak
        return int(failed.planned_budget * (OOM_STEP if peak is None else min(1.0, limit / peak) * OVER_STEP))
    if failed.planned_budget - fitting.planned_budget <= RESOLUTION * limit:
        return None
    return (failed.planned_budget + fitting.planned_budget) // 2


def _nothing_fits(result: FitResult, last: Search) -> str:
    """Why no batch was found, in one line: the search's reason, or every measured run."""
    if not result.attempts:
        return last.failure
    runs = "; ".join(a.describe() for a in result.attempts)
    then = f"; then {last.failure}" if last.best is None and last.failure else ""
    return (f"no batch size measured within {readable_bytes(result.limit_bytes)} in {len(result.attempts)} runs "
            f"({runs}){then}; give a larger limit or a larger margin")  # fmt: skip


def fit_batch(model: torch.nn.Module, optimizer: torch.optim.Optimizer, make_batch: Callable[[int], object],
              loss_fn: LossFn, memory: str | int, *, start: int = 1, margin: float = DEFAULT_MARGIN,
              max_slowdown: float | None = None, measure: Measure | None = None,
              verbose: bool = False) -> FitResult:  # fmt: skip
    """The largest batch size whose optimized iteration fits in ``memory`` (``"16GiB"`` or bytes).

    ``make_batch(n)`` returns a batch of ``n`` samples on the training device. The iteration is
    planned (optimizer passes and recomputation) at the batch sizes the search tries, against
    ``memory`` less ``margin`` of it, and the batch found is profiled at its own size and planned
    again from that profile; see the module docstring. On a GPU (or with ``measure``) the batch
    found is measured capped at ``memory``, stepping back after a failed run; :class:`FitError`
    when no batch fits. ``max_slowdown`` (like 1.3) also bounds the plan's predicted time against
    the step without recomputation: the largest batch is often not
    the fastest training, since each recomputed activation costs time.
    """
    log = (lambda message: print(message, file=sys.stderr)) if verbose else (lambda message: None)
    limit = parse_limit(memory)
    with random_stream_kept(model):  # the caller's training draws what it would have without the search
        fitted = fit(lambda n: capture_graph(model, optimizer, make_batch(n), loss_fn), start, limit, margin=margin,
                     max_slowdown=max_slowdown, measure=measure, log=log)  # fmt: skip
    if fitted.result.failure:
        raise FitError(fitted.result.failure)
    return fitted.result
