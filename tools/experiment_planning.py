"""Planning mutwo's step for one configuration of ``mutwo-experiment`` (``none`` and the budgets).

:func:`planned_step` captures the training step, profiles it (or reuses the profile and copy
model that the unbudgeted run of the same batch size saved), plans it at the budget with
select/rewrite or select-swap and compiles it for the backend. With a compiled backend it can
calibrate the plan to the measured peak, and weigh select-swap's plan against the recompute-only
one by measuring both (:class:`PlanChoice`). Measurements taken while planning hold the device
(:func:`mutwo.tools.experiment_measure.device_turn`) when processes plan side by side.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mutwo.ir.pass_base import write_atomic
from mutwo.ir.pass_manager import PipelineFailure
from mutwo.ir.replay import describe
from mutwo.ir.timeline import TransferModel
from mutwo.runtime.planning.plan_choice import RECOMPUTE_ONLY, SWAP_AND_RECOMPUTE
from mutwo.tools.experiment_measure import Training, device_turn

#: The copy model the unbudgeted run measures beside its profile.json, which the planned runs reuse.
TRANSFER_FILE = "transfer.json"


#: A recompute-only plan: the default pipeline's passes after the profile and the optimizer passes
#: (chunk slices a language-model head where the budget needs it or select's plan is faster so).
RECOMPUTE_PASSES = ("chunk", "select", "rewrite")


def planned_step(training: Training, budget: Any, folder: Path, row: dict[str, Any],
                 log: Callable[[str], None], optimizer_passes: bool = False,
                 swap: bool = False, backend: str = "eager",
                 isolate_profile: bool = False, calibrate: int = 0,
                 measure_choice: bool = False, device_lock: Path | None = None,
                 reuse_profile: bool = False) -> Callable[[], Any]:  # fmt: skip
    """Capture ``training``'s step, plan it at ``budget`` (None: no plan) and compile it for ``backend``.

    The run without a budget profiles and saves ``folder/profile.json``, its timing and the copy
    model (:data:`TRANSFER_FILE`); the others (and a ``reuse_profile`` run) reuse them when the
    graph's fingerprint and the kind of profile match. ``row`` gets the planning times, the plan's
    choices and predictions and the compile. Returns the :class:`PlannedStep`, or a
    :class:`PlanChoice` to resolve by measuring when ``measure_choice`` compiled two plans. The
    other arguments are :func:`mutwo.tools.experiment_configuration.run_configuration`'s.
    """
    from mutwo.ir.memory import simulate
    from mutwo.ir.pass_manager import PassManager, PipelineFailure
    from mutwo.ir.registry import PassRegistry
    from mutwo.runtime.execution.backends import BackendError, backend_services, records_cuda_graphs
    from mutwo.runtime.execution.step import GraphStep
    from mutwo.runtime.measurement.expandable_segments import use_expandable_segments
    from mutwo.runtime.measurement.profiler import Profile, fingerprint
    from mutwo.runtime.planning.captured import capture_graph, pass_context
    from mutwo.runtime.planning.peak_calibration import pipeline_plan

    if measure_choice and backend == "eager":
        raise BackendError("a measured choice between plans is for compiled backends, whose steps run otherwise than "
                           "the eager times the plans are priced at; the eager executor's select-swap choice is "
                           "already priced as it runs: drop it, or plan for inductor, inductor-cudagraphs or "
                           "cudagraphs")  # fmt: skip
    profiles = budget is None and not reuse_profile  # this run makes the profile.json the others reuse
    saved, saved_transfer = folder / "profile.json", folder / TRANSFER_FILE
    if profiles:  # an older profile must not outlive a run that fails before saving its own
        for old in (saved, saved_transfer, folder / "timing.json"):
            old.unlink(missing_ok=True)
    allocator = use_expandable_segments(training.device)  # as mutwo.optimize does
    if allocator is not None:
        log(allocator)
    started = time.perf_counter()
    # CUDA graphs: the stock optimizer's capturable form, captured for them (mutwo.runtime.capture.optim).
    lowered = capture_graph(training.model, training.optimizer, training.batch, training.loss_fn, training.options,
                            graphed=records_cuda_graphs(backend))  # fmt: skip
    row["capture_seconds"] = round(time.perf_counter() - started, 2)
    folder.mkdir(parents=True, exist_ok=True)
    context = pass_context(lowered, budget, out_dir=folder if profiles else None, log=log)
    context.services.update(backend_services(backend), measure_choice=measure_choice)
    planning = ["optimizer"] if optimizer_passes else []
    planning += (["swap"] if swap else list(RECOMPUTE_PASSES)) if budget is not None else []
    # The run without a budget saves the profile the others reuse: on CUDA it measures the copies'
    # contention too, which only swap pipelines read (and which their profile pass measures anyway).
    profile_options = [*(["isolate=true"] if isolate_profile else []),
                       *(["contention=true"] if profiles and training.device.type == "cuda" else [])]
    profiling = "profile" + ("{" + ",".join(profile_options) + "}" if profile_options else "")
    passes = ",".join([profiling, *planning])
    reused: list[str] = []  # what ran before this run's pipeline, in the run that profiled
    if not profiles and saved.exists():
        profile = Profile.from_json(json.loads(saved.read_text(encoding="utf-8")))
        # Made the way this run's profile pass makes them: isolated or not, pooled, and for a
        # swap plan on CUDA with the copies' contention measured (else it is measured again).
        same_kind = bool(profile.meta.get("isolated")) == (isolate_profile and training.device.type == "cuda") \
            and bool(profile.meta.get("pooled")) \
            and ("copy_contention" in profile.meta or training.device.type != "cuda" or not swap)
        if profile.fingerprint == fingerprint(lowered.graph) and same_kind:
            context.artifacts["profile"] = profile
            if saved_transfer.exists():  # the copies priced as the run that profiled measured them
                context.artifacts["transfer"] = TransferModel.from_json(
                    json.loads(saved_transfer.read_text(encoding="utf-8")))
            passes = ",".join(planning)
            reused = [f"{profiling} (from {folder.name}/{saved.name})"]
            timing = folder / "timing.json"  # written by the run that profiled
            if timing.exists():
                row["profile_seconds"] = json.loads(timing.read_text(encoding="utf-8"))["profile_seconds"]
    available = {"profile"} if "profile" in context.artifacts else set()
    # each calibration round, and the recompute-only plan a measured choice weighs, plans from it
    pristine = lowered.graph.copy() if calibrate or measure_choice else None
    try:
        # an unplanned run on a reused profile has no pass to run
        pipeline = PassRegistry().build_pipeline(passes, available) if passes else []
        result = PassManager(pipeline).run(lowered.graph, context)
    except PipelineFailure as failure:
        if not reused:
            raise
        # Its pipeline starts after the reused profile: the failed pass is not "the first pass" of the plan.
        raise PipelineFailure(failure.pass_name, [*reused, *failure.pipeline_so_far], failure.cause) from failure.cause
    seconds = {record.name: record.seconds for record in result.records}
    row["profile_reused"] = bool(reused)
    if "profile" in seconds:
        row["profile_seconds"] = round(seconds["profile"], 2)
        if profiles:  # timing.json goes with the profile.json only this run writes
            write_atomic(folder / "timing.json", json.dumps({"profile_seconds": row["profile_seconds"]}))
    if profiles:
        # The planned runs reuse this run's copy model with its profile, so that every swap plan of
        # one comparison is priced alike, and a run planning beside others (compare.py
        # --parallel-planning) does not time its copies against theirs.
        row["transfer"] = context.services["transfer"]().to_json()
        write_atomic(saved_transfer, json.dumps(row["transfer"]))
    row["select_rewrite_seconds"] = round(sum(v for k, v in seconds.items() if k != "profile"), 2)
    row["planning_seconds"] = round(row["capture_seconds"] + row.get("profile_seconds", 0.0)
                                    + row["select_rewrite_seconds"], 2)  # fmt: skip
    profile = context.artifacts["profile"]
    row["profile_isolated"] = bool(profile.meta.get("isolated"))
    row["simulated_peak_bytes"] = simulate(lowered.graph, workspace=profile.workspace()).peak_bytes
    row["nodes"] = len(lowered.graph)
    for name in ("optimizer-in-backward", "foreach-buckets"):  # whether each applied, or why not
        if name in context.artifacts:
            row[name] = context.artifacts[name].to_json()
    plan = pipeline_plan(context.artifacts)
    row.update(_plan_row(context.artifacts.get("plan"), context.artifacts.get("swap-plan"), lowered.graph))
    graph_step = GraphStep(lowered.graph, lowered.captured, lowered.binding, backend)
    compiled = graph_step.compile(graph_step.flat_inputs(training.batch))
    row.update(compiled.describe(), simulated_backend="eager")
    row["planning_seconds"] = round(row["planning_seconds"] + compiled.compile_seconds, 2)
    if calibrate and plan is not None and pristine is not None:
        started = time.perf_counter()
        graph_step, plan = _calibrated_step(graph_step, plan, profile, pristine, lowered, ",".join(planning),
                                            calibrate, row, log, device_lock)  # fmt: skip
        row["calibration_seconds"] = round(time.perf_counter() - started, 2)
        row["planning_seconds"] = round(row["planning_seconds"] + row["calibration_seconds"], 2)
    planned = PlannedStep(graph_step, training.batch)
    swap_plan = context.artifacts.get("swap-plan")
    if measure_choice and swap_plan is not None and pristine is not None:
        if not row.get("swapped_tensors"):  # the kept plan's (a calibration round's may differ from the first)
            row["measured_choice"] = {"skipped": "select-swap's plan swaps nothing: it is recompute only already"}
            return planned
        started = time.perf_counter()
        recompute_only = ",".join([*(["optimizer"] if optimizer_passes else []), *RECOMPUTE_PASSES])
        other = _recompute_only_step(pristine, lowered, recompute_only, swap_plan.budget_bytes, backend, profile,
                                     calibrate, log, device_lock)  # fmt: skip
        row["planning_seconds"] = round(row["planning_seconds"] + time.perf_counter() - started, 2)
        if other is None:
            row["measured_choice"] = {"skipped": "no recompute-only plan reaches the budget"}
            return planned
        step, other_plan, fields = other
        return PlanChoice(swap_plan.budget_bytes, [
            Candidate(SWAP_AND_RECOMPUTE, planned, plan, {k: v for k, v in row.items() if k in PLAN_FIELDS}),
            Candidate(RECOMPUTE_ONLY, PlannedStep(step, training.batch), other_plan, fields)])  # fmt: skip
    return planned


def _plan_row(plan: Any, swap_plan: Any, graph: Any) -> dict[str, Any]:
    """What a plan chose and predicted, to compare with what was measured."""
    row: dict[str, Any] = {}
    if plan is not None:
        row["recomputed_tensors"] = len(plan.entries)
        row["predicted_added_ms"] = round(plan.added_seconds * 1e3, 3)
        row["profiled_iteration_ms"] = round(plan.base_seconds * 1e3, 3)
        row["predicted_iteration_ms"] = round(plan.predicted_seconds * 1e3, 3)
        row["planned_peak_bytes"] = plan.predicted_peak
        row["recomputed_ops"] = dict(Counter(e["op"] for e in plan.entries).most_common(8))
    if swap_plan is not None:
        row.update(swap_plan_row(swap_plan))
    if plan is not None or swap_plan is not None:
        # What the clones replay, and how (a copy, with a generator state, from batch-norm statistics).
        row["cloned_ops"] = dict(Counter(f"{graph.node(n.origin).op_name} ({describe(n.target)})"
                                         for n in graph if n.origin is not None).most_common(12))  # fmt: skip
    return row


def _calibrated_step(first: Any, plan: Any, profile: Any, pristine: Any, lowered: Any, planning: str, rounds: int,
                     row: dict[str, Any], log: Callable[[str], None],
                     device_lock: Path | None = None) -> tuple[Any, Any]:  # fmt: skip
    """The compiled step :func:`mutwo.runtime.planning.peak_calibration.calibrate` keeps, and its plan:
    ``first`` (planned with ``plan``) measured, then up to ``rounds`` re-plans of ``pristine`` by
    the ``planning`` passes (with ``profile``) at budgets moved by the measured gap; ``row`` gets
    the kept plan's numbers and the rounds."""
    from mutwo.passes.select_swap import SwapPlan
    from mutwo.runtime.planning.peak_calibration import CalibrationRound, calibrate, measured_peak

    candidates: list[tuple[Any, Any, Any]] = []
    previewed: dict[int, tuple[Any, Any] | PipelineFailure] = {}  # plans made to compare, by budget

    def predict(budget_bytes: int) -> float | None:
        planned = previewed[budget_bytes] = _plan(pristine, lowered, planning, budget_bytes, first.backend, profile,
                                                  log)  # fmt: skip
        return None if isinstance(planned, PipelineFailure) else float(planned[1].predicted_seconds)

    def plan_and_measure(budget_bytes: int) -> tuple[CalibrationRound, tuple[Any, Any, Any]] | None:
        if not candidates:  # the first round is the step already planned and compiled
            made = first, plan, first.graph
        else:
            planned = (previewed.pop(budget_bytes) if budget_bytes in previewed
                       else _plan(pristine, lowered, planning, budget_bytes, first.backend, profile, log))  # fmt: skip
            if isinstance(planned, PipelineFailure):  # a lower budget out of reach: the rounds so far stand
                return None
            made = _compiled(*planned, lowered, first.backend)
        candidates.append(made)
        step, chosen, _ = made
        with device_turn(device_lock):
            measured, allocated = measured_peak(step.compiled.run, lowered.inputs)
        return CalibrationRound(budget_bytes, chosen.predicted_peak, measured, chosen.unoptimized_peak,
                                allocated, predicted_seconds=float(chosen.predicted_seconds)), made  # fmt: skip

    calibration = calibrate(plan.budget_bytes, rounds, plan_and_measure, log, predict=predict)
    log(calibration.summary())
    step, chosen, graph = calibration.step
    swapping = isinstance(chosen, SwapPlan)
    row.update(_plan_row(None if swapping else chosen, chosen if swapping else None, graph),
               calibration=calibration.describe())  # fmt: skip
    return step, chosen


def _plan_compiled(pristine: Any, lowered: Any, planning: str, budget_bytes: int, backend: str, profile: Any,
                   log: Callable[[str], None]) -> tuple[Any, Any, Any] | PipelineFailure:  # fmt: skip
    """A copy of ``pristine`` planned by the ``planning`` passes (after ``profile``) at
    ``budget_bytes`` and compiled for ``backend``: its step, plan and graph; the failure when the
    budget is out of reach."""
    planned = _plan(pristine, lowered, planning, budget_bytes, backend, profile, log)
    return planned if isinstance(planned, PipelineFailure) else _compiled(*planned, lowered, backend)


def _plan(pristine: Any, lowered: Any, planning: str, budget_bytes: int, backend: str, profile: Any,
          log: Callable[[str], None]) -> tuple[Any, Any] | PipelineFailure:  # fmt: skip
    """A copy of ``pristine`` planned as :func:`_plan_compiled` plans it, not compiled: the graph and
    its plan, or the failure when the budget is out of reach."""
    from mutwo.ir.budget import Budget
    from mutwo.ir.pass_manager import PassManager
    from mutwo.ir.registry import PassRegistry
    from mutwo.runtime.execution.backends import backend_services
    from mutwo.runtime.planning.captured import pass_context
    from mutwo.runtime.planning.peak_calibration import pipeline_plan

    graph = pristine.copy()
    context = pass_context(lowered, Budget(bytes=budget_bytes), log=log)
    context.services.update(backend_services(backend))
    context.artifacts["profile"] = profile
    try:
        PassManager(PassRegistry().build_pipeline(planning, {"profile"})).run(graph, context)
    except PipelineFailure as failure:
        return failure
    return graph, pipeline_plan(context.artifacts)


def _compiled(graph: Any, plan: Any, lowered: Any, backend: str) -> tuple[Any, Any, Any]:
    """``graph`` (planned with ``plan``) compiled for ``backend``: its step, plan and graph."""
    from mutwo.runtime.execution.step import GraphStep

    step = GraphStep(graph, lowered.captured, lowered.binding, backend)
    step.compile(lowered.inputs)
    return step, plan, graph


def _recompute_only_step(pristine: Any, lowered: Any, planning: str, budget_bytes: int, backend: str, profile: Any,
                         calibrate: int, log: Callable[[str], None],
                         device_lock: Path | None = None) -> tuple[Any, Any, dict[str, Any]] | None:  # fmt: skip
    """The recompute-only plan of ``pristine`` at ``budget_bytes`` (``planning``: its passes after
    the profile), compiled for ``backend`` and calibrated like the swap plan it is weighed
    against: its step, plan and the row fields that describe it. None when no such plan reaches
    the budget."""
    made = _plan_compiled(pristine, lowered, planning, budget_bytes, backend, profile, log)
    if isinstance(made, PipelineFailure):
        log(f"measured choice: no recompute-only plan: {str(made).splitlines()[0]}")
        return None
    step, plan, graph = made
    fields = {**_plan_row(plan, None, graph), "compile_seconds": round(step.compiled.compile_seconds, 3),
              "compile_cache_hit": step.compiled.cache_hit}  # fmt: skip
    if calibrate:
        step, plan = _calibrated_step(step, plan, profile, pristine, lowered, planning, calibrate, fields, log,
                                      device_lock)  # fmt: skip
    return step, plan, fields


#: The row fields a plan sets (:func:`_plan_row`, calibration, the compile): a measured choice
#: replaces them with the kept plan's.
PLAN_FIELDS = ("recomputed_tensors", "predicted_added_ms", "profiled_iteration_ms", "predicted_iteration_ms",
               "planned_peak_bytes", "recomputed_ops", "cloned_ops", "swapped_tensors", "swapped_bytes",
               "predicted_stall_ms", "time_scale", "transfer", "swapped_ops", "alternative_plan", "calibration",
               "compile_seconds", "compile_cache_hit")  # fmt: skip


@dataclass
class Candidate:
    """One compiled plan a :class:`PlanChoice` weighs: its name, step, plan and row fields."""

    name: str
    step: PlannedStep
    plan: Any
    fields: dict[str, Any]


@dataclass
class PlanChoice:
    """select-swap's plan and the recompute-only plan at the same budget, both compiled: which
    runs faster is measured, each alone on the device, when :meth:`resolve` is called (after
    ``compare.py --parallel-planning``'s gate), and that one is kept.

    Under a compiled backend both plans are priced at the eager executor's times, which the
    compiled step does not keep: on an H200, ResNet-152's recompute-only step under
    ``inductor-cudagraphs`` ran 15% under its prediction, the swap plan as predicted, so select-swap
    kept the plan that ran 17% slower (docs/benchmarks.md). Measuring decides that comparison."""

    budget_bytes: int
    candidates: list[Candidate]

    def resolve(self, row: dict[str, Any], log: Callable[[str], None], *, warmup: int,
                iterations: int) -> PlannedStep | None:  # fmt: skip
        """Measure every candidate (``warmup``, at least 1, then ``iterations`` iterations, median
        time, peak as the simulator counts it), keep the fastest whose peak is within 3% over the
        budget (none: the lowest peak; a tie: recompute only, which holds no host memory or copy
        engine), write what was measured under ``row["measured_choice"]`` and the kept plan's fields
        into ``row``. None when both ran out of memory."""
        from mutwo.runtime.planning.plan_choice import choose_measured, measure_candidates

        runs = [(c.name, c.step.step.compiled.run, c.step.step.flat_inputs(c.step.batch), c.plan)
                for c in self.candidates]  # fmt: skip
        measured = measure_candidates(runs, log, warmup=warmup, iterations=iterations)
        kept = choose_measured(measured, self.budget_bytes)
        choice = {"budget_bytes": self.budget_bytes, "warmup": max(1, warmup), "iterations": iterations,
                  "candidates": measured}  # fmt: skip
        if kept is None:
            row["measured_choice"] = choice
            return None
        log(f"measured choice: kept {self.candidates[kept].name}")
        for key in PLAN_FIELDS:
            row.pop(key, None)
        row.update(self.candidates[kept].fields, measured_choice={"kept": self.candidates[kept].name, **choice})
        return self.candidates[kept].step


@dataclass
class PlannedStep:
    """A planned step on its batch, called by :func:`mutwo.tools.experiment_measure.measure_step`."""

    step: Any  #: a mutwo.runtime.execution.step.GraphStep
    batch: Any

    def __call__(self) -> Any:
        return self.step(self.batch)

    @property
    def recorded_peak_bytes(self) -> int:
        """The allocator's peak while a CUDA graph recorded the step (0 for other backends):
        replays allocate nothing, so the peak of replays alone misses the iteration's memory."""
        return getattr(self.step.compiled.run, "recorded_peak_absolute", 0)


def swap_plan_row(plan: Any) -> dict[str, Any]:
    """What a select-swap plan chose and predicted, for a results row."""
    swapped, recomputed = plan.of("swap"), plan.of("recompute")
    return {
        "swapped_tensors": len(swapped), "swapped_bytes": sum(e["bytes"] for e in swapped),
        "recomputed_tensors": len(recomputed), "planned_peak_bytes": plan.predicted_peak,
        "profiled_iteration_ms": round(plan.base_seconds * 1e3, 3),
        "predicted_iteration_ms": round(plan.predicted_seconds * 1e3, 3),
        "predicted_added_ms": round(plan.recompute_seconds * 1e3, 3),
        "predicted_stall_ms": round(plan.stall_seconds * 1e3, 3), "time_scale": round(plan.time_scale, 4),
        "transfer": plan.transfer, "recomputed_ops": dict(Counter(e["op"] for e in recomputed).most_common(8)),
        "swapped_ops": dict(Counter(e["op"] for e in swapped).most_common(8)),
        "alternative_plan": plan.alternative,  # the plan select-swap did not keep (keep_faster), or None
    }  # fmt: skip
