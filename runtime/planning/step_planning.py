"""Planning one captured training step: :func:`optimize_graph` captures the iteration, lowers it,
runs the pass pipeline over it (or takes the plan from the plan cache), compiles the result for
its backend, calibrates it to the memory the process holds and checks it; :class:`Optimized` is
what it returns. :func:`mutwo.runtime.api.optimize` calls it for every graph a training loop runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mutwo.ir.budget import Budget
from mutwo.ir.graph import Graph
from mutwo.ir.pass_base import Pass, PassContext
from mutwo.ir.pass_manager import PassManager, PipelineResult
from mutwo.ir.registry import PassRegistry
from mutwo.runtime.capture.iteration import CapturedStep, LossFn, StepBinding
from mutwo.runtime.capture.training import TrainingOptions
from mutwo.runtime.execution.auto_backend import AUTO, check_backend_choice, early_choice
from mutwo.runtime.execution.backends import BackendError, CompiledStep, backend_services
from mutwo.runtime.execution.step import GraphStep
from mutwo.runtime.measurement.device_memory import free_planning_leftovers
from mutwo.runtime.measurement.equivalence import EquivalenceReport, check_graphs, random_stream_kept
from mutwo.runtime.measurement.iterations import device_of
from mutwo.runtime.measurement.out_of_memory import (
    CALIBRATION,
    CAPTURE,
    CHECK,
    CHOICE,
    COMPILE,
    MemorySettings,
    passes_noted,
    stage_noted,
)
from mutwo.runtime.parallel import distributed
from mutwo.runtime.parallel.distributed import DataParallel
from mutwo.runtime.planning.auto_capture import capture_for_backend
from mutwo.runtime.planning.captured import pass_context
from mutwo.runtime.planning.collector import collection_paused, full_collections_deferred, older_heap_frozen
from mutwo.runtime.planning.peak_calibration import (
    Calibrated,
    Calibration,
    calibrated_step,
    calibration_refusal,
    calibration_rounds,
    pipeline_plan,
    plan_first_at_window,
)
from mutwo.runtime.planning.plan_cache import CachedPlanning, CacheOption
from mutwo.runtime.planning.plan_choice import choice_refusal, measured_choice
from mutwo.runtime.planning.plan_key import run_settings
from mutwo.runtime.planning.setup_stages import SetupStages

#: The pipeline run when none is named (``mutwo.optimize``; ``mutwo-opt``'s ``DEFAULT_PIPELINE`` is
#: this one). ``chunk`` sits between the profile (which prices its slices) and select (which plans on
#: the sliced graph), and slices a language-model head only where the budget needs it: without a
#: budget, or with one recomputation can reach with the head whole, it changes nothing
#: (docs/chunk.md).
DEFAULT_PASSES = "profile,optimizer,chunk,select,rewrite"


@dataclass
class Optimized:
    """One captured and optimized iteration: the graphs before and after, and what the passes made."""

    original: Graph
    graph: Graph
    captured: CapturedStep
    binding: StepBinding
    context: PassContext
    result: PipelineResult
    inputs: list[torch.Tensor]
    report: EquivalenceReport | None = None
    #: the final graph bound to the model and made runnable by the backend
    step: GraphStep | None = None
    #: with ``calibrate_peak``: every round's budget and peaks, and the round kept
    calibration: Calibration[Any] | None = None
    #: with ``measure_choice``: both plans measured and the one kept (:mod:`mutwo.runtime.planning.plan_choice`)
    choice: dict[str, Any] | None = None
    #: seconds of each stage of its setup (capture, each pass, compile, calibration...) and ``total``
    setup_seconds: dict[str, float] = field(default_factory=dict)
    #: whether the plan came from the plan cache (None: not looked up; :mod:`mutwo.runtime.planning.plan_cache`)
    cache_hit: bool | None = None

    @property
    def plan(self) -> Any:
        """The plan the pipeline made: ``select``'s (recompute only) or ``select-swap``'s."""
        return pipeline_plan(self.context.artifacts)


def optimize_graph(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    loss_fn: LossFn,
    *,
    passes: str = DEFAULT_PASSES,
    budget: Budget | None = None,
    out_dir: Path | None = None,
    check: bool = False,
    training: TrainingOptions | None = None,
    micro: str = "step",
    accumulated: dict[str, torch.Tensor] | None = None,
    keep_grads: bool = False,
    log: Callable[[str], None] = lambda message: None,
    data_parallel: DataParallel | None = None,
    backend: str = "eager",
    calibrate_peak: int | None = None,
    measure_choice: bool = False,
    memory_limit: int | None = None,
    cache: CacheOption = None,
    progress: Callable[[str], None] | None = None,
) -> Optimized:
    """Capture the iteration, lower it, run ``passes`` over it, as ``mutwo-opt`` does, and make the
    final graph runnable by ``backend`` (compiled here: part of planning; ``auto``: chosen and
    logged, :mod:`mutwo.runtime.execution.auto_backend`). A ``torch.OutOfMemoryError`` on the way
    gets a note naming the stage and what the process held (:mod:`mutwo.runtime.measurement.out_of_memory`).

    With ``check``, the optimized step is compared with the captured graph for 3 iterations from
    cloned state (bitwise on CPU and with deterministic kernels on CUDA; a compiled backend within
    :class:`mutwo.runtime.measurement.equivalence.Tolerance`). With ``data_parallel``, every rank of its group
    must call this together; they end with the same graph or all fail. ``calibrate_peak``: with
    the inductor backend, plan again up to that many times until the compiled step's measured peak
    is within 3% of the budget (:mod:`mutwo.runtime.planning.peak_calibration`). ``measure_choice``: with
    a compiled backend and select-swap in ``passes``, when its plan swaps, compile the
    recompute-only plan at the same budget too, measure both and keep the faster
    (:mod:`mutwo.runtime.planning.plan_choice`; ``Optimized.choice`` says what each ran).
    ``memory_limit``: the bytes the process may hold on the device (applied by :func:`optimize`);
    profiling runs out of core when the unoptimized step would not fit under it. ``cache``: where
    the plan is kept and looked up (:mod:`mutwo.runtime.planning.plan_cache`; False: nowhere); on a
    hit, profile, select, calibration and the measured choice do not run. ``progress``: where each
    stage is said as it starts and ends (default: ``log``); ``Optimized.setup_seconds`` keeps them.
    """
    check_backend_choice(backend)
    pipeline = PassRegistry().build_pipeline(passes)
    memory = MemorySettings(device_of([*model.parameters(), *model.buffers()]), budget, memory_limit)
    chosen = early_choice(memory.device) if backend == AUTO else None
    backend = chosen.backend if chosen is not None else backend
    if backend != AUTO:  # auto on CUDA is refused what its choice cannot do once it has chosen, below
        _refuse_options(backend, pipeline, data_parallel, calibrate_peak, measure_choice, budget)
    if chosen is not None:
        log(f"mutwo: {chosen.sentence()}")
    stages = SetupStages(progress or log)
    # planning runs the graph, and the caller's training draws what eager's would; the collector skips
    # the heap that was there before setup (:mod:`mutwo.runtime.planning.collector`)
    with older_heap_frozen(), random_stream_kept(model):
        with stages.stage("capture", "capturing the training step"), stage_noted(CAPTURE, memory), \
                collection_paused():
            lowered, chosen = capture_for_backend(backend, model, optimizer, batch, loss_fn, training, micro,
                                                  accumulated, data_parallel)  # fmt: skip
        if chosen is not None:
            log(f"mutwo: {chosen.sentence()}")
            backend = chosen.backend
            _refuse_options(backend, pipeline, data_parallel, calibrate_peak, measure_choice, budget)
        log(lowered.captured.call.sentence())
        original = lowered.graph.copy()
        context = pass_context(lowered, budget, out_dir=out_dir, log=log, keep_grads=keep_grads,
                               memory_limit=memory_limit)
        context.services.update(backend_services(backend), measure_choice=measure_choice)
        planned_rounds = calibration_rounds(calibrate_peak, lowered.device, pipeline,
                                            budgeted=budget is not None or memory_limit is not None)  # fmt: skip
        settings = run_settings(budget=budget, memory_limit=memory_limit, backend=backend, keep_grads=keep_grads,
                                calibration_rounds=planned_rounds, measure_choice=measure_choice,
                                precision=training.precision if training is not None else "fp32")  # fmt: skip
        with stages.stage("plan cache"):  # its hit or miss says itself
            cached = CachedPlanning.begin(cache, lowered, pipeline, settings, context.services.get("device_memory"),
                                          lambda line: stages.progress(f"mutwo: {line}"),
                                          data_parallel is not None)  # fmt: skip
        held_ratio = cached.held_ratio()  # what this graph's steps held, where the cache kept it
        aimed = plan_first_at_window(context, planned_rounds, held_ratio)
        if aimed is not None and not cached.hit:  # a hit makes no plan: it rewrites with the entry's
            log(f"mutwo: {aimed}")
        running = ",".join(p.name for p in cached.passes(pipeline))
        with stages.stage("passes", f"running the passes ({running})", record=False), passes_noted(memory):
            lowered.graph, context, result = cached.run(pipeline, lowered.graph, context)
        stages.passes(result)
        optimized = Optimized(original, lowered.graph, lowered.captured, lowered.binding, context, result,
                              lowered.inputs)
        if cached.entry is not None:  # a hit: what the measured choice recorded when it kept this plan
            optimized.choice = cached.entry.choice
        if data_parallel is not None:
            distributed.require_same_graph(lowered.graph, data_parallel, "optimized")
        steps: dict[int, GraphStep] = {}

        def compiled_for(graph: Graph) -> CompiledStep:
            steps[id(graph)] = GraphStep(graph, lowered.captured, lowered.binding, backend)
            with stage_noted(COMPILE, memory), full_collections_deferred():
                return steps[id(graph)].compile(lowered.inputs)

        with stages.stage("compile", f"compiling the step with {backend}" if backend != "eager"
                          else "lowering the step to an fx graph"):  # fmt: skip
            compiled = compiled_for(lowered.graph)
        optimized.step = steps[id(lowered.graph)]
        if backend != "eager":
            log(f"mutwo: compiled the step with {backend} in {compiled.compile_seconds:.1f} s{compiled.cache_note()}")
        rounds = 0 if cached.hit else planned_rounds  # a hit's plan is the one calibration kept
        if rounds:
            first = Calibrated(lowered.graph, compiled, context)
            with stages.stage("calibration", f"peak calibration: measuring the step, then up to {rounds} re-plans"), \
                    stage_noted(CALIBRATION, memory):
                kept = calibrated_step(rounds, PassManager(pipeline), lowered, original, first, compiled_for,
                                       out_dir, stages.telling(log, "peak calibration"), data_parallel)  # fmt: skip
            optimized.graph, optimized.context, optimized.calibration = kept.graph, kept.ctx, kept.calibration
            optimized.step, compiled = steps[id(kept.graph)], kept.compiled
        if measure_choice and not cached.hit:
            made = Calibrated(optimized.graph, compiled, optimized.context, optimized.calibration)
            with stages.stage("measured choice", "measured choice: compiling and measuring the recompute-only plan"), \
                    stage_noted(CHOICE, memory):
                kept, optimized.choice = measured_choice(PassManager(pipeline), lowered, original, made, compiled_for,
                                                         rounds, out_dir, stages.telling(log, "measured choice"),
                                                         held_ratio)  # fmt: skip
            optimized.graph, optimized.context, optimized.calibration = kept.graph, kept.ctx, kept.calibration
            optimized.step, compiled = steps[id(kept.graph)], kept.compiled
        if check:
            with stages.stage("check", "checking the optimized step against the captured one"), \
                    stage_noted(CHECK, memory):
                optimized.report = check_graphs(original, optimized.graph, lowered.inputs,
                                                candidate_run=compiled.checked_run, tolerance=compiled.tolerance)
            if data_parallel is not None:
                optimized.report = distributed.equivalent_everywhere(optimized.report, data_parallel)
        if cached.keeps and (optimized.report is None or optimized.report.equivalent):  # never one that differs
            calibration = optimized.calibration.describe() if optimized.calibration is not None else None
            with stages.stage("plan cache"):
                cached.keep(optimized.context, calibration=calibration, choice=optimized.choice,
                            setup_seconds=stages.total())  # fmt: skip
    # from here on the process holds what the step needs; after the heap is given back to the
    # collector, so that garbage older than setup (a step dropped for a new capture) is freed too
    free_planning_leftovers(lowered.device)
    optimized.setup_seconds, optimized.cache_hit = stages.total(), cached.hit if cached.cache is not None else None
    return optimized


def _refuse_options(backend: str, pipeline: list[Pass], data_parallel: DataParallel | None, calibrate_peak: int | None,
                    measure_choice: bool, budget: Budget | None) -> None:  # fmt: skip
    """Refuse, before planning, options ``backend`` cannot run: a data-parallel step under a backend
    that cannot run it, calibration or a measured choice where they cannot run (a measured choice
    when the step is data-parallel: :func:`~mutwo.runtime.parallel.distributed.planning_refusal`)."""
    refusal = None
    if data_parallel is not None:
        refusal = distributed.backend_refusal(backend, data_parallel)
        if refusal is not None:
            raise BackendError(refusal)
        refusal = distributed.planning_refusal(measure_choice, "measure_choice")
    refusal = refusal or calibration_refusal(calibrate_peak, backend, pipeline, "calibrate_peak", "budget=")
    refusal = refusal or choice_refusal(measure_choice, backend, pipeline, "measure_choice", budget)
    if refusal is not None:
        raise ValueError(refusal)
