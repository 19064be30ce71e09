"""``mutwo-opt``: capture a model's training iteration and run a pipeline of passes over it.

    mutwo-opt [-p/--passes LIST] [-o/--out DIR] [--device auto|cpu|cuda] [--batch-size N]
              [--budget B] [--seed N] [--precision P] [--memory-format F] [--check]
              [--profile-from FILE] [--plan-from FILE] [--list-passes] [--load-passes M]
              [--no-verify] [--print-ir-after-all] [--print-ir-after P,...] [--dump-dot]
              [--time-passes] [--fit MEMORY [--fit-margin SHARE] [--fit-max-slowdown FACTOR]]
              [--calibrate-peak ROUNDS] [--measure-choice] [-q/--quiet] [--bucket-cap-mb MB] [--debug]
              [--backend eager|inductor|cudagraphs|inductor-cudagraphs] CONFIG.yaml

Launched by torchrun (``torchrun --nproc-per-node N -m mutwo.tools.mutwo_opt ...``), every rank
captures the data-parallel iteration on its shard of the batch, the gradients are averaged
inside the graph, and rank 0 writes the output folder.

Exit codes: 0 success; 1 a pass or verification failed, or --check found a difference;
2 bad usage, config or pipeline. Every error is one line on stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mutwo.ir import to_fx
from mutwo.ir.graph import Graph
from mutwo.ir.liveness import compute_liveness
from mutwo.ir.memory import simulate
from mutwo.ir.pass_base import Pass, PassContext, write_atomic
from mutwo.ir.pass_manager import Instrumentation, PassManager, PipelineFailure, PipelineResult
from mutwo.ir.printer import print_graph
from mutwo.ir.registry import PassRegistry, RegistryError
from mutwo.ir.swap import swap_nodes
from mutwo.ir.time_model import TimeModel
from mutwo.ir.timeline import TransferModel, graph_timeline
from mutwo.ir.verifier import VerificationError
from mutwo.passes.select import Plan
from mutwo.passes.select_swap import SwapPlan
from mutwo.runtime.capture.optim import UnsupportedOptimizerError
from mutwo.runtime.capture.tracing import CaptureError, debug_enabled
from mutwo.runtime.execution.backends import (
    BACKENDS,
    BackendError,
    CompiledStep,
    CompileError,
    backend_services,
    compile_graph,
)
from mutwo.runtime.execution.cuda_graphs import refuse_uncapturable
from mutwo.runtime.measurement.equivalence import EquivalenceReport, check_graphs
from mutwo.runtime.measurement.iterations import measure_iterations
from mutwo.runtime.measurement.profiler import Profile, fingerprint
from mutwo.runtime.parallel import distributed
from mutwo.runtime.parallel.distributed import DataParallel
from mutwo.runtime.planning.captured import CapturedGraph, capture_graph, pass_context
from mutwo.runtime.planning.fit import FitError
from mutwo.runtime.planning.fit_search import FIT_PIPELINE
from mutwo.runtime.planning.peak_calibration import Calibrated, Calibration, calibrated_step, calibration_refusal
from mutwo.runtime.planning.plan_choice import ChoiceFailed, choice_refusal, measured_choice
from mutwo.tools.cli import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    OutputFolder,
    Parser,
    UsageError,
    did_you_mean,
    print_debug_traceback,
    unreadable,
)
from mutwo.tools.config import DEFAULT_PIPELINE, Config, ConfigError, apply_overrides, load_config
from mutwo.tools.fit import run_fit
from mutwo.tools.reports import memory_timeline, swap_timeline, write_reports
from mutwo.tools.workloads import Workload, build_optimizer, build_workload, target_device, to_device, training_options


class Failure(Exception):
    """A pass, verification or the equivalence check failed: exit code 1."""


def build_parser() -> argparse.ArgumentParser:
    # The description is the docstring's first line, without its reStructuredText markup.
    parser = Parser(prog="mutwo-opt", description=__doc__.split("\n\n")[0].replace("``", ""))
    parser.add_argument("config", nargs="?", help="YAML config describing the model (see the README)")
    parser.add_argument("-p", "--passes", help="pipeline, e.g. 'stats,dce' (default: the config's 'passes', else "
                        f"{DEFAULT_PIPELINE})")
    parser.add_argument("-o", "--out", help="output folder (default: mutwo-out/<config name>)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], help="where to run (default: the config's)")
    parser.add_argument("--batch-size", type=int, help="override the config's batch size")
    parser.add_argument("--budget", help="memory budget: a fraction of the unoptimized peak (0.5), bytes (6GiB), or "
                        "'min' (the lowest peak recomputation reaches); default: the config's 'budget', else the "
                        "GPU's memory (on CPU nothing needs recomputing)")
    parser.add_argument("--seed", type=int, help="override the config's seed")
    parser.add_argument("--backend", choices=BACKENDS,
                        help="what runs the final graph (default: the config's, else eager); see docs/backends.md")
    parser.add_argument("--precision", help="override the config's precision: fp32, bf16-autocast, fp16-autocast")
    parser.add_argument("--memory-format", help="override the config's memory_format: contiguous, or channels_last "
                        "(the model's and the batch's 4-D tensors NHWC, as cuDNN's fastest convolutions want)")
    parser.add_argument("--check", action="store_true",
                        help="run the original and final graphs for 3 iterations and compare every number")
    parser.add_argument("--profile-from", metavar="FILE",
                        help="reuse a profile.json written by the profile pass for this same graph")
    parser.add_argument("--plan-from", metavar="FILE",
                        help="reuse a plan.json (select) or swap_plan.json (select-swap) written for this same graph")
    parser.add_argument("--fit", metavar="MEMORY", help="find the largest batch size whose optimized iteration fits "
                        "in MEMORY (16GiB), starting from the config's; writes fit.json (see docs/fit.md)")
    parser.add_argument("--fit-margin", type=float, metavar="SHARE",
                        help="with --fit: the share of MEMORY the plans keep free for what the simulator does not "
                        "see (default 0.1)")
    parser.add_argument("--fit-max-slowdown", type=float, metavar="FACTOR",
                        help="with --fit: only batches whose plan predicts at most FACTOR times the time of the step "
                        "without recomputation (like 1.3); the largest batch is often not the fastest training")
    parser.add_argument("--calibrate-peak", type=int, metavar="ROUNDS",
                        help="with a compiled --backend: plan again, up to ROUNDS times, until the compiled step's "
                        "measured peak is within 3%% of the budget (each round compiles again; docs/backends.md)")
    parser.add_argument("--measure-choice", action="store_true",
                        help="with a compiled --backend and -p swap: when select-swap's plan swaps, compile the "
                        "recompute-only plan at the same budget too, measure both and keep the faster (both plans "
                        "are priced at eager times; docs/swap.md)")
    parser.add_argument("--list-passes", action="store_true", help="list every registered pass and exit")
    parser.add_argument("--load-passes", action="append", default=[], metavar="MODULE_OR_FILE",
                        help="register the passes defined in a module or .py file (repeatable)")
    parser.add_argument("--no-verify", action="store_true", help="do not verify the IR after every pass")
    parser.add_argument("--print-ir-after-all", action="store_true", help="print the IR after every pass")
    parser.add_argument("--print-ir-after", default="", metavar="P,...",
                        help="print the IR after these passes of the pipeline (an alias such as rewrite: after its "
                        "last pass)")
    parser.add_argument("--dump-dot", action="store_true", help="write NN-<pass>-before.dot and -after.dot")
    parser.add_argument("--time-passes", action="store_true",
                        help="print the time each pass took, then the whole run's: capture, passes, compile, check "
                        "(with --fit, the search's: capture, profile, plan, measure)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress messages")
    parser.add_argument("--bucket-cap-mb", type=float, metavar="MB",
                        help="under torchrun: gradient bucket size in MiB (default: DDP's, 1 MiB first then 25)")
    parser.add_argument("--debug", action="store_true",
                        help="print the traceback behind an error (like MUTWO_DEBUG=1)")
    return parser


class MutwoOpt:
    """The steps of one mutwo-opt run, in order; :meth:`run` strings them together."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.registry = PassRegistry()
        self.started = time.perf_counter()
        self.wall_started = time.time() - 1  # file times have coarse resolution on some filesystems
        self.calibration: Calibration[Any] | None = None  #: with --calibrate-peak, its rounds
        self.choice: dict[str, Any] | None = None  #: with --measure-choice, both plans measured and the kept one
        self.dp: DataParallel | None = None  #: under torchrun: the ranks averaging the gradients
        self.joined = False  #: whether this run joined the process group (and leaves it at the end)
        self.gradient_buckets: list[list[str]] = []  #: data parallel: the all-reduce buckets, in issue order
        self.output: OutputFolder | None = None  #: the output folder, once this run has made it
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
        if not distributed.launched_by_torchrun():
            if self.args.bucket_cap_mb is not None:
                raise UsageError("--bucket-cap-mb applies to data-parallel runs; launch with torchrun "
                                 "--nproc-per-node N -m mutwo.tools.mutwo_opt ...")  # fmt: skip
            return device
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
        self.check_reused_files()  # a missing file, or one of another kind, is named before what a pipeline needs
        available = {reused.artifact for reused, _, _ in self.reused_files}
        try:
            if available:  # what is wrong with a given file first: the requirements it does not meet follow
                unchecked = self.registry.build_pipeline(config.passes, {r.artifact for r in REUSED})
                self.refuse_remade_artifacts(unchecked)
                self.refuse_unread_plan(unchecked)
            passes = self.registry.build_pipeline(config.passes, available)
        except RegistryError as error:
            raise UsageError(str(error)) from None
        instrumentation = Instrumentation(
            verify=not self.args.no_verify, print_ir_after_all=self.args.print_ir_after_all,
            print_ir_after=self.print_ir_after(passes), dump_dot=self.args.dump_dot,
            time_passes=self.args.time_passes,
        )  # fmt: skip
        return PassManager(passes, instrumentation)

    def print_ir_after(self, passes: list[Pass]) -> frozenset[str]:
        """The passes ``--print-ir-after`` names, an alias standing for the last of its passes the
        pipeline runs (``rewrite``: the IR once rewritten); each must be in the pipeline, or nothing
        would be printed for it."""
        names: set[str] = set()
        running = [p.name for p in passes]
        for name in (n.strip() for n in self.args.print_ir_after.split(",")):
            if not name:
                continue
            members = self.registry.aliases.get(name, (name,))
            # An alias stands for the last of its passes this pipeline runs (-p optimizer-in-backward
            # runs only the first of the alias optimizer's two).
            target = next((m for m in reversed(members) if m in running), members[-1])
            if target not in self.registry.names():
                hint = did_you_mean(name, self.registry.names() + sorted(self.registry.aliases))
                raise UsageError(f"--print-ir-after names unknown pass '{name}'; "
                                 + (f"{hint} " if hint else "") + "see mutwo-opt --list-passes")  # fmt: skip
            if target not in running:
                raise UsageError(f"--print-ir-after names '{name}', which this pipeline does not run "
                                 f"({','.join(running)}); name one of its passes")  # fmt: skip
            names.add(target)
        return frozenset(names)

    def refuse_unread_plan(self, passes: list[Pass]) -> None:
        """Refuse ``--plan-from`` when no pass of the pipeline reads its plan: the file would go unused."""
        for reused, _, written in self.reused_files:
            if reused.option == "--plan-from" and not any(reused.artifact in type(p).requires for p in passes):
                pipeline = ",".join(p.name for p in passes)
                what = reused.filename if written == reused.filename else "plan file"
                raise UsageError(f"--plan-from gives a {what}, but no pass of this pipeline ({pipeline}) "
                                 f"reads it, so the file would go unused; {reused.example.removeprefix('-p ')} "
                                 f"applies it ({reused.example} --plan-from FILE)")  # fmt: skip

    @functools.cached_property
    def reused_files(self) -> list[tuple[ReusedFile, Path, str | None]]:
        """The files ``--profile-from`` and ``--plan-from`` give, each with what it stands for and
        which file it was recognised as (:func:`artifact_file`, read once: a profile.json can be
        megabytes): a ``--plan-from`` file is select's plan or, by its fields, select-swap's."""
        given = []
        for option in ("--profile-from", "--plan-from"):
            text = getattr(self.args, option.removeprefix("--").replace("-", "_"))
            if text:
                kinds = [r for r in REUSED if r.option == option]
                written = artifact_file(Path(text))
                given.append((next((r for r in kinds if r.filename == written), kinds[0]), Path(text), written))
        return given

    def refuse_remade_artifacts(self, passes: list[Pass]) -> None:
        """Refuse ``--profile-from``/``--plan-from`` beside a pass that makes the same artifact again:
        the pass would silently replace what the file gave, and the file would go unused."""
        for reused, _, _ in self.reused_files:
            maker = next((p.name for p in passes if reused.artifact in type(p).provides), None)
            if maker is not None:
                raise UsageError(f"{reused.option} gives the {reused.artifact}, but the pipeline's '{maker}' pass "
                                 f"would make a new one and leave the file unused; drop {maker} from --passes "
                                 f"({reused.example} {reused.option} FILE)")  # fmt: skip

    def check_reused_files(self) -> None:
        """``--profile-from`` and ``--plan-from`` name readable files of their kind: checked before the
        capture, which can take minutes (whether a file belongs to the graph is checked after it)."""
        for reused, path, written in self.reused_files:
            accepted = " or ".join(r.filename for r in REUSED if r.option == reused.option)
            problem = unreadable(path, f"{reused.option}:")
            if problem is not None:
                raise UsageError(f"{problem}; give the {accepted} an earlier run wrote")
            if written is not None and written != reused.filename:
                maker = next(r.maker for r in REUSED if r.filename == written)
                raise UsageError(f"{reused.option}: {path} is a {written} written by the {maker} pass, not a "
                                 f"{accepted}; give the {accepted} an earlier run wrote")  # fmt: skip

    def prepare_out_dir(self, config: Config) -> Path:
        """Check, without creating anything yet, that the output folder can be written."""
        out = Path(self.args.out) if self.args.out else Path("mutwo-out") / config.name
        if not self.lead:  # only rank 0 writes
            return out
        if out.exists() and not out.is_dir():
            raise UsageError(f"output folder {str(out)!r} is a file, not a folder; choose another with -o DIR")
        existing = out
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
            reason = f"it is under the file {str(existing)!r}" if existing.exists() and not existing.is_dir() \
                else "permission denied"  # fmt: skip
            raise UsageError(f"output folder {str(out)!r} is not writable ({reason}); choose another with -o DIR")
        return out

    def capture(self, config: Config, device: torch.device) -> CapturedGraph:
        self.log(f"building {config.model.source} model '{config.model.name}' (batch {config.batch_size}, {device})")
        started = time.perf_counter()  # --fit captures once per batch size: say what each one took
        try:
            workload, batch = self.build(config)
            model = workload.model.to(device)
            batch = to_device(batch, device)
            optimizer = build_optimizer(config, model)
            if self.dp is not None:
                distributed.broadcast_model(model, self.dp)
            self.log("capturing one training iteration (forward, backward, optimizer step)")
            lowered = capture_graph(model, optimizer, batch, workload.loss_fn, training_options(config, device),
                                    data_parallel=self.dp)
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

    def load_artifact(self, graph: Graph, reused: ReusedFile, path: Path) -> Any:
        """A profile.json, plan.json or swap_plan.json of an earlier run, refused unless it belongs to this graph."""
        option = reused.option
        try:
            artifact = reused.cls.from_json(json.loads(path.read_text(encoding="utf-8")))
        except OSError as error:  # checked before the capture; gone or unreadable since
            raise UsageError(f"{option}: {str(path)!r} cannot be read ({error.strerror})") from None
        except (ValueError, KeyError, TypeError) as error:
            raise UsageError(f"{option}: {path} is not a {reused.filename} written by the {reused.maker} pass "
                             f"({type(error).__name__}: {error})") from None  # fmt: skip
        if artifact.fingerprint != fingerprint(graph):
            raise UsageError(f"{option}: {path} belongs to a different graph (fingerprint {artifact.fingerprint}, "
                             f"this graph {fingerprint(graph)}); run the {reused.maker} pass again for this model, "
                             "batch size and device")  # fmt: skip
        return artifact

    def refuse_backend(self, config: Config, device: torch.device, manager: PassManager) -> None:
        """Backend choices that cannot work here, refused before anything is captured."""
        fused = next((p.name for p in manager.passes if getattr(p, "fused", False)), None)
        if fused is not None and not backend_services(config.backend)["fused_recompute"]:
            raise UsageError(f"{fused}{{fused=true}} prices recomputes as Inductor fuses them, but --backend is "
                             f"{config.backend}: use --backend inductor, or drop fused=true")  # fmt: skip
        if config.backend.endswith("cudagraphs") and device.type != "cuda":
            raise UsageError(f"--backend {config.backend} needs a CUDA device, this run is on {device}; use --backend "
                             "eager or inductor")  # fmt: skip
        if self.dp is not None and config.backend != "eager":
            raise UsageError(f"--backend {config.backend} does not run data-parallel steps yet; use --backend eager")

    def compile(self, config: Config, final: Graph, inputs: list[Any]) -> CompiledStep:
        """The final graph made runnable by the config's backend (compiled here, timed as planning)."""
        if config.backend != "eager":
            self.log(f"compiling the final graph with {config.backend}")
        try:
            compiled = compile_graph(final, inputs, config.backend)
        except CompileError as error:
            raise Failure(str(error)) from None
        except BackendError as error:
            raise UsageError(str(error)) from None
        if config.backend != "eager":
            self.log(f"compiled in {compiled.compile_seconds:.1f} s"
                     + (" (from Inductor's cache)" if compiled.cache_hit else ""))  # fmt: skip
        return compiled

    def measure(self, original: Graph, final: CompiledStep, inputs: list[Any], device: torch.device) -> dict[str, Any]:
        """Measured peaks and iteration times of the captured graph and the final step (run by its
        backend); on CUDA only (the simulator covers CPU)."""
        if device.type != "cuda":
            return {}
        self.log("measuring whole iterations of the original graph and the final step")
        before = measure_iterations(to_fx(original), inputs)
        after = measure_iterations(final.run, inputs)
        return {"measured_peak_bytes_before": before.peak_bytes, "measured_peak_bytes_after": after.peak_bytes,
                "iteration_seconds_before": before.seconds, "iteration_seconds_after": after.seconds}

    def check(self, original: Graph, final: Graph, inputs: list[Any], compiled: CompiledStep) -> EquivalenceReport:
        self.log(f"checking the final step ({compiled.backend}) against the original graph for 3 iterations")
        report = check_graphs(original, final, inputs, candidate_run=compiled.checked_run,
                              tolerance=compiled.tolerance)  # fmt: skip
        if self.dp is not None:
            report = distributed.equivalent_everywhere(report, self.dp)
        self.log(report.summary())
        return report

    def write_outputs(self, out: Path, config: Config, device: torch.device, original: Graph, final: Graph,
                      result: PipelineResult | None, report: EquivalenceReport | None, error: str | None,
                      ctx: PassContext, measured: dict[str, Any],
                      compiled: CompiledStep | None) -> list[str]:  # fmt: skip
        """Write the output folder; returns the names of the files this run wrote. After a failed
        pipeline there is no final graph: summary.json records the error (and the plan that
        missed its budget), beside input.ir.txt and what the passes wrote before the failure."""
        write_atomic(out / "input.ir.txt", print_graph(original))
        profile = ctx.artifacts.get("profile")
        workspace = profile.workspace() if profile is not None else None
        before = simulate(original, workspace=workspace)
        title = f"{config.model.name}, batch {config.batch_size}, {device}"
        outcome: dict[str, Any]
        if error is None:
            outcome, reports = self.write_final(out, original, final, before, ctx, title)
        else:
            reports = []
            unmet = [plan.to_json() for plan in (ctx.artifacts.get(key) for key in ("plan", "swap-plan"))
                     if plan is not None and not plan.met]  # fmt: skip
            outcome = {"unmet_plan": unmet[0] if unmet else None}
        summary = {
            "model": config.model.name,
            "source": config.model.source,
            "config": str(config.path),
            "batch_size": config.batch_size,
            "device": str(device),
            # What else decides the numbers, so that a summary says how to run it again.
            "seed": config.seed,
            "precision": config.precision,
            "memory_format": config.memory_format,
            "budget": planned_budget(ctx, config),
            "torch_version": torch.__version__,
            "pipeline": [r.name for r in result.records] if result else [],
            "nodes_before": _counts(original),
            "nodes_after": None,
            "pass_seconds": result.timings() if result else {},
            "total_seconds": round(time.perf_counter() - self.started, 3),
            "phase_seconds": self.rounded_phases(),
            "peak_bytes_before": before.peak_bytes,
            "peak_phase_before": before.peak_phase,
            "peak_breakdown_before": before.breakdown,
            "peak_bytes_after": None,
            "peak_node_after": None,
            "peak_phase_after": None,
            "peak_breakdown_after": None,
            "persistent_bytes": before.persistent_bytes,
            "measured_peak_bytes_before": measured.get("measured_peak_bytes_before"),
            "measured_peak_bytes_after": measured.get("measured_peak_bytes_after"),
            "iteration_seconds_before": measured.get("iteration_seconds_before"),
            "iteration_seconds_after": measured.get("iteration_seconds_after"),
            "reports": reports,
            "recomputed": None,
            "plan_fingerprint": None,
            "swapped": None,
            "swapped_bytes": None,
            "cloned_nodes": None,
            "equivalent": None if report is None else report.equivalent,
            "error": error,
            **outcome,
            "data_parallel": self.describe_data_parallel(config),
            # The simulator models the eager executor: one aten kernel per node, in the plan's order,
            # which the compiled backends keep (docs/backends.md); their peak is the measured one.
            "simulated_backend": "eager",
            **({"calibration": self.calibration.describe()} if self.calibration is not None else {}),
            **({"measured_choice": self.choice} if self.choice is not None else {}),
            **(compiled.describe() if compiled is not None else {"backend": config.backend}),
        }
        # The folder is not emptied between runs: list what this run wrote.
        summary["files"] = sorted({p.name for p in out.iterdir() if p.is_file() and not p.name.startswith(".")
                                   and p.stat().st_mtime >= self.wall_started} | {"summary.json"})  # fmt: skip
        write_atomic(out / "summary.json", json.dumps(summary, indent=2) + "\n")
        return summary["files"]

    def write_final(self, out: Path, original: Graph, final: Graph, before: Any, ctx: PassContext,
                    title: str) -> tuple[dict[str, Any], list[str]]:  # fmt: skip
        """The final graph's files and reports; its entries of summary.json and the reports' names."""
        profile = ctx.artifacts.get("profile")
        after = simulate(final, workspace=profile.workspace() if profile is not None else None)
        final_liveness = compute_liveness(final)
        reports = write_reports(out, final, after, final_liveness, profile, title)
        if final is not original:
            memory_timeline(out / "memory_timeline_input.png", original, before, profile, f"{title} (input)")
            reports.append("memory_timeline_input.png")
        swaps = swap_nodes(final)
        if swaps and profile is not None and "transfer" in ctx.artifacts:
            swap_plan = ctx.artifacts.get("swap-plan")  # its copies priced as the plan priced them (contention)
            transfer = ctx.artifacts["transfer"] if swap_plan is None else TransferModel.from_json(swap_plan.transfer)
            timeline = graph_timeline(final, TimeModel.of(original, profile), transfer)
            swap_timeline(out / "swap_timeline.png", final, timeline, after, f"{title}: compute and copies")
            reports.append("swap_timeline.png")
        # Recomputed: activations of the input whose backward readers now read a clone instead
        # (swapped ones read the copy brought back from host memory).
        swapped = {offload.args[0].tensor.storage for offload, _, _ in swaps}
        recomputed = {r.key for r in compute_liveness(original).activations()} - {
            r.key for r in final_liveness.activations()} - swapped  # fmt: skip
        write_atomic(out / "final.ir.txt", print_graph(final))
        write_atomic(out / "final_graph.py", to_fx(final).code)
        return {
            "nodes_after": _counts(final),
            "peak_bytes_after": after.peak_bytes,
            "peak_node_after": after.peak_node,
            "peak_phase_after": after.peak_phase,
            "peak_breakdown_after": after.breakdown,
            "persistent_bytes": after.persistent_bytes,
            "recomputed": len(recomputed),
            "plan_fingerprint": plan_fingerprint(recomputed, swapped),
            "swapped": len(swapped),
            "swapped_bytes": sum(offload.tensors[0].storage_bytes for offload, _, _ in swaps),
            "cloned_nodes": sum(1 for n in final if n.origin is not None),
        }, reports

    def describe_data_parallel(self, config: Config) -> dict[str, Any] | None:
        if self.dp is None:
            return None
        return {"world_size": self.dp.world_size, "backend": torch.distributed.get_backend(self.dp.group),
                "global_batch_size": config.batch_size * self.dp.world_size,
                "bucket_limits_bytes": list(self.dp.bucket_limits), "sync_buffers": self.dp.sync_buffers,
                "buckets": self.gradient_buckets}  # fmt: skip

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
        if self.args.fit is not None:
            given = (("-p", self.args.passes), ("--plan-from", self.args.plan_from),
                     ("--profile-from", self.args.profile_from), ("--calibrate-peak", self.args.calibrate_peak),
                     ("--measure-choice", self.args.measure_choice))  # fmt: skip
            unused = [option for option, value in given if value]
            if unused:
                raise UsageError(f"--fit profiles once and plans every batch size with its own pipeline "
                                 f"({FIT_PIPELINE}), so {unused[0]} would go unused; drop it, and use it on the "
                                 "batch size --fit finds")  # fmt: skip
        manager = self.build_pipeline(config)
        out = self.prepare_out_dir(config)
        fit_only = (("--fit-margin", self.args.fit_margin), ("--fit-max-slowdown", self.args.fit_max_slowdown))
        for option, value in fit_only:
            if value is not None and self.args.fit is None:
                raise UsageError(f"{option} applies to --fit; add --fit MEMORY (like --fit 16GiB)")
        if self.args.fit is not None:
            if config.backend != "eager":  # the search measures eager runs: a compiled step's peak differs
                raise UsageError(f"--fit searches with the eager backend, not {config.backend}; run --fit without "
                                 "--backend, then the batch size it finds with --backend")  # fmt: skip
            try:
                return run_fit(self, config, device, out)
            except FitError as error:
                raise Failure(str(error)) from None
        self.refuse_backend(config, device, manager)
        refusal = calibration_refusal(self.args.calibrate_peak, config.backend, manager.passes, "--calibrate-peak",
                                      "--budget")  # fmt: skip
        refusal = refusal or choice_refusal(self.args.measure_choice, config.backend, manager.passes,
                                            "--measure-choice", config.budget)  # fmt: skip
        if refusal is not None:
            raise UsageError(refusal)
        with self.timed("capture"):
            lowered = self.capture(config, device)
        if config.backend.endswith("cudagraphs"):  # before planning: nothing is written for a step it refuses
            try:
                refuse_uncapturable(to_fx(lowered.graph), lowered.inputs, [p.label for p in lowered.graph.placeholders])
            except BackendError as error:
                raise UsageError(str(error)) from None
        self.gradient_buckets = lowered.binding.gradient_buckets
        graph, inputs = lowered.graph, lowered.inputs
        reused_artifacts: dict[str, Any] = {}
        original = graph.copy()
        captured_version = graph.version
        for reused, path, _ in self.reused_files:  # before anything is written: a refused file leaves nothing
            reused_artifacts[reused.artifact] = self.load_artifact(graph, reused, path)
        # Everything is written into a stage, moved into `out` when the run ends (tools/cli.OutputFolder).
        staged = None
        if self.lead:
            self.output = OutputFolder.make(out)
            staged = self.output.staging
        ctx = pass_context(lowered, config.budget, out_dir=staged, log=self.log)
        ctx.services.update(backend_services(config.backend), measure_choice=self.args.measure_choice)
        ctx.artifacts.update(reused_artifacts)
        result: PipelineResult | None = None
        failure: PipelineFailure | None = None
        try:
            with self.timed("passes"):
                result = manager.run(graph, ctx)
        except PipelineFailure as caught:
            failure = caught
        error = None if failure is None else str(failure)
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
        if self.args.calibrate_peak and compiled is not None:
            first = Calibrated(final, compiled, ctx)
            with self.timed("calibrate"):
                kept = calibrated_step(self.args.calibrate_peak, manager, lowered, original, first,
                                       lambda g: self.compile(config, g, inputs), staged, self.log)
            final = graph = kept.graph
            compiled, ctx, self.calibration = kept.compiled, kept.ctx, kept.calibration
        if self.args.measure_choice and compiled is not None:
            with self.timed("choose"):
                try:
                    kept, self.choice = measured_choice(manager, lowered, original,
                                                        Calibrated(final, compiled, ctx, self.calibration),
                                                        lambda g: self.compile(config, g, inputs),
                                                        self.args.calibrate_peak, staged, self.log)  # fmt: skip
                except ChoiceFailed as failed:
                    raise Failure(str(failed)) from None
            final = graph = kept.graph
            compiled, ctx, self.calibration = kept.compiled, kept.ctx, kept.calibration
        try:
            report: EquivalenceReport | None = None
            measured: dict[str, Any] = {}
            if self.args.check and compiled:
                with self.timed("check"):
                    report = self.check(original, graph, inputs, compiled)
            if compiled:
                with self.timed("measure"):
                    measured = self.measure(original, compiled, inputs, device)
        except RuntimeError as crash:  # a graph that cannot run: say so in one line, never a traceback
            first = (str(crash).strip().splitlines() or [type(crash).__name__])[0]
            raise Failure(f"running the captured graph failed: {first} (if the model runs eagerly, fake tensors "
                          "predicted other strides than the kernels produce: please report it)") from None
        if self.lead:
            assert staged is not None
            files = self.write_outputs(staged, config, device, original, final, result, report, error, ctx, measured,
                                       compiled)  # fmt: skip
            self.log(f"wrote {out}/: {describe_files(files)}")
            if self.args.time_passes:
                print(self.phase_report())
        if failure is not None:
            # A pass that crashed (not a PassFailure) is a bug to find: say where its traceback is.
            hint = f"; {DEBUG_HINT}" if failure.crashed and not debug_enabled() else ""
            raise Failure(f"{error}{hint}") from failure
        if report is not None and not report.equivalent:
            raise Failure(report.summary())
        return EXIT_OK


@dataclass(frozen=True)
class ReusedFile:
    """A file of an earlier run that an option gives in place of a pass's artifact."""

    option: str  #: --profile-from or --plan-from
    artifact: str  #: the artifact it stands for (ctx.artifacts' key)
    filename: str  #: as the pass writes it
    maker: str  #: the pass that writes it
    cls: Any  #: what reads it (from_json)
    example: str  #: a pipeline that uses it without making it again
    fields: tuple[str, ...]  #: keys its JSON has and the other files' lack, to tell them apart


REUSED = (
    ReusedFile("--profile-from", "profile", "profile.json", "profile", Profile, "-p select,rewrite",
               ("nodes", "runs", "iteration")),
    ReusedFile("--plan-from", "plan", "plan.json", "select", Plan, "-p rewrite", ("clones", "entries")),
    ReusedFile("--plan-from", "swap-plan", "swap_plan.json", "select-swap", SwapPlan, "-p insert-swap",
               ("transfer", "entries")),
)  # fmt: skip


def planned_budget(ctx: PassContext, config: Config) -> str | None:
    """The budget the run's plan was made for (a reused plan's, a pass option's), else the config's."""
    plan = ctx.artifacts.get("plan") or ctx.artifacts.get("swap-plan")
    if plan is not None:
        return str(plan.budget)
    return None if config.budget is None else str(config.budget)


def artifact_file(path: Path) -> str | None:
    """Which of the files mutwo-opt reuses ``path`` holds, by its fields (``swap_plan.json``); None
    when it cannot be read or is none of them (loading it then says what is wrong)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    return next((r.filename for r in REUSED if all(key in data for key in r.fields)), None)


def plan_fingerprint(recomputed: set[Any], swapped: set[Any]) -> str:
    """Which activations of the captured graph a run recomputes and which it swaps, hashed: two runs
    of one model and pipeline with the same fingerprint recompute and swap the same activations
    (how the clones are built and what other passes did is not in it; every plan that recomputes
    and swaps nothing has the same one). Plans made from two profiles may differ (per-node times
    move between profiles, docs/benchmarks.md, "Why one budget gives several plans");
    ``--profile-from`` reuses one profile and so one plan."""
    text = ";".join([",".join(sorted(map(str, recomputed))), ",".join(sorted(map(str, swapped)))])
    return hashlib.sha1(text.encode()).hexdigest()[:12]


#: The files named first when a run says what it wrote (the rest are counted).
MAIN_FILES = ("summary.json", "final.ir.txt", "final_graph.py", "plan.json", "swap_plan.json", "profile.json")
#: What a failure inside a pass adds to its one line: where the traceback is.
DEBUG_HINT = "run again with --debug for the traceback"


def describe_files(files: list[str]) -> str:
    """``12 files: summary.json, final.ir.txt, final_graph.py, plan.json and 8 more (listed in summary.json)``."""
    main_files = [name for name in MAIN_FILES if name in files]
    rest = len(files) - len(main_files)
    if len(files) <= 6:
        return f"{len(files)} files: " + ", ".join(main_files + [f for f in files if f not in main_files])
    return f"{len(files)} files: {', '.join(main_files)} and {rest} more (listed in summary.json)"


def _counts(graph: Graph) -> dict[str, Any]:
    return {"total": len(graph), "by_phase": dict(sorted(Counter(n.phase.value for n in graph).items())),
            "by_kind": dict(sorted(Counter(n.kind.value for n in graph).items()))}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Run mutwo-opt; returns the exit code (tests call this in-process)."""
    # cuBLAS reads this when it starts; deterministic checks (--check on CUDA) need it.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    try:
        args = build_parser().parse_args(argv)
        if args.debug:
            os.environ["MUTWO_DEBUG"] = "1"
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
    except KeyboardInterrupt:
        print("mutwo-opt: interrupted; files already written are complete, the rest were not written",
              file=sys.stderr)  # fmt: skip
        return 130


if __name__ == "__main__":
    sys.exit(main())
