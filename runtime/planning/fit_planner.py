"""The planning half of ``--fit``: the per-op profiles it plans with, measured at the batch sizes
whose numbers it reports (:class:`BatchProfiles`), and a plan of the iteration at any batch size
against any budget (:class:`Planner`).

Per-op times do not scale linearly with the batch size: at a small batch an op's time is mostly its
launch, and cuBLAS and cuDNN pick other kernels, with other workspaces, at other shapes. The first
``--fit`` measured one profile at the starting batch size and scaled it linearly to every batch
size; on the H100 its time predictions were 3-4× off (docs/fit.md). So every batch the fit
measures or returns is profiled at its own size, with tensors of that size: in memory when its
unoptimized step fits under the limit, out of core otherwise
(:func:`~mutwo.runtime.planning.captured.profiling_choice`, the choice ``optimize`` makes), and
each batch size at most once. The scaled profile stays as the search's cheap heuristic: a batch the
search only tries is planned from the measured profile of the nearest batch size profiled so far,
scaled by the ratio of the two sizes.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from mutwo.ir.budget import Budget, UnreachableBudget, counted, readable_bytes
from mutwo.ir.graph import Graph
from mutwo.ir.pass_base import PassContext
from mutwo.ir.pass_manager import Instrumentation, PassManager, PipelineFailure
from mutwo.ir.printer import fingerprint
from mutwo.ir.registry import PassRegistry
from mutwo.passes.select import Plan
from mutwo.runtime.measurement.device_memory import free_planning_leftovers
from mutwo.runtime.measurement.iterations import device_bytes
from mutwo.runtime.measurement.out_of_core import OutOfCoreError
from mutwo.runtime.measurement.profiler import Profile, profile_graph
from mutwo.runtime.planning.captured import CapturedGraph, pass_context, profiling_choice
from mutwo.runtime.planning.fit_search import FIT_PIPELINE, FitError, FitPoint, ProfiledBatch


def scaled_profile(profile: Profile, profiled: Graph, graph: Graph, factor: float) -> Profile:
    """``profile`` (measured on ``profiled``) for ``graph``, the same iteration at another batch
    size or captured again at the same one (``factor`` 1): node by node in execution order, times
    and workspaces multiplied by ``factor``."""
    if [n.op_name for n in profiled.nodes] != [n.op_name for n in graph.nodes]:
        raise FitError("the iteration's graph changes with the batch size (other ops, not just other shapes), so "
                       "the profile cannot be scaled; use mutwo-experiment to sweep batch sizes instead")  # fmt: skip
    nodes = {}
    for old, new in zip(profiled.nodes, graph.nodes, strict=True):
        if old.id in profile.nodes:
            measured = profile.nodes[old.id]
            replay = measured.replay_seconds * factor if measured.replay_seconds is not None else None
            nodes[new.id] = dataclasses.replace(measured, seconds=measured.seconds * factor, replay_seconds=replay,
                                                workspace=int(measured.workspace * factor))  # fmt: skip
    return Profile(profile.device, fingerprint(graph), nodes, profile.runs, None, {**profile.meta, "factor": factor})


@dataclass
class MeasuredProfile:
    """A profile measured at one batch size, keyed to the graph of that size the planner keeps."""

    profile: Profile
    graph: Graph  #: the graph whose node ids the profile names
    record: ProfiledBatch  #: how it was measured, for the result


class BatchProfiles:
    """The profiles measured so far, one per batch size, and the profile to plan any batch with.

    ``limit_bytes`` decides in memory or out of core, as a budget in bytes does for ``optimize``:
    the fit's limit is the budget of every plan it makes (a limit below what the model already holds
    caps nothing here: select refuses it with the floor it can reach)."""

    def __init__(self, limit_bytes: int, log: Callable[[str], None],
                 timed: Callable[[str], AbstractContextManager[object]]) -> None:  # fmt: skip
        self.limit_bytes = limit_bytes
        self.log = log
        self.timed = timed
        self.measured: dict[int, MeasuredProfile] = {}

    def records(self) -> list[ProfiledBatch]:
        return [m.record for m in self.measured.values()]

    def measure(self, batch: int, lowered: CapturedGraph, kept: Graph) -> MeasuredProfile:
        """The profile of ``batch``, measured on ``lowered`` (captured at that size, with its inputs)
        the first time and kept, keyed to ``kept`` (the graph of that size the planner keeps).
        :class:`~mutwo.runtime.measurement.out_of_core.OutOfCoreError` when a node cannot run within
        the limit even out of core; :class:`FitError` when profiling in memory ran out of memory."""
        if batch in self.measured:
            return self.measured[batch]
        choice = profiling_choice(lowered.graph, lowered.inputs, Budget(bytes=self.limit_bytes), None, None)
        self.log(f"profiling batch {batch} at its own size, {choice.reason}")
        began = time.perf_counter()
        try:
            with self.timed("profile"):
                profile = profile_graph(lowered.graph, lowered.inputs, runs=1, warmup=1, iteration_runs=0,
                                        contention=False, device_limit=choice.device_limit)  # fmt: skip
        except torch.OutOfMemoryError:
            # In memory was chosen because the step fit under the limit: the device has less free.
            held = readable_bytes(device_bytes(lowered.inputs, lowered.device))
            raise FitError(f"profiling batch {batch} ran out of device memory, {choice.reason}, with the model, its "
                           f"optimizer state and the batch holding {held}; the device has less memory free than the "
                           "limit: give a limit it has free") from None  # fmt: skip
        finally:  # what profiling left cached would count against the measured runs' cap
            free_planning_leftovers(lowered.device)
        memory = "out of core" if choice.device_limit is not None else "in memory"
        profile.meta.update(batch_size=batch, memory=choice.reason)
        record = ProfiledBatch(batch, memory, choice.reason, time.perf_counter() - began, len(profile.nodes),
                               profile.iteration_seconds())  # fmt: skip
        self.measured[batch] = MeasuredProfile(scaled_profile(profile, lowered.graph, kept, 1.0), kept, record)
        return self.measured[batch]

    def for_graph(self, graph: Graph, batch: int) -> tuple[Profile, int, str]:
        """The profile to plan ``graph`` (the iteration at ``batch``) with, the batch size it was
        measured at, and which it is in words: its own where it was measured, else the nearest
        batch size's (by ratio) scaled linearly."""
        if not self.measured:
            raise FitError(f"no batch size was profiled before planning batch {batch}")  # a caller's mistake
        at = min(self.measured, key=lambda size: (abs(math.log(batch / size)), -size))
        measured = self.measured[at]
        factor = batch / at
        words = f"measured at batch {at}, {measured.record.memory}" + (f", scaled ×{factor:.2f}" if at != batch else "")
        return scaled_profile(measured.profile, measured.graph, graph, factor), at, words


@dataclass
class Planned:
    """A batch planned from its own profile and, where its plan fits, rewritten, with the inputs to
    run it on. ``context`` is None when the batch could not be profiled within the limit."""

    point: FitPoint
    lowered: CapturedGraph
    context: PassContext | None

    @property
    def plan(self) -> Plan | None:
        return self.context.artifacts.get("plan") if self.context is not None and self.point.fits else None


class Planner:
    """Plans the iteration at any batch size against any budget, from the profiles measured so far.

    Each batch size is captured once; its graph is kept (metadata only, no tensors) and every plan
    runs on a copy, so planning a batch again at another budget costs no capture. Plans made to
    search are not verified after each pass (the plan of a batch found is, and rewritten)."""

    def __init__(self, capture_at: Callable[[int], CapturedGraph], profiles: BatchProfiles,
                 log: Callable[[str], None], max_slowdown: float | None = None) -> None:  # fmt: skip
        self.capture_at = capture_at
        self.profiles = profiles
        self.log = log
        #: a plan predicted slower than this many times the step without recomputation does not fit
        self.max_slowdown = max_slowdown
        self.graphs: dict[int, Graph] = {}

    def start(self, batch: int, lowered: CapturedGraph) -> None:
        """Keep ``lowered`` (captured at ``batch``) and profile it: the search's first heuristic."""
        self.graphs[batch] = lowered.graph  # profiling reads it, changes nothing: no second capture
        try:
            self.profiles.measure(batch, lowered, lowered.graph)
        except OutOfCoreError as error:
            raise FitError(f"the starting batch size {batch} cannot be profiled within "
                           f"{readable_bytes(self.profiles.limit_bytes)} ({error}); start the search from a "
                           "smaller batch size") from None  # fmt: skip

    def predict(self, batch: int, budget: int) -> FitPoint:
        """Plan ``batch`` against ``budget``: whether it fits, and the plan's simulated peak."""
        began = time.perf_counter()
        if batch not in self.graphs:
            self.graphs[batch] = self.capture_at(batch).graph
        point, _ = self.plan(self.graphs[batch].copy(), batch, budget, PassContext(device=self.device()),
                             verify=False)  # fmt: skip
        point.seconds = time.perf_counter() - began
        self._log(point, budget, "")
        return point

    def rewrite(self, batch: int, budget: int) -> Planned:
        """Capture ``batch`` with its inputs, profile it at its own size (the first time), plan it
        from that profile against ``budget`` and, where the plan fits, rewrite it."""
        began = time.perf_counter()
        lowered = self.capture_at(batch)
        if batch not in self.graphs:
            self.graphs[batch] = lowered.graph.copy()
        try:
            self.profiles.measure(batch, lowered, self.graphs[batch])
        except OutOfCoreError as error:  # a node that cannot run within the limit: nor can the step
            point = FitPoint(batch, False, 0, f"it cannot be profiled within the limit ({error})",
                             budget, profiled_at=batch, profile=f"not measured at batch {batch}")  # fmt: skip
            self._log(point, budget, " from its own profile")
            return Planned(point, lowered, None)
        context = pass_context(lowered, Budget(bytes=budget))
        point, context = self.plan(lowered.graph, batch, budget, context, verify=True, final=",rewrite")
        point.seconds = time.perf_counter() - began
        self._log(point, budget, " from its own profile")
        return Planned(point, lowered, context)

    def device(self) -> str:
        return next(iter(self.profiles.measured.values())).profile.device

    def _log(self, point: FitPoint, budget: int, how: str) -> None:
        summary = point.note.splitlines()[0] if point.note else ""
        peak = f"predicted peak {readable_bytes(point.predicted_peak)}" if point.predicted_peak else "not simulated"
        verdict = "fits" if point.fits else "fits, but too slow," if point.too_slow else "does not fit"
        self.log(f"batch {point.batch_size}{how}: {verdict} in {readable_bytes(budget)}, {peak} ({summary}; "
                 f"profile {point.profile}; {point.seconds:.1f} s)")  # fmt: skip

    def plan(self, graph: Graph, batch: int, budget: int, context: PassContext, *, verify: bool,
             final: str = "") -> tuple[FitPoint, PassContext]:  # fmt: skip
        """Run the fit pipeline (and ``final``) on ``graph``: the point, and the context with the plan."""
        context.services["budget"] = Budget(bytes=budget)
        profile, profiled_at, source = self.profiles.for_graph(graph, batch)
        context.artifacts["profile"] = profile
        pipeline = PassRegistry().build_pipeline(FIT_PIPELINE + final, {"profile"})
        facts: dict[str, Any] = {"profiled_at": profiled_at, "profile": source}
        try:
            PassManager(pipeline, Instrumentation(verify=verify)).run(graph, context)
        except PipelineFailure as failure:
            if not isinstance(failure.cause, UnreachableBudget):
                # Not "the budget is out of reach" but a crash: that is no answer about fitting.
                raise FitError(f"planning batch {batch} failed: {failure}") from failure
            plan = context.artifacts.get("plan")  # none when select failed on its estimate alone
            # select's advice (another budget) is no answer here: the search sets the budget itself.
            return FitPoint(batch, False, plan.predicted_peak if plan else 0, failure.reason, budget,
                            needs=failure.cause.needs or 0, **facts), context  # fmt: skip
        plan = context.artifacts["plan"]
        facts["predicted_seconds"] = plan.predicted_seconds
        # The plan's own estimate of what recomputation costs, relative to the step without it: the
        # price of a larger batch (from a scaled profile while searching, its own once found).
        slower = plan.predicted_seconds / plan.base_seconds if plan.base_seconds > 0 else None
        cost = f", predicted {slower:.2f}× the time without it" if slower is not None else ""
        note = f"{counted(len(plan.entries), 'activation')} recomputed{cost}"
        if self.max_slowdown is not None and slower is not None and slower > self.max_slowdown:
            return FitPoint(batch, False, plan.predicted_peak, f"{note}, over the bound of {self.max_slowdown:.2f}×",
                            budget, too_slow=True, **facts), context  # fmt: skip
        return FitPoint(batch, True, plan.predicted_peak, note, budget, **facts), context
