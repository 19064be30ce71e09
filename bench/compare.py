"""Side-by-side benchmark on one GPU: eager, per-block checkpointing, torch.compile with an
activation-memory budget, mutwo without recompute and mutwo at budgets (the benchmark issue).

Every variant runs in a fresh process and is measured as a plain training loop measures itself
(``tools.experiment_measure.measure_step``): 3 warm-up iterations, then 10 measured ones; time =
their median CUDA-event time; ``held_bytes`` = ``torch.cuda.max_memory_reserved`` over the
measured iterations (what the process holds: the allocator's cache and CUDA-graph pools
included, what a card runs out at) and ``peak_bytes`` = ``torch.cuda.max_memory_allocated``
beside it. Setup is ``first_step_seconds`` (eager, checkpointing, ``torch.compile``: its compile)
or ``planning_seconds`` (mutwo: capture, passes, compile, calibration). mutwo's budgets may name
the memory another variant held, so that iteration times are compared at equal held memory:

- ``mutwo-0.5``: half of mutwo's own simulated peak without recompute (any ``mutwo-opt --budget``);
- ``mutwo-eager0.5``: half of what eager held;
- ``mutwo-checkpoint``: what per-block checkpointing held;
- ``mutwo-compile0.5``: what ``compile-0.5`` (torch.compile, activation budget 0.5) held.

Use ``--calibrate-peak`` with a compiled backend for such rows: calibration re-plans until the
step holds at most its budget (a plan counts allocated bytes; the process holds more).
``--memory-limit 16GiB`` caps every variant's process (``set_per_process_memory_fraction``, as a
card of that size would) before anything is built: planning, compile and the measured steps.
Every variant's process gets the same CUDA allocator, so that held memory is compared at equal
allocators: ``--allocator expandable`` (the default; mutwo turns it on in its own processes,
docs/backends.md) sets ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` for all of them,
``--allocator default`` ``expandable_segments:False``; a ``PYTORCH_CUDA_ALLOC_CONF`` already set is
used as it is. The JSON's ``allocator`` says which, and each CUDA row its process's settings.

``compile@<mode>-<budget>`` is ``torch.compile(mode=<mode>)`` with that activation budget, for
example ``compile@reduce-overhead-0.5`` (CUDA graphs, the row beside ``mutwo@inductor-cudagraphs``).

``mutwo+opt-<budget>`` is the same with the optimizer passes (optimizer-in-backward and
foreach-buckets) before select; ``mutwo+opt-none`` runs them without recompute.
``mutwo@<backend>-<budget>`` runs the planned graph with a backend (docs/backends.md):
``mutwo@inductor-compile0.5``, ``mutwo@cudagraphs-none``, ``mutwo@inductor-cudagraphs-none``;
its compile time is part of ``planning_seconds`` (and ``compile_seconds``).

``--reference FILE`` reads the rows of an earlier run's JSON (same model and batch) so that a
budget can name a peak measured there without measuring it again; they are kept in the output
under ``reference_runs``.

``mutwo-swap-<budget>`` plans with select-swap and insert-swap instead (keep, recompute or swap
each activation to pinned host memory, μ-TWO); ``mutwo-<budget>`` stays recompute only, with the
default pipeline's passes after the optimizer's: chunk (a language-model head sliced where the
budget needs it or select's plan is predicted faster so), select, rewrite. Rows of
mutwo variants record the plan's predicted peak (``planned_peak_bytes``) and iteration time
(``predicted_iteration_ms``) beside the measured ones. ``mutwo-none`` profiles the graph once;
the mutwo variants after it (same model and batch) reuse that profile, an unbudgeted one too when
it captures the same graph (``mutwo@inductor-cudagraphs-none`` after ``mutwo@cudagraphs-none``:
the unplanned step under another backend, planned beside the others with ``--parallel-planning``).

A plan's predicted time prices the profile's eager kernels, and a step compiled with Inductor runs
faster than its profile. Where the run measured the unplanned step under a row's compiled backend
(``mutwo@<backend>-none``, before the row), the row also records ``predicted_anchored_ms``: its
prediction scaled by what compiling did to the unplanned step, measured unplanned × predicted /
profiled (:func:`anchored_prediction`; so are a measured choice's candidates). On the H100 the
eager-priced predictions of ResNet-152's compiled plans were 14-17% over the measured times, the
anchored ones 2.6-5.5% (docs/benchmarks.md).

The swap study of one model (the swap issue), in one command, for example:

    python bench/compare.py --out $OUT/swap_resnet152_b128.json --models resnet152:128 --variants swap-study

On a CPU the same study is a dry run of the planning and of one iteration of every planned graph
(peaks are measured on CUDA only, so budgets naming them plan for a stand-in instead; ResNet-152
b2 takes about 6 minutes, BERT-base s512 b2 about 7, on two busy cores):

    python bench/compare.py --out /tmp/dry.json --models resnet152:2 --variants swap-study \
        --stand-in-budget 0.9 --warmup 0 --iterations 1

``--sample-stacks DIR`` samples each mutwo row's planning (capture, passes, compiles, calibration;
until its measured iterations begin) with ``bench/stack_sampler.py`` into
``DIR/<config>_b<batch>_<variant>.folded`` (``@`` written ``-at-``): where a long setup spends its time.

``--parallel-planning N`` plans and compiles up to N mutwo variants at once, each in its own
process, and then measures them one at a time, in order, each alone on the device (a worker waits
after planning until the others have planned and its turn has come). A whole-iteration Inductor
compile of ResNet-152 takes about 6.5 minutes of one core's work, so four compiled rows take 26
minutes one after the other. Their plans must not measure anything while others run: they reuse
the profile and copy model of a ``mutwo-none`` row run before them (required). ``--calibrate-peak``
measures peaks while planning, beside the other processes (the allocator counts each process's own
memory, so their peaks do not mix; each recording is released once measured), one process at a
time (a lock file: four BERT-base processes measuring at once ran out of the H100's memory); no
time is measured before a row's turn, ``--measure-choice``'s included. Rows planned so record
``planned_in_parallel`` and when they had planned and were measured (``planned_at``,
``measured_from``, ``measured_until``, seconds since the epoch). A CUDA-graph backend captures
another optimizer (capturable), so its rows reuse the profile of ``mutwo@cudagraphs-none``.

``--calibrate-peak N`` makes the rows of a compiled backend (``mutwo@inductor...``,
``mutwo@cudagraphs...``) re-plan up to N times until the compiled step's measured peak is within 3%
of the budget (Inductor's fusion frees buffers the plan counts;
:mod:`mutwo.runtime.planning.peak_calibration`); the rows record every round under ``calibration``.

``--measure-choice`` makes the ``mutwo-swap@<compiled backend>`` rows measure select-swap's plan
against the recompute-only plan at the same budget (both compiled, and calibrated with
``--calibrate-peak``) and keep the faster: both are priced at eager times, which a compiled step
does not keep (``tools.experiment_planning.PlanChoice``). The row's ``measured_choice`` has both.

``--trace`` (GPU only) then profiles 3 more iterations of each variant and records, stream by
stream, where the time went (compute idle, compute overlapped with copies, copy rates, kernels
slowed while copies run: :mod:`mutwo.tools.stream_trace`), with the Chrome traces beside the JSON.

    python bench/compare.py --out bench/results/compare_h100.json --models resnet152:128,bert:64

A model is one of the names below or the path of a YAML config (``--models my.yaml:4``): a tiny
config runs the whole comparison on a CPU in a minute (times and peaks are only measured on CUDA).

``--precision bf16-autocast`` runs every variant under bf16 autocast (eager and checkpointing in
``torch.autocast``, mutwo with the config key ``precision``), for the bf16 rows:

    python bench/compare.py --precision bf16-autocast --variants eager,checkpoint,mutwo-none,mutwo-checkpoint \
        --models resnet152:128,bert:64 --out bench/results/compare_bf16_h100.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # stack_sampler, when this file is loaded as a module

from stack_sampler import StackSampler  # noqa: E402

from mutwo.ir.budget import Budget, parse_bytes  # noqa: E402
from mutwo.runtime.measurement.device_memory import apply_memory_limit, free_planning_leftovers  # noqa: E402
from mutwo.runtime.measurement.expandable_segments import ALLOCATORS, user_allocator_settings  # noqa: E402
from mutwo.tools.config import PRECISIONS  # noqa: E402
from mutwo.tools.experiment_configuration import run_configuration  # noqa: E402
from mutwo.tools.experiment_measure import build_training, measure_after_planning  # noqa: E402

CONFIGS = {"resnet152": "examples/resnet152.yaml", "bert": "examples/bert.yaml", "gpt2": "examples/gpt2.yaml",
           "tiny": "examples/tiny_mlp.yaml", "resnet152-cl": "examples/resnet152_channels_last.yaml"}  # fmt: skip
VARIANTS = ["eager", "checkpoint", "compile-0.5", "compile-0.1", "mutwo-none", "mutwo-checkpoint", "mutwo-eager0.5"]
#: Named lists of variants: recompute-only vs swap+recompute at half of eager's peak and at checkpointing's.
PRESETS = {"swap-study": ["eager", "checkpoint", "mutwo-none", "mutwo-eager0.5", "mutwo-swap-eager0.5",
                          "mutwo-checkpoint", "mutwo-swap-checkpoint"]}  # fmt: skip
MUTWO_PREFIXES = ("mutwo-swap", "mutwo+opt")
WARMUP, MEASURED = 3, 10


def equal_allocators(choice: str | None) -> str:
    """Give every variant's process the same allocator settings (it inherits this environment):
    ``choice``'s, else (None) those already in ``PYTORCH_CUDA_ALLOC_CONF``, else expandable segments,
    as mutwo sets them in its own processes; return the settings. ValueError when ``choice``
    contradicts a ``PYTORCH_CUDA_ALLOC_CONF`` already set."""
    given = user_allocator_settings()
    if given is not None:
        if choice is not None:
            raise ValueError(f"--allocator {choice}: {given} is set already; unset it, or leave --allocator out "
                             "to compare with it")  # fmt: skip
        return given.split("=", 1)[1]
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOCATORS[choice or "expandable"]
    return os.environ["PYTORCH_CUDA_ALLOC_CONF"]


class Checkpointed(nn.Module):
    """Runs a block under non-reentrant torch.utils.checkpoint."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return torch.utils.checkpoint.checkpoint(self.inner, *args, use_reentrant=False, **kwargs)


class CompileVariant(NamedTuple):
    """A ``torch.compile`` variant's name, ``compile[@mode]-<activation budget>``, taken apart."""

    mode: str | None  #: torch.compile's mode; None for its default
    budget: float  #: ``torch._functorch.config.activation_memory_budget``


def compile_variant(variant: str) -> CompileVariant | None:
    """``variant`` taken apart, or None when it is not a torch.compile variant."""
    if not variant.startswith("compile"):
        return None
    head, budget = variant.rsplit("-", 1)
    return CompileVariant(head.partition("@")[2] or None, float(budget))


class PeakSinceStart:
    """A step whose ``recorded_peak_bytes`` (which ``measure_step`` reads) is the device's peak over
    every call, warm-up included, not only over the measured iterations after its reset."""

    def __init__(self, step: Any, device: torch.device) -> None:
        self.step, self.device = step, device
        self.recorded_peak_bytes = torch.cuda.max_memory_allocated(device)

    def __call__(self) -> Any:
        result = self.step()
        self.recorded_peak_bytes = max(self.recorded_peak_bytes, torch.cuda.max_memory_allocated(self.device))
        return result


def checkpoint_blocks(model: nn.Module) -> int:
    """Wrap every ResNet bottleneck / BERT encoder layer / GPT-2 block / Llama decoder layer; return
    how many were wrapped."""
    wrapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child).__name__ in ("Bottleneck", "BasicBlock", "BertLayer", "GPT2Block", "LlamaDecoderLayer"):
                setattr(module, name, Checkpointed(child))
                wrapped += 1
    return wrapped


def mutwo_budget(spec: str, done: list[dict[str, Any]], stand_in: str | None = None) -> Any:
    """The budget a ``mutwo-<spec>`` variant plans for, resolving references to the memory another
    variant held (``held_bytes``, max reserved: a budget is held memory, and "at X's memory" is at
    what X's process held); where none was measured (a CPU dry run), ``stand_in`` if given (a
    budget such as ``0.5``). A reference row measured before held memory was recorded (an old
    ``--reference`` file, allocated bytes only) is refused, not read as held memory."""
    reference = {"checkpoint": ("checkpoint", 1.0)}
    if spec.startswith("eager"):
        reference[spec] = ("eager", float(spec.removeprefix("eager")))
    if spec.startswith("compile"):
        reference[spec] = (f"compile-{spec.removeprefix('compile')}", 1.0)
    if spec not in reference:
        return spec
    variant, factor = reference[spec]
    held = [r["held_bytes"] for r in done if r["variant"] == variant and r.get("held_bytes")]
    if not held and any(r["variant"] == variant and r.get("peak_bytes") for r in done):
        raise ValueError(f"mutwo-{spec}: the {variant} row has an allocated peak but no held memory (held_bytes); "
                         "measure it again with this harness")
    if not held and stand_in is not None and any(r["variant"] == variant and "error" not in r for r in done):
        return stand_in
    if not held:
        raise ValueError(f"mutwo-{spec} needs the {variant} variant measured first")
    return Budget(bytes=int(held[-1] * factor))


class MutwoVariant(NamedTuple):
    """A mutwo variant's name, ``mutwo[+opt|-swap][@backend]-<budget>``, taken apart."""

    spec: str  #: the budget: none, a fraction, bytes, eager<f>, compile<f>, checkpoint
    backend: str  #: what runs the planned graph (docs/backends.md)
    optimizer_passes: bool  #: ``mutwo+opt``: optimizer-in-backward and foreach-buckets before select
    swap: bool  #: ``mutwo-swap``: select-swap and insert-swap instead of select and rewrite


def mutwo_variant(variant: str) -> MutwoVariant | None:
    """``variant`` taken apart, or None when it is not a mutwo variant."""
    if not variant.startswith("mutwo") or "-" not in variant:
        return None
    prefix = next((p for p in MUTWO_PREFIXES if variant.startswith(p)), "mutwo")
    head, spec = variant.rsplit("-", 1)
    backend = head.split("@", 1)[1] if "@" in head else "eager"
    return MutwoVariant(spec, backend, prefix == "mutwo+opt", prefix == "mutwo-swap")


def budget_spec(variant: str) -> str | None:
    """The budget part of a mutwo variant (``mutwo-swap-eager0.5`` -> ``eager0.5``), None for others."""
    parsed = mutwo_variant(variant)
    return None if parsed is None else parsed.spec


def config_path(name: str) -> Path:
    """The config a ``--models`` name stands for: a known model, or a YAML file."""
    return ROOT / CONFIGS[name] if name in CONFIGS else Path(name).resolve()


def graphable_capture(parsed: MutwoVariant) -> bool:
    """Whether the variant captures the step for CUDA graphs (a capturable optimizer: another graph)."""
    return parsed.backend.endswith("cudagraphs")


def reuses_profile(variant: str, before: list[str]) -> bool:
    """Whether ``variant``, run after the variants ``before`` it, plans from a profile an earlier row
    saved: a mutwo variant with a budget (it profiles itself only when no profile of its graph was
    saved), or an unbudgeted one after another unbudgeted row of its capture (the unplanned step
    under another backend, which need not profile again: its measured time anchors the planned
    rows' predictions, :func:`anchored_prediction`)."""
    parsed = mutwo_variant(variant)
    if parsed is None:
        return False
    if parsed.spec != "none":
        return True
    earlier = [p for p in map(mutwo_variant, before) if p is not None and p.spec == "none"]
    return bool(earlier) and graphable_capture(earlier[-1]) == graphable_capture(parsed)


def profile_reuse(variants: list[str]) -> list[bool]:
    """:func:`reuses_profile` of each of ``variants``, in order (by position: a variant may be named twice)."""
    return [reuses_profile(v, variants[:i]) for i, v in enumerate(variants)]


def unplanned_reusing(variants: list[str]) -> list[bool]:
    """For each of ``variants``, in order: whether it is an unbudgeted mutwo variant that
    :func:`reuses_profile` (its worker gets ``--reuse-profile``, and saves no profile)."""
    return [budget_spec(v) == "none" and reuse for v, reuse in zip(variants, profile_reuse(variants), strict=True)]


def wait_for_turn(gate: Path, timings: dict[str, Any], parent: int) -> None:
    """A worker planned beside others: say it is ready (``gate.ready``), then wait for ``gate.go``;
    exit if compare.py (process ``parent``) is gone, rather than hold the device for nobody."""
    if torch.cuda.is_available():  # what planning left in the cache is not kept while others measure
        free_planning_leftovers(torch.device("cuda"))
    timings["planned_at"] = time.time()
    gate.with_suffix(".ready").touch()
    while not gate.with_suffix(".go").exists():
        if os.getppid() != parent:
            raise SystemExit(f"compare.py (process {parent}) ended before this worker's turn to measure")
        time.sleep(0.2)
    timings["measured_from"] = time.time()


def sampled_stacks_path(folder: str | None, name: str, batch: str, variant: str) -> Path | None:
    """Where a worker writes its sampled planning stacks (``--sample-stacks``), or None."""
    if folder is None or mutwo_variant(variant) is None:
        return None
    # "@" (mutwo@inductor-...) is a character the GPU machine's file transfer refuses in a name
    return Path(folder).resolve() / f"{Path(name).stem}_b{batch}_{variant.replace('@', '-at-')}.folded"


def worker(name: str, batch_size: int, variant: str, budget: str | None, out: Path,
           precision: str | None = None, trace: Path | None = None, isolate_profile: bool = False,
           warmup: int = WARMUP, iterations: int = MEASURED, calibrate_peak: int = 0,
           gate: Path | None = None, measure_choice: bool = False,
           reuse_profile: bool = False, memory_limit: int | None = None,
           sample_stacks: Path | None = None) -> dict[str, Any]:  # fmt: skip
    config = config_path(name)
    if memory_limit is not None and torch.cuda.is_available():  # capped before anything is built, as a card
        apply_memory_limit(torch.device("cuda"), memory_limit)
    own = mutwo_variant(variant)
    if own is not None:
        spec: Any = json.loads(budget) if budget else own.spec
        plan_for = Budget(bytes=spec["bytes"]) if isinstance(spec, dict) else spec
        timings: dict[str, Any] = {}
        parent = os.getppid()
        turn: Callable[[], None] | None = None if gate is None else lambda: wait_for_turn(gate, timings, parent)
        sampling = contextlib.nullcontext() if sample_stacks is None else sampled_planning(sample_stacks)
        with sampling as stop_sampling:
            if stop_sampling is not None:
                turn = stopping_first(stop_sampling, turn)
            row = run_configuration(config, batch_size, plan_for, out, warmup=warmup, iterations=iterations,
                                    precision=precision, optimizer_passes=own.optimizer_passes, swap=own.swap,
                                    backend=own.backend, trace=trace, isolate_profile=isolate_profile,
                                    calibrate_peak=calibrate_peak if own.backend != "eager" else 0,
                                    measure_choice=measure_choice and own.swap and own.backend != "eager",
                                    before_measuring=turn, reuse_profile=reuse_profile, memory_limit=memory_limit,
                                    device_lock=None if gate is None else gate.parent / "device.lock")  # fmt: skip
        if isinstance(spec, dict):
            row["budget_bytes"] = spec["bytes"]
        if sample_stacks is not None:
            row["sampled_stacks"] = str(sample_stacks)
        if gate is not None:
            row.update(timings, planned_in_parallel=True, measured_until=time.time())
        return row
    training = build_training(config, batch_size, precision=precision)
    row: dict[str, Any] = {"precision": training.options.precision}
    runner: nn.Module = training.model
    if variant == "checkpoint":
        row["checkpointed_blocks"] = checkpoint_blocks(training.model)
    compiled = compile_variant(variant)
    if compiled is not None:
        torch._functorch.config.activation_memory_budget = compiled.budget
        runner = torch.compile(training.model, mode=compiled.mode)
    step: Any = training.eager_step(runner)
    start = time.perf_counter()
    step()
    row["first_step_seconds"] = round(time.perf_counter() - start, 2)
    if compiled is not None and compiled.mode is not None and training.device.type == "cuda":
        # A mode such as reduce-overhead records CUDA graphs in the first steps, whose private pools
        # hold the step's memory from then on; the measured iterations only replay and allocate
        # nothing, so their peak is taken over every step since the process began.
        step = PeakSinceStart(step, training.device)
    row.update(measure_after_planning(step, training.device, memory_limit, warmup=warmup, iterations=iterations,
                                      trace=trace, planned=False))  # fmt: skip
    return row


@contextlib.contextmanager
def sampled_planning(path: Path) -> Iterator[Callable[[], None]]:
    """Sample the main thread's stacks (``bench/stack_sampler.py``) into ``path`` until the
    function this yields is called (before measuring: the sampler's thread would perturb the
    measured steps) or the block ends, however it ends; a file left at ``path`` by an earlier run
    is removed first. The sampler also runs through the profile pass, whose host-side times it may
    lengthen a little (it takes the GIL every 5 ms)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    sampler = StackSampler().__enter__()
    stopped = False

    def stop() -> None:
        nonlocal stopped
        if not stopped:
            stopped = True
            sampler.__exit__(None, None, None)
            sampler.write(path)

    try:
        yield stop
    finally:
        stop()


def stopping_first(stop: Callable[[], None], turn: Callable[[], None] | None) -> Callable[[], None]:
    """A ``before_measuring`` hook that calls ``stop``, then waits for ``turn`` (if any)."""

    def stop_then_wait() -> None:
        stop()
        if turn is not None:
            turn()

    return stop_then_wait


class Job(NamedTuple):
    """A variant to run in a worker process: its row's first keys, its budget, its command line."""

    base: dict[str, Any]
    variant: str
    budget: Any
    argv: list[str]
    refused: dict[str, Any] | None = None  #: the row of a variant whose budget could not be resolved


def worker_argv(args: argparse.Namespace, name: str, batch: str, variant: str, encoded_budget: str,
                reuse_profile: bool = False) -> list[str]:  # fmt: skip
    """The command line of the worker process that runs one variant (``reuse_profile``: an
    unbudgeted variant that plans from the saved profile, :func:`reuses_profile`)."""
    return [sys.executable, __file__, "--worker", name, batch, variant, encoded_budget,
            *(["--reuse-profile"] if reuse_profile else []),
            *(["--out", args.out] if args.out else []),
            *(["--precision", args.precision] if args.precision else []),
            *(["--trace"] if args.trace else []),
            *(["--isolate-profile"] if args.isolate_profile else []),
            *(["--memory-limit", args.memory_limit] if getattr(args, "memory_limit", None) else []),
            *(["--sample-stacks", args.sample_stacks] if getattr(args, "sample_stacks", None) else []),
            "--calibrate-peak", str(args.calibrate_peak), *(["--measure-choice"] if args.measure_choice else []),
            "--warmup", str(args.warmup), "--iterations", str(args.iterations)]  # fmt: skip


def anchored_prediction(row: dict[str, Any], earlier: list[dict[str, Any]]) -> dict[str, Any]:
    """A compiled row's predicted time anchored to its backend's unplanned step, or nothing.

    A plan is priced at the profile's kernels: ``predicted_iteration_ms`` is the profiled step
    (``profiled_iteration_ms``, eager kernels) plus what the plan adds. Inductor runs other, fused
    kernels, and a compiled step is faster than its profile: ResNet-152's plans were predicted
    14-17% slower than they ran (docs/benchmarks.md). Where ``earlier`` has the unplanned step of
    the same model, batch and capture measured under the row's backend (its ``mutwo@<backend>-none``
    row, which :func:`reuses_profile` of an earlier unbudgeted row, or profiles itself), the
    prediction is scaled by what compiling did to that step:
    ``predicted_anchored_ms = anchor × predicted / profiled`` (the plan's added time shrinks in the
    same proportion as the step's). So are a measured choice's candidates."""
    parsed = mutwo_variant(str(row.get("variant")))
    if parsed is None or parsed.spec == "none" or parsed.backend == "eager" or "error" in row \
            or not row.get("profiled_iteration_ms") or "predicted_iteration_ms" not in row:  # fmt: skip
        return {}
    name = ("mutwo+opt" if parsed.optimizer_passes else "mutwo") + f"@{parsed.backend}-none"
    anchors = [r for r in earlier if r.get("variant") == name and r.get("model") == row.get("model")
               and r.get("batch_size") == row.get("batch_size") and r.get("iteration_ms")]  # fmt: skip
    if not anchors:
        return {}
    anchor, profiled = anchors[-1]["iteration_ms"], row["profiled_iteration_ms"]

    def anchored(predicted: float) -> float:
        return round(anchor * predicted / profiled, 3)

    fields: dict[str, Any] = {"anchor_variant": name, "anchor_iteration_ms": round(anchor, 3),
                              "predicted_anchored_ms": anchored(row["predicted_iteration_ms"])}  # fmt: skip
    choice = row.get("measured_choice")
    if isinstance(choice, dict) and "candidates" in choice:
        candidates = [{**c, "predicted_anchored_ms": anchored(c["predicted_iteration_ms"])}
                      if "predicted_iteration_ms" in c else c for c in choice["candidates"]]  # fmt: skip
        fields["measured_choice"] = {**choice, "candidates": candidates}
    return fields


def finished_row(base: dict[str, Any], returncode: int, stdout: str, stderr: str) -> dict[str, Any]:
    """The row a worker printed last, or an error row from what it wrote to stderr."""
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if returncode == 0 and lines:
        return json.loads(lines[-1])
    return {**base, "error": "out of memory" if "OutOfMemoryError" in stderr else stderr.strip()[-400:]}


def planning_groups(variants: list[str], parallel: int) -> list[list[str]]:
    """``variants`` in order, as the groups they run in: with ``parallel`` above 1, consecutive
    variants that :func:`reuses_profile` share a group (they plan from a saved profile, so planning
    beside each other measures nothing); every other variant is alone."""
    groups: list[list[str]] = []
    reuse = profile_reuse(variants)
    for index, variant in enumerate(variants):
        if parallel > 1 and groups and reuse[index] and reuse[index - 1]:
            groups[-1].append(variant)
        else:
            groups.append([variant])
    return groups


def unprofiled(variants: list[str]) -> str | None:
    """The first planned mutwo variant whose profile would not be the one the last unbudgeted mutwo
    row before it saved (there is one profile.json per model and batch, made by the last unbudgeted
    row that profiled; one that reuses it is of the same capture): none ran, or it captured another
    graph (CUDA-graph backends capture a capturable optimizer)."""
    graphable: bool | None = None  # the kind of graph the saved profile is of
    for variant in variants:
        parsed = mutwo_variant(variant)
        if parsed is None:
            continue
        if parsed.spec == "none":
            graphable = graphable_capture(parsed)
        elif graphable is None or graphable_capture(parsed) != graphable:
            return variant
    return None


def run_in_parallel(jobs: list[Job], parallel: int, timeout: int,
                    gates: Path) -> Iterator[tuple[Job, dict[str, Any]]]:  # fmt: skip
    """Plan and compile ``jobs`` in up to ``parallel`` worker processes at once, then let each
    measure alone, in order; yield each job with its row as it ends. Each worker gets ``timeout``
    seconds to plan and as many again to measure."""
    gates.mkdir(parents=True, exist_ok=True)
    for old in gates.iterdir():
        old.unlink()
    launched: list[tuple[Job, subprocess.Popen[str], Path, float]] = []
    try:
        yield from _plan_then_measure(jobs, parallel, timeout, gates, launched)
    finally:  # an error here, or a caller that stopped early: no worker is left waiting at its gate
        for _, process, _, _ in launched:
            if process.poll() is None:
                process.kill()
                process.wait()


def _plan_then_measure(jobs: list[Job], parallel: int, timeout: int, gates: Path,
                       launched: list[tuple[Job, subprocess.Popen[str], Path, float]],
                       ) -> Iterator[tuple[Job, dict[str, Any]]]:  # fmt: skip
    """:func:`run_in_parallel`'s work; every worker it starts goes into ``launched``."""

    def planning() -> list[tuple[Job, subprocess.Popen[str], Path, float]]:
        return [entry for entry in launched
                if not entry[2].with_suffix(".ready").exists() and entry[1].poll() is None]  # fmt: skip

    waiting, timed_out = list(jobs), set()
    while waiting or planning():
        while waiting and len(planning()) < parallel:
            job, gate = waiting.pop(0), gates / str(len(launched))
            with gate.with_suffix(".out").open("w") as out, gate.with_suffix(".err").open("w") as err:
                process = subprocess.Popen([*job.argv, "--gate", str(gate)], cwd=ROOT, stdout=out, stderr=err,
                                           text=True)  # fmt: skip
            launched.append((job, process, gate, time.monotonic()))
        for _, process, gate, started in planning():
            if time.monotonic() - started > timeout:
                process.kill()
                timed_out.add(gate)
        time.sleep(0.5)
    for job, process, gate, _ in launched:
        if process.poll() is None:  # planned and waiting for its turn
            gate.with_suffix(".go").touch()
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                timed_out.add(gate)
        if gate in timed_out:
            yield job, {**job.base, "error": f"timeout after {timeout} s"}
            continue
        row = finished_row(job.base, process.returncode, gate.with_suffix(".out").read_text(),
                           gate.with_suffix(".err").read_text())  # fmt: skip
        if "error" not in row and not row.get("profile_reused"):
            row["error"] = "planned beside other processes without a reused profile: its times are not its own"
        yield job, row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="JSON file to write (rewritten after every variant)")
    parser.add_argument("--models", default="resnet152:128,bert:64", help="name:batch,...")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated variants, or a preset: {', '.join(PRESETS)}")  # fmt: skip
    parser.add_argument("--timeout", type=int, default=600, help="seconds per variant")
    parser.add_argument("--reference", action="append", default=[], metavar="FILE",
                        help="an earlier run's JSON whose measured peaks budgets may name")
    parser.add_argument("--stand-in-budget", metavar="B",
                        help="where a budget names a peak that was not measured (a CPU dry run: peaks are "
                        "measured on CUDA only), plan for B instead (0.5: half of mutwo's own peak); the row says so")
    parser.add_argument("--precision", choices=PRECISIONS, help="override the configs' precision (bf16-autocast...)")
    parser.add_argument("--trace", action="store_true",
                        help="after measuring each variant, profile 3 more iterations and add where the GPU time went, "
                        "stream by stream, under 'streams' (Chrome traces beside --out; CUDA only)")
    parser.add_argument("--isolate-profile", action="store_true",
                        help="mutwo variants profile with profile{isolate=true}: each node's GPU time without the "
                        "host's launch time (compare the predicted and measured times with and without)")
    parser.add_argument("--calibrate-peak", type=int, default=0, metavar="ROUNDS",
                        help="mutwo variants of a compiled backend (mutwo@inductor..., mutwo@cudagraphs...): up to "
                        "ROUNDS re-plans until the compiled step's measured peak is within 3%% of the budget (each "
                        "round compiles again)")
    parser.add_argument("--measure-choice", action="store_true",
                        help="mutwo-swap variants of a compiled backend: when select-swap's plan swaps, also compile "
                        "the recompute-only plan at its budget and keep whichever is measured faster (the row's "
                        "measured_choice)")
    parser.add_argument("--memory-limit", metavar="BYTES",
                        help="cap every variant's process at this much device memory (16GiB, 12000MiB), as a card of "
                        "that size would, before anything is built (a row that runs out of memory says so)")
    parser.add_argument("--allocator", choices=tuple(ALLOCATORS),
                        help="the CUDA allocator of every variant's process: expandable (the default, as mutwo "
                             "turns it on) or default (torch's); PYTORCH_CUDA_ALLOC_CONF, when set, instead")
    parser.add_argument("--warmup", type=int, default=WARMUP, help=f"warm-up iterations per variant (default {WARMUP})")
    parser.add_argument("--iterations", type=int, default=MEASURED,
                        help=f"measured iterations per variant (default {MEASURED}; 1 makes a CPU dry run short)")
    parser.add_argument("--parallel-planning", type=int, default=1, metavar="N",
                        help="plan and compile up to N mutwo variants at once, then measure them one at a time "
                        "(they reuse the profile of a mutwo-none row before them; default 1: one after the other)")
    parser.add_argument("--sample-stacks", metavar="DIR",
                        help="sample each mutwo row's planning (bench/stack_sampler.py) into "
                             "DIR/<config>_b<batch>_<variant>.folded")
    parser.add_argument("--worker", nargs=4, metavar=("MODEL", "BATCH", "VARIANT", "BUDGET"), help=argparse.SUPPRESS)
    parser.add_argument("--gate", type=Path, help=argparse.SUPPRESS)  # a worker planned beside others waits there
    parser.add_argument("--reuse-profile", action="store_true", help=argparse.SUPPRESS)  # an unbudgeted worker
    args = parser.parse_args()
    if args.out:  # workers run in ROOT: they get the path this process means, not one relative to ROOT
        args.out = str(Path(args.out).resolve())
    if args.sample_stacks:
        args.sample_stacks = str(Path(args.sample_stacks).resolve())
    scratch = Path(args.out).with_suffix("") if args.out else ROOT / "mutwo-out" / "compare"
    if args.warmup < 0 or args.iterations < 1:
        parser.error("--warmup must be at least 0 and --iterations at least 1")
    if args.calibrate_peak < 0:
        parser.error("--calibrate-peak must be 0 (off) or a number of rounds")
    if args.memory_limit:
        try:
            parse_bytes(args.memory_limit)
        except ValueError as error:
            parser.error(f"--memory-limit: {error}")
    if args.parallel_planning < 1:
        parser.error("--parallel-planning must be at least 1 (1: one variant after the other)")
    if not args.worker:  # the workers inherit it
        try:
            allocator = equal_allocators(args.allocator)
        except ValueError as error:
            parser.error(str(error))
    if args.trace and not torch.cuda.is_available():
        parser.error("--trace profiles CUDA streams and needs a GPU; run without --trace on a CPU")
    if args.worker:
        name, batch, variant, budget = args.worker
        trace = scratch / f"{Path(name).stem}_b{batch}_{variant}.trace.json.gz" if args.trace else None
        row = worker(name, int(batch), variant, budget or None, scratch / config_path(name).stem, args.precision,
                     trace, args.isolate_profile, args.warmup, args.iterations, args.calibrate_peak,
                     args.gate, args.measure_choice, args.reuse_profile,
                     parse_bytes(args.memory_limit) if args.memory_limit else None,
                     sampled_stacks_path(args.sample_stacks, name, batch, variant))  # fmt: skip
        print(json.dumps({**row, "model": name, "batch_size": int(batch), "variant": variant}))
        return
    rows: list[dict[str, Any]] = []
    references = [row for path in args.reference for row in json.loads(Path(path).read_text())["runs"]]

    def record(job: Job, row: dict[str, Any]) -> None:
        if job.budget is not None and job.budget == args.stand_in_budget and job.budget != budget_spec(job.variant):
            row["stand_in_budget"] = job.budget  # not the measured peak the variant names
        row.update(anchored_prediction(row, rows))
        print(json.dumps({k: v for k, v in row.items() if k != "iteration_ms_all"}), flush=True)
        rows.append(row)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
            Path(args.out).write_text(json.dumps({"gpu": gpu, "torch": torch.__version__,
                                                  "date": time.strftime("%Y-%m-%d"), "allocator": allocator,
                                                  "runs": rows,
                                                  "reference_runs": references}, indent=2))  # fmt: skip

    for item in args.models.split(","):
        name, _, batch = item.rpartition(":")
        if name not in CONFIGS and not config_path(name).is_file():
            parser.error(f"--models: {name!r} is neither one of {', '.join(CONFIGS)} nor a YAML config file")
        variants = PRESETS.get(args.variants, args.variants.split(","))
        if args.parallel_planning > 1 and (missing := unprofiled(variants)):
            parser.error(f"--parallel-planning: {missing} would profile beside other processes' compiles; run an "
                         "unbudgeted row of its capture before it (mutwo-none, or mutwo@cudagraphs-none for a "
                         "CUDA-graph backend), whose profile the planned rows reuse")  # fmt: skip
        reusing = unplanned_reusing(variants)  # by position: a variant may be named twice
        position = 0
        for group in planning_groups(variants, args.parallel_planning):
            jobs: list[Job] = []
            for variant in group:
                reuse, position = reusing[position], position + 1
                base = {"model": name, "batch_size": int(batch), "variant": variant}
                spec = budget_spec(variant)
                measured = [r for r in references + rows if r["model"] == name and r["batch_size"] == int(batch)]
                try:
                    budget = None if spec is None else mutwo_budget(spec, measured, args.stand_in_budget)
                except ValueError as error:
                    jobs.append(Job(base, variant, None, [], {**base, "error": str(error)}))
                    continue
                plain = {"bytes": budget.bytes} if isinstance(budget, Budget) else budget
                encoded = json.dumps(plain) if budget else ""
                jobs.append(Job(base, variant, budget, worker_argv(args, name, batch, variant, encoded, reuse)))
            runnable = [job for job in jobs if job.refused is None]
            if len(runnable) > 1:  # rows in the variants' order, refused ones among them
                measured_rows = run_in_parallel(runnable, args.parallel_planning, args.timeout, scratch / "gates")
                for job in jobs:
                    record(*((job, job.refused) if job.refused is not None else next(measured_rows)))
                continue
            for job in jobs:
                if job.refused is not None:
                    record(job, job.refused)
                    continue
                try:
                    done = subprocess.run(job.argv, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
                    row = finished_row(job.base, done.returncode, done.stdout, done.stderr)
                except subprocess.TimeoutExpired:
                    row = {**job.base, "error": f"timeout after {args.timeout} s"}
                record(job, row)


if __name__ == "__main__":
    main()
