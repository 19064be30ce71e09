"""The searching half of ``--fit``: what it records (a batch planned, a measured run, the whole
fit) and the search for the largest batch whose plan fits (:func:`search`).
:class:`mutwo.runtime.planning.fit_planner.Planner` plans each batch the search tries;
:mod:`mutwo.runtime.planning.fit` measures what they predict."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mutwo.ir.budget import readable_bytes

#: What the search plans each batch size with (the profile is given). A batch whose budget is out
#: of reach does not fit: searching on for its lowest reachable peak would only cost minutes.
FIT_PIPELINE = "optimizer,select{lowest=false}"
#: What the prediction rests on (the module docstring of mutwo.runtime.planning.fit says it at length).
ASSUMPTIONS = ("the batch found, and every batch measured, is planned from per-op times and workspaces profiled at "
               "its own size (in memory when its unoptimized step fits under the limit, out of core otherwise); a "
               "batch the search only tries is planned from the profile of the nearest batch size profiled, scaled "
               "linearly with the batch size; each batch is planned against the limit less the margin, and on a GPU "
               "the batch found is measured under a cap at the limit")  # fmt: skip
#: The largest batch size the search tries.
MAX_BATCH = 1 << 16


class FitError(ValueError):
    """No batch fits, graphs differ between batch sizes, or planning crashed."""


@dataclass
class FitPoint:
    """One batch size planned: whether its plan fits the planning budget, and the simulated peak."""

    batch_size: int
    fits: bool
    predicted_peak: int  #: the plan's simulated peak (0 when planning failed before simulating)
    note: str = ""  #: why it does not fit, or what the plan does
    budget: int = 0  #: the planning budget, bytes
    seconds: float = 0.0  #: what capturing (the first time) and planning it took
    too_slow: bool = False  #: it fits in memory, but its plan is predicted slower than the bound allows
    #: when it does not fit: the bytes every plan of it needs at least (0 when unknown: select
    #: stopped at a plan above the budget without searching for the lowest)
    needs: int = 0
    #: the batch size whose measured profile gave the plan its per-op times and workspaces: this
    #: one for the batch found and every batch measured, the nearest profiled for the others
    profiled_at: int = 0
    #: that profile in words: "measured at batch 512, out of core", or "..., scaled ×2.00" where
    #: it was measured at another batch size
    profile: str = ""
    #: the plan's predicted time per iteration, recomputation included, from that profile (None
    #: when planning stopped before a plan)
    predicted_seconds: float | None = None

    def shortfall(self, limit: int) -> str:
        """What it needs against ``limit`` (of which the planning budget is what the margin leaves):
        ``it needs at least 3.2 MiB, the limit is 2.0 MiB (1.8 MiB to plan for after the margin)``."""
        if self.too_slow:
            return f"its plan fits in {readable_bytes(self.budget)} but is too slow"
        held = f" ({readable_bytes(self.budget)} to plan for after the margin)" if self.budget < limit else ""
        if not self.needs and not self.predicted_peak:  # not planned: its profile could not be measured
            return f"it could not be planned, the limit is {readable_bytes(limit)}{held}"
        needs = (f"it needs at least {readable_bytes(self.needs)}" if self.needs else
                 f"its best plan peaks at {readable_bytes(self.predicted_peak)}")  # fmt: skip
        return f"{needs}, the limit is {readable_bytes(limit)}{held}"


@dataclass
class Attempt:
    """One measured run of a planned batch, capped at the limit."""

    batch_size: int
    planned_budget: int
    predicted_peak: int
    measured_peak: int | None
    measured_seconds: float | None  #: per iteration
    error: str  #: why the run failed ("out of memory under the cap"), else ""
    fits: bool  #: it ran, and its peak is within the limit
    allocator_retries: int | None = None  #: see :class:`mutwo.runtime.planning.fit.Measured`
    reserved_peak: int | None = None
    predicted_seconds: float | None = None  #: the plan's predicted time per iteration
    profile: str = ""  #: the profile the plan came from (:attr:`FitPoint.profile`): measured at this batch

    @classmethod
    def of(cls, point: FitPoint, measured: Any, limit: int) -> Attempt:
        """The run ``measured`` (a :class:`mutwo.runtime.planning.fit.Measured`) of the plan ``point``."""
        fits = not measured.error and measured.peak is not None and measured.peak <= limit
        return cls(point.batch_size, point.budget, point.predicted_peak, measured.peak, measured.seconds,
                   measured.error, fits, measured.allocator_retries, measured.reserved_peak,
                   point.predicted_seconds, point.profile)  # fmt: skip

    def describe(self) -> str:
        head = (f"batch {self.batch_size} (planned for {readable_bytes(self.planned_budget)}, predicted "
                f"{readable_bytes(self.predicted_peak)})")
        # Each retry empties the allocator's cache and synchronises: near the limit a cache
        # fragmented by large tensors makes every iteration pay for it.
        retried = (f"; the allocator emptied its cache and retried {self.allocator_retries} times (a fragmented "
                   "cache near the limit; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True may avoid it)"
                   if self.allocator_retries else "")  # fmt: skip
        if self.error:
            return f"{head}: {self.error}{retried}"
        peak = self.measured_peak or 0
        where = "within the limit" if self.fits else "over the limit"
        pace_text = pace(self.measured_seconds, self.batch_size)
        return f"{head}: measured {readable_bytes(peak)}, {where} ({pace_text}){retried}"


def pace(seconds: float | None, batch_size: int) -> str:
    """Time per iteration and per sample: the larger batch is often not the faster training (each
    recomputed activation costs time), and per sample is what compares across batch sizes."""
    milliseconds = (seconds or 0.0) * 1e3
    return f"{milliseconds:.1f} ms/iteration, {milliseconds / batch_size:.2f} ms/sample"


@dataclass
class Search:
    """One search at one budget: the batch sizes planned, the largest that fits, or why none does."""

    tried: list[FitPoint] = field(default_factory=list)
    best: FitPoint | None = None
    failure: str = ""
    capped: bool = False  #: the best is MAX_BATCH, the largest size the search tries: larger may fit too


@dataclass
class ProfiledBatch:
    """One batch size profiled at its own size: how, why, and what it took."""

    batch_size: int
    memory: str  #: "in memory" or "out of core"
    reason: str  #: why (the profiling choice's line, as the log gives it)
    seconds: float  #: what profiling it took
    nodes: int  #: nodes measured
    iteration_seconds: float  #: the unoptimized iteration by this profile (its nodes' times summed)


@dataclass
class FitResult:
    """The whole fit: every batch planned, every measured run, and the batch found."""

    limit_bytes: int
    profiled_batch: int  #: the starting batch size, profiled first: the search's first heuristic
    margin: float  #: the share of the limit the first plans keep free
    planning_budget: int  #: the first planning budget: the limit less the margin
    #: the bound on a plan's predicted time against the step without recomputation (None: no bound)
    max_slowdown: float | None = None
    #: every batch planned: by the search (most from a scaled profile), and each batch it found
    #: planned again from its own profile (``profile`` says which)
    tried: list[FitPoint] = field(default_factory=list)
    attempts: list[Attempt] = field(default_factory=list)
    #: the batch found (on a GPU: the largest measured within the limit), planned from its own profile
    best: FitPoint | None = None
    profiles: list[ProfiledBatch] = field(default_factory=list)  #: every batch size profiled, in order
    measured_peak: int | None = None  #: of the batch found
    measured_seconds: float | None = None
    failure: str = ""  #: why no batch was found ('' when one was)
    #: the batch found is MAX_BATCH, the largest the search tries: a larger one may fit too
    stopped_at_max_batch: bool = False
    assumptions: str = ASSUMPTIONS

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def search(predict: Callable[[int], FitPoint], start: int, budget: int, max_batch: int | None = None,
           cheap: frozenset[int] = frozenset(), limit: int | None = None) -> Search:  # fmt: skip
    """The largest batch size in 1..max_batch for which ``predict`` says it fits (fitting is
    assumed monotone in the batch size): doubling from ``start`` (or bisecting below it), then
    bisection until the gap to the smallest size that does not fit is at most 1/16 of the size
    found (each try is a capture and a plan: the last few percent are not worth their minutes).
    Bisection tries the size in ``cheap`` (already captured) nearest the middle when one lies in
    the middle half of the gap. ``limit`` (the budget when not given) is what a failure names as
    the memory batch 1 would need to fit in."""
    top = MAX_BATCH if max_batch is None else max_batch
    found = Search()
    if top < 1:
        found.failure = "no batch size below the smallest one that failed is left to try"
        return found
    cache: dict[int, FitPoint] = {}

    def fits(batch: int) -> bool:
        if batch not in cache:
            cache[batch] = predict(batch)
            found.tried.append(cache[batch])
        return cache[batch].fits

    low, high = 0, None  # low fits (0: none known), high does not
    batch = min(max(start, 1), top)
    while high is None:
        if fits(batch):
            low = batch
            if batch == top:
                break
            batch = min(2 * batch, top)
        else:
            high = batch
    if high is not None:
        while high - low > max(1, low // 16):
            middle = (low + high) // 2
            near = [b for b in cheap if abs(b - middle) <= (high - low) // 4 and low < b < high]
            middle = min(near, key=lambda b: abs(b - middle)) if near else middle
            low, high = (middle, high) if fits(middle) else (low, middle)
    if low == 0:
        first = cache[1]
        found.failure = (f"not even batch size 1 fits: {first.shortfall(limit or budget)}; give it more memory or "
                         f"train a smaller model; planning batch 1: {first.note}")  # fmt: skip
        return found
    found.best = cache[low]
    found.capped = low == MAX_BATCH
    return found
