"""The predicting half of ``--fit``: plan an iteration at a batch size against a budget with a
scaled profile (:class:`Planner`), and find the largest batch whose plan fits (:func:`search`).
:mod:`mutwo.runtime.planning.fit` measures what these predict."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mutwo.ir.budget import Budget, UnreachableBudget, counted, readable_bytes
from mutwo.ir.graph import Graph
from mutwo.ir.pass_base import PassContext
from mutwo.ir.pass_manager import Instrumentation, PassManager, PipelineFailure
from mutwo.ir.printer import fingerprint
from mutwo.ir.registry import PassRegistry
from mutwo.runtime.measurement.profiler import Profile
from mutwo.runtime.planning.captured import CapturedGraph, pass_context

#: What the search plans each batch size with (the profile is given, scaled). A batch whose budget
#: is out of reach does not fit: searching on for its lowest reachable peak would only cost minutes.
FIT_PIPELINE = "optimizer,select{lowest=false}"
#: What the prediction rests on (the module docstring of mutwo.runtime.planning.fit says it at length).
ASSUMPTIONS = ("per-op times and workspaces measured once at the profiled batch size and scaled linearly with the "
               "batch size; each batch is planned against the limit less the margin, and on a GPU the batch found "
               "is measured under a cap at the limit")  # fmt: skip
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

    def shortfall(self, limit: int) -> str:
        """What it needs against ``limit`` (of which the planning budget is what the margin leaves):
        ``it needs at least 3.2 MiB, the limit is 2.0 MiB (1.8 MiB to plan for after the margin)``."""
        if self.too_slow:
            return f"its plan fits in {readable_bytes(self.budget)} but is too slow"
        held = f" ({readable_bytes(self.budget)} to plan for after the margin)" if self.budget < limit else ""
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

    @classmethod
    def of(cls, point: FitPoint, measured: Any, limit: int) -> Attempt:
        """The run ``measured`` (a :class:`mutwo.runtime.planning.fit.Measured`) of the plan ``point``."""
        fits = not measured.error and measured.peak is not None and measured.peak <= limit
        return cls(point.batch_size, point.budget, point.predicted_peak, measured.peak, measured.seconds,
                   measured.error, fits, measured.allocator_retries, measured.reserved_peak)  # fmt: skip

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
class FitResult:
    """The whole fit: every batch planned, every measured run, and the batch found."""

    limit_bytes: int
    profiled_batch: int
    margin: float  #: the share of the limit the first plans keep free
    planning_budget: int  #: the first planning budget: the limit less the margin
    #: the bound on a plan's predicted time against the step without recomputation (None: no bound)
    max_slowdown: float | None = None
    tried: list[FitPoint] = field(default_factory=list)
    attempts: list[Attempt] = field(default_factory=list)
    best: FitPoint | None = None  #: the batch found (on a GPU: the largest measured within the limit)
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


def scaled_profile(profile: Profile, profiled: Graph, graph: Graph, factor: float) -> Profile:
    """``profile`` (measured on ``profiled``) for ``graph``, the same iteration at another batch
    size: node by node in execution order, times and workspaces multiplied by ``factor``."""
    if [n.op_name for n in profiled.nodes] != [n.op_name for n in graph.nodes]:
        raise FitError("the iteration's graph changes with the batch size (other ops, not just other shapes), so "
                       "the profile cannot be scaled; use mutwo-experiment to sweep batch sizes instead")  # fmt: skip
    nodes = {}
    for old, new in zip(profiled.nodes, graph.nodes, strict=True):
        if old.id in profile.nodes:
            measured = profile.nodes[old.id]
            nodes[new.id] = dataclasses.replace(measured, seconds=measured.seconds * factor,
                                                workspace=int(measured.workspace * factor))  # fmt: skip
    return Profile(profile.device, fingerprint(graph), nodes, profile.runs, None,
                   {**profile.meta, "scaled_from_batch_size": profiled.meta.get("batch_size"), "factor": factor})


@dataclass
class Planned:
    """A batch planned and rewritten, with the inputs to run it on."""

    point: FitPoint
    lowered: CapturedGraph
    context: PassContext


class Planner:
    """Plans the iteration at any batch size against any budget, from one profile.

    Each batch size is captured once; its graph is kept (metadata only, no tensors) and every plan
    runs on a copy, so planning a batch again at another budget costs no capture. Plans made to
    search are not verified after each pass (the plan of the batch found is, and rewritten)."""

    def __init__(self, capture_at: Callable[[int], CapturedGraph], profile: Profile, profiled: Graph,
                 profiled_batch: int, log: Callable[[str], None],
                 max_slowdown: float | None = None) -> None:  # fmt: skip
        self.capture_at = capture_at
        self.profile = profile
        self.profiled = profiled
        self.profiled_batch = profiled_batch
        self.log = log
        #: a plan predicted slower than this many times the step without recomputation does not fit
        self.max_slowdown = max_slowdown
        self.graphs: dict[int, Graph] = {}

    def predict(self, batch: int, budget: int) -> FitPoint:
        """Plan ``batch`` against ``budget``: whether it fits, and the plan's simulated peak."""
        began = time.perf_counter()
        if batch not in self.graphs:
            self.graphs[batch] = self.capture_at(batch).graph
        point, _ = self.plan(self.graphs[batch].copy(), batch, budget, PassContext(device=self.profile.device),
                              verify=False)  # fmt: skip
        point.seconds = time.perf_counter() - began
        summary = point.note.splitlines()[0] if point.note else ""
        peak = f"predicted peak {readable_bytes(point.predicted_peak)}" if point.predicted_peak else "not simulated"
        verdict = "fits" if point.fits else "fits, but too slow," if point.too_slow else "does not fit"
        self.log(f"batch {batch}: {verdict} in {readable_bytes(budget)}, {peak} ({summary}; "
                 f"{point.seconds:.1f} s)")  # fmt: skip
        return point

    def rewrite(self, batch: int, budget: int) -> Planned:
        """Capture ``batch`` with its inputs, plan it against ``budget`` and rewrite it."""
        lowered = self.capture_at(batch)
        context = pass_context(lowered, Budget(bytes=budget))
        point, context = self.plan(lowered.graph, batch, budget, context, verify=True, final=",rewrite")
        if not point.fits:
            raise FitError(f"planning batch {batch} again failed: {point.note}")
        return Planned(point, lowered, context)

    def plan(self, graph: Graph, batch: int, budget: int, context: PassContext, *, verify: bool,
             final: str = "") -> tuple[FitPoint, PassContext]:  # fmt: skip
        """Run the fit pipeline (and ``final``) on ``graph``: the point, and the context with the plan."""
        context.services["budget"] = Budget(bytes=budget)
        context.artifacts["profile"] = scaled_profile(self.profile, self.profiled, graph, batch / self.profiled_batch)
        pipeline = PassRegistry().build_pipeline(FIT_PIPELINE + final, {"profile"})
        try:
            PassManager(pipeline, Instrumentation(verify=verify)).run(graph, context)
        except PipelineFailure as failure:
            if not isinstance(failure.cause, UnreachableBudget):
                # Not "the budget is out of reach" but a crash: that is no answer about fitting.
                raise FitError(f"planning batch {batch} failed: {failure}") from failure
            plan = context.artifacts.get("plan")  # none when select failed on its estimate alone
            # select's advice (another budget) is no answer here: the search sets the budget itself.
            return FitPoint(batch, False, plan.predicted_peak if plan else 0, failure.reason, budget,
                            needs=failure.cause.needs or 0), context  # fmt: skip
        plan = context.artifacts["plan"]
        # The plan's own estimate of what recomputation costs, relative to the step without it: the
        # price of a larger batch (per-op times scaled from the profiled batch, so a rough one).
        slower = (plan.base_seconds + plan.added_seconds) / plan.base_seconds if plan.base_seconds > 0 else None
        cost = f", predicted {slower:.2f}× the time without it" if slower is not None else ""
        count = len(plan.entries)
        note = f"{counted(count, 'activation')} recomputed{cost}"
        if self.max_slowdown is not None and slower is not None and slower > self.max_slowdown:
            return FitPoint(batch, False, plan.predicted_peak, f"{note}, over the bound of {self.max_slowdown:.2f}×",
                            budget, too_slow=True), context  # fmt: skip
        return FitPoint(batch, True, plan.predicted_peak, note, budget), context
