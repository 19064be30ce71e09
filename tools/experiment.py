"""``mutwo-experiment``: measure a model's training step over batch sizes and memory budgets.

    mutwo-experiment examples/resnet152.yaml --batch-sizes 16,32,64 --budgets 0.7,0.5 -o experiments/resnet152

For every batch size it measures eager PyTorch (``eager``), mutwo's captured step without
recompute (``none``) and mutwo at every budget, each configuration in a fresh process so that no
allocator state leaks between them: at least 3 warm-up iterations, then the median time of at
least 10 and, on CUDA, the peak ``torch.cuda.max_memory_allocated`` over them. The ``none`` run
profiles the graph once per batch size; the budget runs reuse its profile (the graph's
fingerprint is checked). A configuration that runs out of memory is recorded as such.

It writes ``results.json`` after every configuration and, at the end, three plots: peak memory
vs batch size, iteration time vs batch size and simulated vs measured peak.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mutwo.ir.pass_base import write_atomic
from mutwo.ir.pass_manager import PipelineFailure
from mutwo.ir.replay import describe
from mutwo.ir.timeline import TransferModel
from mutwo.runtime.capture.training import PRECISIONS, TrainingOptions
from mutwo.runtime.planning.plan_choice import RECOMPUTE_ONLY, SWAP_AND_RECOMPUTE
from mutwo.tools.cli import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, Parser, UsageError

ROOT = Path(__file__).resolve().parent.parent
OUT_OF_MEMORY = "out of memory"
#: The copy model the unbudgeted run measures beside its profile.json, which the planned runs reuse.
TRANSFER_FILE = "transfer.json"


def build_parser() -> argparse.ArgumentParser:
    # The description is the docstring's first line, without its reStructuredText markup; every option that has a
    # default says it, as mutwo-opt's do (%(default)s keeps the text and the value together).
    parser = Parser(prog="mutwo-experiment", description=__doc__.split("\n\n")[0].replace("``", ""))
    parser.add_argument("config", help="YAML config describing the model, as for mutwo-opt")
    parser.add_argument("--batch-sizes", required=True, metavar="LIST",
                        help="comma-separated, e.g. 16,32,64 (required)")  # fmt: skip
    parser.add_argument("--budgets", default="0.7,0.5", metavar="LIST",
                        help="comma-separated budgets: fractions of mutwo's unoptimized peak, bytes (15GiB) or 'min'; "
                        "'' for none (default: %(default)s)")  # fmt: skip
    parser.add_argument("--no-eager", action="store_true", help="do not measure eager PyTorch (default: measure it)")
    parser.add_argument("-o", "--out", help="output folder (default: mutwo-out/experiment-<config name>)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], help="where to run (default: the config's)")
    parser.add_argument("--memory-limit", metavar="MEMORY",
                        help="CUDA only: cap the training step's GPU memory, e.g. 16GiB (torch.cuda."
                        "set_per_process_memory_fraction; planning runs uncapped; default: no cap)")  # fmt: skip
    parser.add_argument("--warmup", type=int, default=3, metavar="N",
                        help="warm-up iterations, at least 3 (default: %(default)s)")  # fmt: skip
    parser.add_argument("--iterations", type=int, default=10, metavar="N",
                        help="measured iterations, at least 10 (default: %(default)s)")  # fmt: skip
    parser.add_argument("--timeout", type=int, default=900, metavar="SECONDS",
                        help="seconds per configuration (default: %(default)s)")  # fmt: skip
    parser.add_argument("--keep-going-after-oom", action="store_true",
                        help="measure larger batches of a variant that already ran out of memory "
                        "(default: record them as skipped)")  # fmt: skip
    parser.add_argument("--worker", nargs=2, metavar=("BATCH", "VARIANT"), help=argparse.SUPPRESS)
    return parser


# -- one configuration, in its own process ---------------------------------------------------------
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
    """Median time of ``iterations`` whole steps after ``warmup`` and, on CUDA, their peak memory.

    Running out of memory is a result, not a crash: it comes back as ``{"error": "out of memory"}``.
    """
    cuda = device.type == "cuda"
    times: list[float] = []
    try:
        for _ in range(warmup):
            step()
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        for _ in range(iterations):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                step()
                end.record()
                torch.cuda.synchronize(device)
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
        "peak_bytes": max(torch.cuda.max_memory_allocated(device), getattr(step, "recorded_peak_bytes", 0))
        if cuda else None,
    }


def run_configuration(config_path: str | Path, batch_size: int, variant: Any, out: Path, *, device: str | None = None,
                      memory_limit: int | None = None, warmup: int = 3, iterations: int = 10,
                      precision: str | None = None,
                      log: Callable[[str], None] = lambda message: None,
                      optimizer_passes: bool = False, swap: bool = False,
                      backend: str = "eager", trace: Path | None = None,
                      isolate_profile: bool = False, calibrate_peak: int = 0, measure_choice: bool = False,
                      before_measuring: Callable[[], None] | None = None,
                      device_lock: Path | None = None, reuse_profile: bool = False) -> dict[str, Any]:  # fmt: skip
    """Build, plan (for mutwo variants) and measure one configuration in this process.

    ``variant``: ``eager``, ``none`` (mutwo's captured step; profiles it and writes
    ``out/b<batch>/profile.json``) or a budget, as text or a :class:`Budget` (select and rewrite,
    with that profile when there is one). ``optimizer_passes``: run optimizer-in-backward and
    foreach-buckets (the ``optimizer`` alias) after the profile, before select. ``swap``: plan
    with select-swap and insert-swap (keep, recompute or swap each activation) instead.
    ``backend``: what runs the planned graph (compiled as part of planning; CUDA graphs get a
    capturable optimizer with learning rates on the GPU,
    :func:`mutwo.runtime.execution.cuda_graphs.graphable_optimizer`). ``trace``: after measuring, profile
    3 more iterations on the GPU, write their Chrome trace there and add the per-stream summary
    (:mod:`mutwo.tools.stream_trace`) under ``streams``. ``isolate_profile``: profile with
    ``profile{isolate=true}`` (each node's GPU time without the host's launch time).
    ``calibrate_peak``: with a compiled backend, up to that many re-plans until the compiled
    step's measured peak is within 3% of the budget (:mod:`mutwo.runtime.planning.peak_calibration`).
    ``measure_choice``: with ``swap`` and a compiled backend, when select-swap's plan swaps, also
    compile the recompute-only plan at its budget and keep whichever is measured faster, each
    measured alone after ``before_measuring`` (:class:`PlanChoice`; the row's
    ``measured_choice`` says what each ran). ``device_lock``: a file whose lock calibration holds
    while it measures (:func:`device_turn`), for processes planning side by side.
    ``reuse_profile``: a ``none`` run that reuses the saved profile (and copy model) as the budget
    runs do, instead of profiling and saving its own: the unplanned step under another backend,
    planned beside other processes, whose measurement anchors their predicted times
    (``bench/compare.py``).
    """
    from mutwo.ir.budget import parse_budget
    from mutwo.ir.pass_manager import PipelineFailure
    from mutwo.runtime.execution.backends import BackendError

    training = build_training(config_path, batch_size, device, precision)
    row: dict[str, Any] = {"batch_size": batch_size, "variant": variant, "precision": training.options.precision}
    try:
        if variant == "eager":
            step = training.eager_step()
        else:
            budget = variant if not isinstance(variant, str) else (None if variant == "none" else parse_budget(variant))
            step = _planned_step(training, budget, out / f"b{batch_size}", row, log, optimizer_passes, swap,
                                 backend, isolate_profile, calibrate_peak, measure_choice, device_lock,
                                 reuse_profile)  # fmt: skip
    except torch.OutOfMemoryError:
        return {**row, "error": f"{OUT_OF_MEMORY} while planning"}
    except PipelineFailure as failure:  # an unreachable budget, say: a result, in one line
        message = str(failure).splitlines()[0]
        return {**row, "error": message, "error_kind": "unreachable" if "unreachable" in message else "pass failed"}
    except BackendError as refused:  # a backend that cannot run this step: a result too
        return {**row, "error": str(refused), "error_kind": "backend"}
    if before_measuring is not None:
        before_measuring()
    if isinstance(step, PlanChoice):
        free_planning_leftovers(training.device)  # as before any row's measurement
        resolved = step.resolve(row, log, warmup=warmup, iterations=iterations)
        if resolved is None:
            return {**row, "error": f"{OUT_OF_MEMORY} while measuring both plans of the measured choice"}
        step = resolved
    log(f"measuring batch {batch_size}, {variant}")
    row.update(measure_after_planning(step, training.device, memory_limit, warmup=warmup, iterations=iterations,
                                      trace=trace))  # fmt: skip
    return row


def free_planning_leftovers(device: torch.device) -> None:
    """Collect what planning left and, on CUDA, give the allocator's cached blocks back, so that a
    measurement starts from the step's own memory."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure_after_planning(step: Callable[[], Any], device: torch.device, memory_limit: int | None, *,
                           warmup: int, iterations: int, trace: Path | None = None) -> dict[str, Any]:  # fmt: skip
    """Free what planning left in the allocator's cache, cap memory if asked, and measure; with
    ``trace``, then profile 3 more iterations per stream (:mod:`mutwo.tools.stream_trace`)."""
    row: dict[str, Any] = {}
    free_planning_leftovers(device)
    if device.type == "cuda":
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

        def step() -> None:
            self.optimizer.zero_grad(set_to_none=True)
            with torch.autocast(self.device.type, dtype=dtype, enabled=dtype is not None):
                output = runner(**self.batch) if isinstance(self.batch, dict) else runner(*self.batch)
                loss = self.loss_fn(output, self.batch)
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


def _planned_step(training: Training, budget: Any, folder: Path, row: dict[str, Any],
                  log: Callable[[str], None], optimizer_passes: bool = False,
                  swap: bool = False, backend: str = "eager",
                  isolate_profile: bool = False, calibrate: int = 0,
                  measure_choice: bool = False, device_lock: Path | None = None,
                  reuse_profile: bool = False) -> Callable[[], Any]:  # fmt: skip
    from mutwo.ir.memory import simulate
    from mutwo.ir.pass_manager import PassManager, PipelineFailure
    from mutwo.ir.registry import PassRegistry
    from mutwo.runtime.execution.backends import BackendError, backend_services
    from mutwo.runtime.execution.cuda_graphs import graphable_optimizer
    from mutwo.runtime.execution.step import GraphStep
    from mutwo.runtime.measurement.profiler import Profile, fingerprint
    from mutwo.runtime.planning.captured import capture_graph, pass_context
    from mutwo.runtime.planning.peak_calibration import pipeline_plan

    if calibrate and backend == "eager":
        raise BackendError("peak calibration re-plans for a compiled step's measured peak (the eager executor's is the "
                           "simulated one); drop it, or plan for a compiled backend (inductor, inductor-cudagraphs, "
                           "cudagraphs)")  # fmt: skip
    if measure_choice and backend == "eager":
        raise BackendError("a measured choice between plans is for compiled backends, whose steps run otherwise than "
                           "the eager times the plans are priced at; the eager executor's select-swap choice is "
                           "already priced as it runs: drop it, or plan for inductor, inductor-cudagraphs or "
                           "cudagraphs")  # fmt: skip
    if backend.endswith("cudagraphs"):
        graphable_optimizer(training.optimizer, training.device)
    profiles = budget is None and not reuse_profile  # this run makes the profile.json the others reuse
    saved, saved_transfer = folder / "profile.json", folder / TRANSFER_FILE
    if profiles:  # an older profile must not outlive a run that fails before saving its own
        for old in (saved, saved_transfer, folder / "timing.json"):
            old.unlink(missing_ok=True)
    started = time.perf_counter()
    lowered = capture_graph(training.model, training.optimizer, training.batch, training.loss_fn, training.options)
    row["capture_seconds"] = round(time.perf_counter() - started, 2)
    folder.mkdir(parents=True, exist_ok=True)
    context = pass_context(lowered, budget, out_dir=folder if profiles else None, log=log)
    context.services.update(backend_services(backend), measure_choice=measure_choice)
    planning = ["optimizer"] if optimizer_passes else []
    planning += (["swap"] if swap else ["select", "rewrite"]) if budget is not None else []
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
        recompute_only = ",".join([*(["optimizer"] if optimizer_passes else []), "select", "rewrite"])
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
        row["predicted_iteration_ms"] = round((plan.base_seconds + plan.added_seconds) * 1e3, 3)
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

    def plan_and_measure(budget_bytes: int) -> tuple[CalibrationRound, tuple[Any, Any, Any]] | None:
        if not candidates:  # the first round is the step already planned and compiled
            made = first, plan, first.graph
        else:
            replanned = _plan_compiled(pristine, lowered, planning, budget_bytes, first.backend, profile, log)
            if isinstance(replanned, PipelineFailure):  # a lower budget out of reach: the rounds so far stand
                return None
            made = replanned
        candidates.append(made)
        step, chosen, _ = made
        with device_turn(device_lock):
            measured = measured_peak(step.compiled.run, lowered.inputs)
        return CalibrationRound(budget_bytes, chosen.predicted_peak, measured, chosen.unoptimized_peak), made

    calibration = calibrate(plan.budget_bytes, rounds, plan_and_measure, log)
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
    from mutwo.ir.budget import Budget
    from mutwo.ir.pass_manager import PassManager
    from mutwo.ir.registry import PassRegistry
    from mutwo.runtime.execution.backends import backend_services
    from mutwo.runtime.execution.step import GraphStep
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
    step = GraphStep(graph, lowered.captured, lowered.binding, backend)
    step.compile(lowered.inputs)
    return step, pipeline_plan(context.artifacts), graph


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
    """A planned step on its batch, called by :func:`measure_step`."""

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


# -- the whole experiment ----------------------------------------------------------------------------
def _parse_list(text: str, what: str, parse: Callable[[str], Any]) -> list[Any]:
    items = list(dict.fromkeys(item.strip() for item in text.split(",") if item.strip()))
    if not items:
        raise UsageError(f"--{what} is empty; give a comma-separated list")
    try:
        return [parse(item) for item in items]
    except ValueError as error:
        raise UsageError(f"--{what}: {error}") from None


def _positive_int(text: str) -> int:
    value = int(text) if text.isdigit() else 0
    if value <= 0:
        raise ValueError(f"batch size must be a positive integer, got {text}")
    return value


def _budget(text: str) -> str:
    from mutwo.ir.budget import BudgetError, parse_budget

    try:
        parse_budget(text)
    except BudgetError as error:
        raise ValueError(str(error)) from None
    return text


def _memory_limit(text: str | None) -> int | None:
    if text is None:
        return None
    from mutwo.ir.budget import BudgetError, parse_bytes

    try:
        return parse_bytes(text)
    except BudgetError as error:
        raise UsageError(f"--memory-limit: {error}") from None


def run_experiment(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from mutwo.tools.config import ConfigError, apply_overrides, load_config
    from mutwo.tools.workloads import target_device

    batch_sizes = _parse_list(args.batch_sizes, "batch-sizes", _positive_int)
    budgets = _parse_list(args.budgets, "budgets", _budget) if args.budgets.strip() else []
    memory_limit = _memory_limit(args.memory_limit)
    if args.warmup < 3 or args.iterations < 10:
        raise UsageError("--warmup must be at least 3 and --iterations at least 10, for a stable median")
    try:
        config = apply_overrides(load_config(args.config), device=args.device)
        on_gpu = target_device(config).type == "cuda"
    except ConfigError as error:
        raise UsageError(str(error)) from None
    if memory_limit is not None and not on_gpu:  # set_per_process_memory_fraction caps CUDA memory only
        raise UsageError("--memory-limit caps CUDA memory, but this run is on the CPU, where it would cap nothing; "
                         "drop --memory-limit, or run on a GPU (--device cuda)")
    out = Path(args.out) if args.out else Path("mutwo-out") / f"experiment-{config.name}"
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UsageError(f"output folder {str(out)!r} cannot be created ({error.strerror}); "
                         "choose another with -o") from None
    variants = ([] if args.no_eager else ["eager"]) + ["none"] + budgets
    header = {"config": args.config, "model": config.model.name, "torch": torch.__version__,
              "device": torch.cuda.get_device_name() if on_gpu else "cpu",
              "date": time.strftime("%Y-%m-%d"), "warmup": args.warmup, "iterations": args.iterations,
              "memory_limit_bytes": memory_limit, "runs": []}  # fmt: skip
    ran_out: set[str] = set()
    jobs = [(b, v) for b in sorted(batch_sizes) for v in variants]
    # A bar redrawn with \r only on a terminal (disable=None): a log file gets one plain line per configuration
    # instead, in mutwo-opt's "tool: message" form.
    with tqdm(jobs, desc="mutwo-experiment", unit="config", file=sys.stderr, disable=None) as progress:
        for index, (batch_size, variant) in enumerate(progress, start=1):
            if progress.disable:
                print(f"mutwo-experiment: [{index}/{len(jobs)}] batch {batch_size}, {variant}", file=sys.stderr,
                      flush=True)  # fmt: skip
            else:
                progress.set_postfix_str(f"batch {batch_size}, {variant}")
            if variant in ran_out and not args.keep_going_after_oom:
                row = {"batch_size": batch_size, "variant": variant,
                       "error": f"skipped: {OUT_OF_MEMORY} at a smaller batch"}  # fmt: skip
            else:
                row = _run_worker(args, batch_size, variant, out)
            if str(row.get("error", "")).startswith(OUT_OF_MEMORY):
                ran_out.add(variant)
            header["runs"].append(row)
            progress.write(_describe(row))
            write_atomic(out / "results.json", json.dumps(header, indent=2) + "\n")
    from mutwo.tools.experiment_plots import plot_all

    written = plot_all(header, out)
    print(f"mutwo-experiment: wrote {', '.join([f'{out}/results.json', *written])}", file=sys.stderr)
    # Running out of memory or an unreachable budget are findings of a sweep, not failures of it.
    failed = [r for r in header["runs"] if "error" in r and r.get("error_kind") != "unreachable"
              and not str(r["error"]).startswith(("skipped", OUT_OF_MEMORY))]  # fmt: skip
    return EXIT_FAILURE if failed else EXIT_OK


def _run_worker(args: argparse.Namespace, batch_size: int, variant: str, out: Path) -> dict[str, Any]:
    command = [sys.executable, "-m", "mutwo.tools.experiment", args.config, "--batch-sizes", str(batch_size),
               "--worker", str(batch_size), variant, "-o", str(out)]  # fmt: skip
    for flag, value in (("--device", args.device), ("--memory-limit", args.memory_limit)):
        if value:
            command += [flag, value]
    command += ["--warmup", str(args.warmup), "--iterations", str(args.iterations)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    base = {"batch_size": batch_size, "variant": variant}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired:
        return {**base, "error": f"timeout after {args.timeout} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode == 0 and lines:
        return json.loads(lines[-1])
    if "OutOfMemoryError" in done.stderr or "out of memory" in done.stderr:
        return {**base, "error": OUT_OF_MEMORY}
    last = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
    return {**base, "error": last[:400]}


def _describe(row: dict[str, Any]) -> str:
    what = f"batch {row['batch_size']:>4} {row['variant']:>8}: "
    if "error" in row:
        return what + row["error"]
    peak = f"peak {row['peak_bytes'] / 2**20:,.0f} MiB, " if row.get("peak_bytes") is not None else ""
    plan = f", planning {row['planning_seconds']:.1f} s" if "planning_seconds" in row else ""
    return what + f"{peak}{row['iteration_ms']:.1f} ms per iteration{plan}"


def main(argv: list[str] | None = None) -> int:
    """Run mutwo-experiment; returns the exit code."""
    try:
        args = build_parser().parse_args(argv)
        if args.worker:
            batch_size, variant = int(args.worker[0]), args.worker[1]
            row = run_configuration(args.config, batch_size, variant, Path(args.out), device=args.device,
                                    memory_limit=_memory_limit(args.memory_limit), warmup=args.warmup,
                                    iterations=args.iterations)  # fmt: skip
            print(json.dumps(row), flush=True)
            return EXIT_OK
        return run_experiment(args)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    except UsageError as error:
        print(f"mutwo-experiment: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("mutwo-experiment: interrupted; results.json holds the configurations measured so far",
              file=sys.stderr)  # fmt: skip
        return 130


if __name__ == "__main__":
    sys.exit(main())
