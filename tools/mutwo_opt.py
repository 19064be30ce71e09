"""``mutwo-opt``: capture a model's training iteration and run a pipeline of passes over it.

    mutwo-opt [-p/--passes LIST] [-o/--out DIR] [--device auto|cpu|cuda] [--batch-size N]
              [--budget B] [--seed N] [--precision P] [--memory-format F] [--check]
              [--profile-from FILE] [--plan-from FILE] [--list-passes] [--load-passes M]
              [--no-verify] [--print-ir-after-all] [--print-ir-after P,...] [--dump-dot]
              [--time-passes] [--fit MEMORY [--fit-margin SHARE] [--fit-max-slowdown FACTOR]]
              [--calibrate-peak ROUNDS] [--measure-choice] [--memory-limit MEMORY] [-q/--quiet]
              [--bucket-cap-mb MB] [--sharding ddp|fsdp2] [--cache-dir DIR | --no-cache] [--debug]
              [--backend auto|eager|inductor|cudagraphs|inductor-cudagraphs] CONFIG.yaml

Launched by torchrun (``torchrun --nproc-per-node N -m mutwo.tools.mutwo_opt ...``), every rank
captures the data-parallel iteration on its shard of the batch, the gradients are averaged
inside the graph, and rank 0 writes the output folder.

Exit codes: 0 success; 1 a pass or verification failed, or --check found a difference;
2 bad usage, config or pipeline. Every error is one line on stderr.

This module runs the command (:class:`MutwoOpt`, :func:`main`); its command line and the checks
made before the capture are :mod:`mutwo.tools.mutwo_opt_args`', the files an earlier run gives
are read by :mod:`mutwo.tools.mutwo_opt_reuse`, and the output folder is written by
:mod:`mutwo.tools.mutwo_opt_report`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from mutwo.ir import to_fx
from mutwo.ir.graph import Graph
from mutwo.ir.pass_base import PassContext
from mutwo.ir.pass_manager import Instrumentation, PassManager, PipelineFailure, PipelineResult
from mutwo.ir.registry import PassRegistry, RegistryError
from mutwo.ir.verifier import VerificationError
from mutwo.runtime.capture.optim import UnsupportedOptimizerError
from mutwo.runtime.capture.tracing import CaptureError, debug_enabled
from mutwo.runtime.execution.auto_backend import AUTO, early_choice
from mutwo.runtime.execution.backends import (
    BackendError,
    CompiledStep,
    CompileError,
    backend_services,
    compile_graph,
    records_cuda_graphs,
)
from mutwo.runtime.execution.cuda_graphs import refuse_uncapturable
from mutwo.runtime.measurement.device_memory import MemoryLimitError, apply_memory_limit, lift_memory_limit
from mutwo.runtime.measurement.equivalence import EquivalenceReport, check_graphs
from mutwo.runtime.measurement.expandable_segments import use_expandable_segments
from mutwo.runtime.measurement.iterations import measure_iterations
from mutwo.runtime.measurement.out_of_memory import (
    CALIBRATION,
    CAPTURE,
    CHECK,
    CHOICE,
    COMPILE,
    MEASURE,
    MemorySettings,
    one_line,
    out_of_memory_in,
    stage_noted,
)
from mutwo.runtime.parallel import distributed
from mutwo.runtime.parallel.distributed import DataParallel
from mutwo.runtime.parallel.sharding import shard_blocks
from mutwo.runtime.planning.auto_capture import capture_for_backend
from mutwo.runtime.planning.captured import CapturedGraph, pass_context
from mutwo.runtime.planning.collector import older_heap_frozen
from mutwo.runtime.planning.fit import FitError
from mutwo.runtime.planning.peak_calibration import (
    Calibrated,
    Calibration,
    CalibrationOutOfMemory,
    calibrated_step,
    calibration_rounds,
    plan_first_at_window,
    release_recording,
)
from mutwo.runtime.planning.plan_cache import CachedPlanning
from mutwo.runtime.planning.plan_choice import ChoiceFailed, measured_choice
from mutwo.runtime.planning.plan_key import run_settings
from mutwo.tools.cli import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    OutputFolder,
    UsageError,
    mutwo_warnings_on_one_line,
    print_debug_traceback,
)
from mutwo.tools.config import Config, ConfigError, apply_overrides, load_config
from mutwo.tools.fit import run_fit
from mutwo.tools.mutwo_opt_args import (
    build_parser,
    checked_out_dir,
    memory_limit,
    print_ir_after,
    refuse_backend_choices,
    refuse_fit_misuse,
    refuse_options_fit_leaves_unused,
)
from mutwo.tools.mutwo_opt_report import describe_files, write_outputs
from mutwo.tools.mutwo_opt_reuse import (
    REUSED,
    GivenFile,
    check_given_files,
    given_files,
    load_artifact,
    refuse_remade_artifacts,
    refuse_unread_plan,
)
from mutwo.tools.workloads import Workload, build_optimizer, build_workload, target_device, to_device, training_options


class Failure(Exception):
    """A pass, verification or the equivalence check failed: exit code 1."""


#: What a failure inside a pass adds to its one line: where the traceback is.
DEBUG_HINT = "run again with --debug for the traceback"


class MutwoOpt:
    """The steps of one mutwo-opt run, in order; :meth:`run` strings them together."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.registry = PassRegistry()
        self.started = time.perf_counter()
        self.wall_started = time.time() - 1  # file times have coarse resolution on some filesystems
        self.calibration: Calibration[Any] | None = None  #: with --calibrate-peak, its rounds
        self.choice: dict[str, Any] | None = None  #: with --measure-choice, both plans measured and the kept one
        self.plan_cache = CachedPlanning()  #: the plan cache's hit or miss (off until the passes run)
        self.dp: DataParallel | None = None  #: under torchrun: the ranks averaging the gradients
        self.joined = False  #: whether this run joined the process group (and leaves it at the end)
        self.gradient_buckets: list[list[str]] = []  #: data parallel: the all-reduce buckets, in issue order
        self.sharded_blocks: list[str] | None = None  #: --sharding fsdp2: the blocks fully_shard wrapped
        self.output: OutputFolder | None = None  #: the output folder, once this run has made it
        self.cap_lifted: Callable[[], None] | None = None  #: undoes --memory-limit's cap when the run ends
        #: the device, budget and memory limit an out-of-memory error's note names (set once they are known)
        self.memory = MemorySettings(torch.device("cpu"))
        self.phase_seconds: dict[str, float] = {}  #: capture, passes, compile, check, measure: seconds each
        self.inner_seconds = 0.0  #: what the phases timed inside the current one took

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Count the time inside toward ``phase`` (summary.json's phase_seconds, --time-passes); a
        phase timed inside another counts toward itself alone (--fit captures while it plans)."""
        started = time.perf_counter()
        outer, self.inner_seconds = self.inner_seconds, 0.0
        try:
            yield
        finally:
            elapsed = time.perf_counter() - started
            self.phase_seconds[phase] = self.phase_seconds.get(phase, 0.0) + elapsed - self.inner_seconds
            self.inner_seconds = outer + elapsed

    def rounded_phases(self) -> dict[str, float]:
        """The seconds of each phase to the millisecond: summary.json's and fit.json's phase_seconds."""
        return {phase: round(seconds, 3) for phase, seconds in self.phase_seconds.items()}

    def phase_report(self) -> str:
        """The --time-passes table of the whole run: what the pass timing leaves out (the capture,
        the compile, the check) beside the passes."""
        total = time.perf_counter() - self.started
        lines = ["===== mutwo-opt run timing =====", f"{'seconds':>10} {'%':>6}  phase"]
        other = total - sum(self.phase_seconds.values())
        for phase, seconds in [*self.phase_seconds.items(), ("other (setup, reports, files)", other)]:
            lines.append(f"{seconds:10.4f} {100 * seconds / total:6.1f}  {phase}")
        lines.append(f"{total:10.4f} {100.0:6.1f}  total")
        return "\n".join(lines)

    @property
    def lead(self) -> bool:
        """Rank 0 of a data-parallel run, or the only process: the one that logs and writes files."""
        return self.dp is None or self.dp.rank == 0

    def log(self, message: str) -> None:
        if not self.args.quiet and self.lead:
            print(f"mutwo-opt: {message}", file=sys.stderr, flush=True)

    # -- steps -----------------------------------------------------------------------------
    def load_passes(self) -> None:
        for target in self.args.load_passes:
            try:
                names = self.registry.load(target)
            except RegistryError as error:
                raise UsageError(str(error)) from None
            self.log(f"loaded passes {', '.join(names)} from {target}")

    def load_config(self) -> Config:
        if not self.args.config:
            raise UsageError("no config file given; usage: mutwo-opt [options] CONFIG.yaml (see mutwo-opt --help)")
        try:
            config = load_config(self.args.config)
            apply_overrides(config, batch_size=self.args.batch_size, device=self.args.device,
                            budget=self.args.budget, passes=self.args.passes, seed=self.args.seed,
                            backend=self.args.backend, precision=self.args.precision,
                            memory_format=self.args.memory_format)  # fmt: skip
        except ConfigError as error:
            raise UsageError(str(error)) from None
        return config

    def resolve_device(self, config: Config) -> torch.device:
        try:
            return target_device(config)
        except ConfigError as error:
            raise UsageError(str(error)) from None

    def join_data_parallel(self, device: torch.device) -> torch.device:
        """Under torchrun, join its process group; this rank's device (its own GPU) comes back."""
        sharded = self.args.sharding == "fsdp2"
        if not distributed.launched_by_torchrun():
            if self.args.bucket_cap_mb is not None or sharded:
                option = "--bucket-cap-mb" if self.args.bucket_cap_mb is not None else "--sharding fsdp2"
                raise UsageError(f"{option} applies to data-parallel runs; launch with torchrun "
                                 "--nproc-per-node N -m mutwo.tools.mutwo_opt ...")  # fmt: skip
            return device
        if sharded and self.args.bucket_cap_mb is not None:
            raise UsageError("--bucket-cap-mb sets DDP's gradient buckets; a --sharding fsdp2 run communicates per "
                             "fully_shard block, so drop it")  # fmt: skip
        try:
            self.joined = not torch.distributed.is_initialized()
            device = distributed.join_from_environment(device)
            self.dp = distributed.DataParallel.for_group(bucket_cap_mb=self.args.bucket_cap_mb)
        except distributed.DataParallelError as error:
            raise UsageError(str(error)) from None
        self.log(f"data parallel over {self.dp.world_size} ranks ({torch.distributed.get_backend()}); "
                 "rank 0 writes the output")  # fmt: skip
        return device

    def build_pipeline(self, config: Config) -> PassManager:
        # A missing file, or one of another kind, is named before what a pipeline needs.
        check_given_files(self.reused_files)
        available = {reused.artifact for reused, _, _ in self.reused_files}
        try:
            if available:  # what is wrong with a given file first: the requirements it does not meet follow
                unchecked = self.registry.build_pipeline(config.passes, {r.artifact for r in REUSED})
                refuse_remade_artifacts(self.reused_files, unchecked)
                refuse_unread_plan(self.reused_files, unchecked)
            passes = self.registry.build_pipeline(config.passes, available)
        except RegistryError as error:
            raise UsageError(str(error)) from None
        instrumentation = Instrumentation(
            verify=not self.args.no_verify, print_ir_after_all=self.args.print_ir_after_all,
            print_ir_after=print_ir_after(self.args.print_ir_after, self.registry, passes),
            dump_dot=self.args.dump_dot, time_passes=self.args.time_passes,
        )  # fmt: skip
        return PassManager(passes, instrumentation)

    @functools.cached_property
    def reused_files(self) -> list[GivenFile]:
        """The files ``--profile-from`` and ``--plan-from`` give (:func:`given_files`), read once."""
        return given_files(self.args)

    def capture(self, config: Config, device: torch.device) -> CapturedGraph:
        self.log(f"building {config.model.source} model '{config.model.name}' (batch {config.batch_size}, {device})")
        started = time.perf_counter()  # --fit captures once per batch size: say what each one took
        try:
            workload, batch = self.build(config)
            model = workload.model.to(device)
            batch = to_device(batch, device)
            if self.dp is not None:
                distributed.broadcast_model(model, self.dp)
            if self.dp is not None and self.args.sharding == "fsdp2":
                try:
                    self.sharded_blocks = shard_blocks(model, device)
                except ValueError as error:
                    raise UsageError(str(error)) from None
                self.dp = distributed.DataParallel.from_fully_shard(model)
                self.log(f"sharded {len(self.sharded_blocks)} repeated blocks and the model with fully_shard "
                         f"over {self.dp.world_size} ranks")  # fmt: skip
            optimizer = build_optimizer(config, model)
            if config.accumulation_steps == 1:
                self.log("capturing one training iteration (forward, backward, optimizer step)")
            else:  # capture_graph's default: the micro-batch that holds the most
                self.log(f"capturing the last micro-batch of gradient accumulation (accumulation_steps="
                         f"{config.accumulation_steps}): forward, backward added to the accumulated gradients, "
                         "optimizer step; the micro-batch with the highest peak")  # fmt: skip
            lowered, chosen = capture_for_backend(config.backend, model, optimizer, batch, workload.loss_fn,
                                                  training_options(config, device), data_parallel=self.dp)  # fmt: skip
            if chosen is not None:
                self.log(chosen.sentence())
                config.backend = chosen.backend
        except (ConfigError, CaptureError, UnsupportedOptimizerError, distributed.DataParallelError) as error:
            raise UsageError(str(error)) from None
        except distributed.RanksDisagreeError as error:
            raise Failure(str(error)) from None
        lowered.graph.meta.update(model=config.model.name, batch_size=config.batch_size, device=str(device))
        self.log(f"captured {len(lowered.graph)} nodes in {time.perf_counter() - started:.1f} s")
        return lowered

    def build(self, config: Config) -> tuple[Workload, Any]:
        """The workload and this process's batch: under torchrun, its shard of a global batch of
        ``batch_size`` samples per rank, built from the seed like a single process's."""
        if self.dp is None:
            workload = build_workload(config)
            return workload, workload.batch
        workload = build_workload(dataclasses.replace(config, batch_size=config.batch_size * self.dp.world_size))
        return workload, distributed.shard_batch(workload.batch, self.dp.rank, self.dp.world_size)

    def compile(self, config: Config, final: Graph, inputs: list[Any]) -> CompiledStep:
        """The final graph made runnable by the config's backend (compiled here, timed as planning)."""
        if config.backend != "eager":
            self.log(f"compiling the final graph with {config.backend}")
        try:
            with stage_noted(COMPILE, self.memory):
                compiled = compile_graph(final, inputs, config.backend)
        except CompileError as error:
            raise Failure(str(error)) from None
        except BackendError as error:
            raise UsageError(str(error)) from None
        if config.backend != "eager":
            self.log(f"compiled in {compiled.compile_seconds:.1f} s{compiled.cache_note()}")
        return compiled

    def look_up_plan(self, config: Config, lowered: CapturedGraph, manager: PassManager, ctx: PassContext,
                     limit: int | None, rounds: int) -> CachedPlanning:  # fmt: skip
        """This run's entry of the plan cache (docs/plan-cache.md), whose hit skips profile, select,
        calibration and the measured choice; not looked up with --no-cache, nor where --profile-from
        or --plan-from give what an entry would."""
        if self.args.no_cache:
            return CachedPlanning()
        if self.reused_files:
            reused = self.reused_files[0][0]
            self.log(f"plan cache not used: {reused.option} gives the {reused.artifact}")
            return CachedPlanning()
        settings = run_settings(budget=config.budget, memory_limit=limit, backend=config.backend, keep_grads=False,
                                calibration_rounds=rounds, measure_choice=self.args.measure_choice,
                                precision=config.precision)  # fmt: skip
        return CachedPlanning.begin(self.args.cache_dir, lowered, manager.passes, settings,
                                    ctx.services.get("device_memory"), self.log, self.dp is not None)  # fmt: skip

    def measure(self, original: Graph, final: CompiledStep, inputs: list[Any], device: torch.device,
                original_fits: bool) -> dict[str, Any]:  # fmt: skip
        """Measured peaks and iteration times of the captured graph and the final step (run by its
        backend); on CUDA only (the simulator covers CPU). The captured graph only where it fits:
        not after a profile made out of core because it did not."""
        if device.type != "cuda":
            return {}
        after = measure_iterations(final.run, inputs, on_inputs=True)  # one copy of the state, as under a limit
        release_recording(final.run)  # the original is measured next, and the process holds the step's pool
        measured = {"measured_peak_bytes_after": after.peak_bytes, "measured_held_bytes_after": after.held_bytes,
                    "iteration_seconds_after": after.seconds}  # fmt: skip
        if not original_fits:
            self.log("measured whole iterations of the final step; not of the original graph, which was profiled "
                     "out of core because it does not fit")  # fmt: skip
            return measured
        self.log("measuring whole iterations of the original graph and the final step")
        before = measure_iterations(to_fx(original), inputs, on_inputs=True)
        return {**measured, "measured_peak_bytes_before": before.peak_bytes,
                "measured_held_bytes_before": before.held_bytes, "iteration_seconds_before": before.seconds}

    def check(self, original: Graph, final: Graph, inputs: list[Any], compiled: CompiledStep) -> EquivalenceReport:
        self.log(f"checking the final step ({compiled.backend}) against the original graph for 3 iterations")
        report = check_graphs(original, final, inputs, candidate_run=compiled.checked_run,
                              tolerance=compiled.tolerance)  # fmt: skip
        if self.dp is not None:
            report = distributed.equivalent_everywhere(report, self.dp)
        self.log(report.summary())
        return report

    # -- the whole run ---------------------------------------------------------------------
    def run(self) -> int:
        try:
            return self.run_steps()
        except UsageError:
            if self.output is not None:  # refused after writing began: bad usage leaves nothing behind
                self.output.discard()
                self.output = None
            raise
        finally:
            # Any other end, a failure or an interrupt included, keeps its files: they explain it
            # (summary.json's error, the plan that missed).
            if self.output is not None:
                self.output.commit()
            if self.cap_lifted is not None:  # main() may be called again in this process (tests, notebooks)
                self.cap_lifted()
            if self.joined:
                # Wait for every rank (rank 0 writes the files) before tearing the group down: a
                # rank that leaves while another still talks to it aborts gloo's threads.
                torch.distributed.barrier()
                torch.distributed.destroy_process_group()

    def run_steps(self) -> int:
        self.load_passes()
        if self.args.list_passes:
            try:
                print(self.registry.describe_all())
            except RegistryError as error:
                raise UsageError(str(error)) from None
            return EXIT_OK
        config = self.load_config()
        device = self.join_data_parallel(self.resolve_device(config))
        refuse_options_fit_leaves_unused(self.args)
        manager = self.build_pipeline(config)
        out = checked_out_dir(self.args, config, writes=self.lead)
        refuse_fit_misuse(self.args, config.backend)
        if self.args.fit is not None:
            try:
                return run_fit(self, config, device, out)
            except FitError as error:
                raise Failure(str(error)) from None
        chosen = early_choice(device) if config.backend == AUTO else None
        if chosen is not None:  # said once the usage is checked
            config.backend = chosen.backend
        auto = config.backend == AUTO  # on CUDA: chosen once the step is captured
        if not auto:
            refuse_backend_choices(self.args, config, device, manager.passes, data_parallel=self.dp)
        limit = memory_limit(self.args)
        self.memory = MemorySettings(device, config.budget, limit)
        allocator = use_expandable_segments(device)
        if allocator is not None:
            self.log(allocator)
        if limit is not None:  # before capture: the model is moved to the device under the cap too
            try:
                self.log(apply_memory_limit(device, limit))
            except MemoryLimitError as error:
                raise UsageError(str(error)) from None
            self.cap_lifted = functools.partial(lift_memory_limit, device)
        if chosen is not None:
            self.log(chosen.sentence())
        with self.timed("capture"), stage_noted(CAPTURE, self.memory):
            lowered = self.capture(config, device)
        if auto:  # what the backend chosen cannot do is refused as if it were named
            refuse_backend_choices(self.args, config, device, manager.passes, data_parallel=self.dp)
        elif records_cuda_graphs(config.backend):  # before planning: nothing is written for a step it refuses
            try:
                refuse_uncapturable(lowered.graph, lowered.inputs)
            except BackendError as error:
                raise UsageError(str(error)) from None
        self.gradient_buckets = lowered.binding.gradient_buckets
        graph, inputs = lowered.graph, lowered.inputs
        reused_artifacts: dict[str, Any] = {}
        original = graph.copy()
        captured_version: int | None = graph.version
        for reused, path, _ in self.reused_files:  # before anything is written: a refused file leaves nothing
            reused_artifacts[reused.artifact] = load_artifact(graph, reused, path)
        # Everything is written into a stage, moved into `out` when the run ends (tools/cli.OutputFolder).
        staged = None
        if self.lead:
            self.output = OutputFolder.make(out)
            staged = self.output.staging
        ctx = pass_context(lowered, config.budget, out_dir=staged, log=self.log, memory_limit=limit)
        ctx.services.update(backend_services(config.backend), measure_choice=self.args.measure_choice)
        ctx.artifacts.update(reused_artifacts)
        result: PipelineResult | None = None
        failure: PipelineFailure | None = None
        rounds = calibration_rounds(self.args.calibrate_peak, device, manager.passes,
                                    budgeted=config.budget is not None or limit is not None)  # fmt: skip
        with self.timed("plan cache"):
            self.plan_cache = self.look_up_plan(config, lowered, manager, ctx, limit, rounds)
        held_ratio = self.plan_cache.held_ratio()  # read once: the measured choice aims with it too
        aimed = plan_first_at_window(ctx, rounds, held_ratio)
        if aimed is not None and not self.plan_cache.hit:  # a hit makes no plan: it rewrites with the entry's
            self.log(aimed)
        try:
            with self.timed("passes"):
                planned, ctx, result = self.plan_cache.run(manager.passes, graph, ctx, manager.instrumentation)
            if planned is not graph:  # a hit's passes ran on a copy of the captured graph: it is the final one
                graph, captured_version = planned, None
        except PipelineFailure as caught:
            failure = caught
        out_of_memory = None if failure is None else out_of_memory_in(failure, self.memory)
        error = None if failure is None else one_line(out_of_memory) if out_of_memory is not None else str(failure)
        final = graph if graph.version != captured_version else original
        if self.dp is not None and error is None:
            try:
                distributed.require_same_graph(graph, self.dp, "optimized")
            except distributed.RanksDisagreeError as disagreement:
                raise Failure(str(disagreement)) from None
        compiled = None
        if error is None:
            with self.timed("compile"):
                compiled = self.compile(config, final, inputs)
        if self.plan_cache.hit:  # the entry holds the plan calibration and the measured choice kept
            rounds = 0
        if rounds and compiled is not None:
            first = Calibrated(final, compiled, ctx)
            with self.timed("calibrate"), stage_noted(CALIBRATION, self.memory):
                try:
                    kept = calibrated_step(rounds, manager, lowered, original, first,
                                           lambda g: self.compile(config, g, inputs), staged, self.log, self.dp)
                except CalibrationOutOfMemory as error:  # a budget the memory limit cannot hold: the user's to change
                    raise UsageError(str(error)) from None
                except distributed.RanksDisagreeError as disagreement:
                    raise Failure(str(disagreement)) from None
            final = graph = kept.graph
            compiled, ctx, self.calibration = kept.compiled, kept.ctx, kept.calibration
        if self.args.measure_choice and compiled is not None and not self.plan_cache.hit:
            with self.timed("choose"), stage_noted(CHOICE, self.memory):
                try:
                    kept, self.choice = measured_choice(manager, lowered, original,
                                                        Calibrated(final, compiled, ctx, self.calibration),
                                                        lambda g: self.compile(config, g, inputs),
                                                        rounds, staged, self.log, held_ratio)  # fmt: skip
                except ChoiceFailed as failed:
                    raise Failure(str(failed)) from None
            final = graph = kept.graph
            compiled, ctx, self.calibration = kept.compiled, kept.ctx, kept.calibration
        try:
            report: EquivalenceReport | None = None
            measured: dict[str, Any] = {}
            # On CUDA, a profile made out of core says the original graph does not fit the device;
            # on the CPU the limit bounds planning only, and the original runs.
            profile = ctx.artifacts.get("profile")
            original_fits = device.type != "cuda" or profile is None or "out_of_core" not in profile.meta
            if self.args.check and compiled:
                if not original_fits:
                    raise UsageError("--check runs the original graph whole to compare with, and it was profiled "
                                     "out of core because it does not fit under the limit; check on a card (or "
                                     "--memory-limit) where it fits, or drop --check")  # fmt: skip
                with self.timed("check"), stage_noted(CHECK, self.memory):
                    report = self.check(original, graph, inputs, compiled)
            if compiled:
                with self.timed("measure"), stage_noted(MEASURE, self.memory):
                    measured = self.measure(original, compiled, inputs, device, original_fits)
        except torch.OutOfMemoryError:  # noted with its stage: main() says it in one line
            raise
        except RuntimeError as crash:  # a graph that cannot run: say so in one line, never a traceback
            first = (str(crash).strip().splitlines() or [type(crash).__name__])[0]
            raise Failure(f"running the captured graph failed: {first} (if the model runs eagerly, fake tensors "
                          "predicted other strides than the kernels produce: please report it)") from None
        if error is None and (report is None or report.equivalent) and self.plan_cache.keeps:
            with self.timed("plan cache"):
                self.plan_cache.keep(ctx, calibration=self.calibration.describe() if self.calibration else None,
                                     choice=self.choice, setup_seconds=self.rounded_phases())  # fmt: skip
        if self.lead:
            assert staged is not None
            files = write_outputs(self, staged, config, device, original, final, result, report, error, ctx, measured,
                                  compiled)  # fmt: skip
            self.log(f"wrote {out}/: {describe_files(files)}")
            if self.args.time_passes:
                print(self.phase_report())
        if failure is not None:
            # A pass that crashed (not a PassFailure) is a bug to find: say where its traceback is.
            hint = f"; {DEBUG_HINT}" if failure.crashed and out_of_memory is None and not debug_enabled() else ""
            raise Failure(f"{error}{hint}") from failure
        if report is not None and not report.equivalent:
            raise Failure(report.summary())
        return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """Run mutwo-opt; returns the exit code (tests call this in-process)."""
    # cuBLAS reads this when it starts; deterministic checks (--check on CUDA) need it.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    try:
        args = build_parser().parse_args(argv)
        if args.debug:
            os.environ["MUTWO_DEBUG"] = "1"
        with mutwo_warnings_on_one_line(), older_heap_frozen():  # as optimize() sets up a step
            return MutwoOpt(args).run()
    except SystemExit as exit_:  # --help
        return int(exit_.code or 0)
    except UsageError as error:
        print_debug_traceback(error)
        print(f"mutwo-opt: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except (Failure, VerificationError) as error:
        print_debug_traceback(error)
        print(f"mutwo-opt: failed: {str(error).splitlines()[0]}", file=sys.stderr)
        return EXIT_FAILURE
    except torch.OutOfMemoryError as error:  # the stage it happened in, what was held and the fix: one line
        print_debug_traceback(error)
        print(f"mutwo-opt: failed: {one_line(error)}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print("mutwo-opt: interrupted; files already written are complete, the rest were not written",
              file=sys.stderr)  # fmt: skip
        return 130


if __name__ == "__main__":
    sys.exit(main())
