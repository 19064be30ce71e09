"""The command line of ``mutwo-opt`` (its synopsis is :mod:`mutwo.tools.mutwo_opt`'s docstring): the
parser, and the checks of what the options ask for together that are made before anything is
captured, each refusal a one-line :class:`~mutwo.tools.cli.UsageError`.

The checks of the files ``--profile-from`` and ``--plan-from`` give are :mod:`mutwo.tools.mutwo_opt_reuse`'s.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from mutwo.ir.budget import BudgetError, parse_bytes
from mutwo.ir.pass_base import Pass
from mutwo.ir.registry import PassRegistry
from mutwo.runtime.execution.auto_backend import AUTO, BACKEND_CHOICES
from mutwo.runtime.execution.backends import backend_services
from mutwo.runtime.parallel import distributed
from mutwo.runtime.parallel.distributed import DataParallel
from mutwo.runtime.planning.fit_search import FIT_PIPELINE
from mutwo.runtime.planning.peak_calibration import calibration_refusal
from mutwo.runtime.planning.plan_choice import choice_refusal
from mutwo.tools.cli import Parser, UsageError, did_you_mean
from mutwo.tools.config import DEFAULT_PIPELINE, Config

#: The parser's description: the first line of :mod:`mutwo.tools.mutwo_opt`'s docstring without its
#: reStructuredText markup (tests/test_docs.py keeps the two the same).
DESCRIPTION = "mutwo-opt: capture a model's training iteration and run a pipeline of passes over it."


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``mutwo-opt``'s command line; bad usage raises :class:`~mutwo.tools.cli.UsageError`."""
    parser = Parser(prog="mutwo-opt", description=DESCRIPTION)
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
    parser.add_argument("--backend", choices=BACKEND_CHOICES,
                        help="what runs the final graph (default: the config's, else auto: on CUDA "
                        "inductor-cudagraphs when the step can be recorded, else the fastest backend that runs it; "
                        "eager on the CPU); see docs/backends.md")
    parser.add_argument("--precision", help="override the config's precision: fp32, bf16-autocast, fp16-autocast")
    parser.add_argument("--memory-format", help="override the config's memory_format: contiguous, or channels_last "
                        "(the model's and the batch's 4-D tensors NHWC, as cuDNN's fastest convolutions want)")
    parser.add_argument("--check", action="store_true",
                        help="run the original and final graphs for 3 iterations and compare every number")
    parser.add_argument("--profile-from", metavar="FILE",
                        help="reuse a profile.json written by the profile pass for this same graph")
    parser.add_argument("--plan-from", metavar="FILE",
                        help="reuse a plan.json (select) or swap_plan.json (select-swap) written for this same graph")
    parser.add_argument("--memory-limit", metavar="MEMORY",
                        help="the most the process may hold on the GPU (16GiB), as a card of that size would: "
                        "planning stays within it (profiling out of core when the step does not fit) and the "
                        "process is capped at it (docs/out-of-core.md)")
    parser.add_argument("--fit", metavar="MEMORY", help="find the largest batch size whose optimized iteration fits "
                        "in MEMORY (16GiB), starting from the config's; writes fit.json (see docs/fit.md)")
    parser.add_argument("--fit-margin", type=float, metavar="SHARE",
                        help="with --fit: the share of MEMORY the plans keep free for what the simulator does not "
                        "see (default 0.1)")
    parser.add_argument("--fit-max-slowdown", type=float, metavar="FACTOR",
                        help="with --fit: only batches whose plan predicts at most FACTOR times the time of the step "
                        "without recomputation (like 1.3); the largest batch is often not the fastest training")
    parser.add_argument("--calibrate-peak", type=int, metavar="ROUNDS",
                        help="plan again, up to ROUNDS times, until what the step makes the process hold on the "
                        "device (reserved bytes, CUDA-graph pools included) is at most the budget and within 3%% "
                        "under it; each round compiles again (default on CUDA: 2; 0: never; more while every round "
                        "ran out of memory under --memory-limit, down to half the budget; docs/backends.md)")
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
    parser.add_argument("--sharding", choices=("ddp", "fsdp2"), default="ddp",
                        help="under torchrun: ddp (every rank holds the model, default) or fsdp2 (fully_shard each "
                        "repeated block, then the model; docs/data-parallel.md)")
    cache = parser.add_mutually_exclusive_group()
    cache.add_argument("--cache-dir", metavar="DIR",
                       help="the plan cache's folder (default: $MUTWO_CACHE_DIR, else $XDG_CACHE_HOME/mutwo, else "
                       "~/.cache/mutwo): a run with the same graph, device and options reuses the profile and plan "
                       "kept there, skipping profile, select and calibration (docs/plan-cache.md)")
    cache.add_argument("--no-cache", action="store_true",
                       help="neither reuse nor keep a plan in the plan cache (profile and plan this run afresh)")
    parser.add_argument("--debug", action="store_true",
                        help="print the traceback behind an error (like MUTWO_DEBUG=1)")
    return parser


def print_ir_after(text: str, registry: PassRegistry, passes: list[Pass]) -> frozenset[str]:
    """The passes ``--print-ir-after`` (``text``) names, an alias standing for the last of its passes
    the pipeline runs (``rewrite``: the IR once rewritten); each must be in the pipeline, or nothing
    would be printed for it."""
    names: set[str] = set()
    running = [p.name for p in passes]
    for name in (n.strip() for n in text.split(",")):
        if not name:
            continue
        members = registry.aliases.get(name, (name,))
        # An alias stands for the last of its passes this pipeline runs (-p optimizer-in-backward
        # runs only the first of the alias optimizer's two).
        target = next((m for m in reversed(members) if m in running), members[-1])
        if target not in registry.names():
            hint = did_you_mean(name, registry.names() + sorted(registry.aliases))
            raise UsageError(f"--print-ir-after names unknown pass '{name}'; "
                             + (f"{hint} " if hint else "") + "see mutwo-opt --list-passes")  # fmt: skip
        if target not in running:
            raise UsageError(f"--print-ir-after names '{name}', which this pipeline does not run "
                             f"({','.join(running)}); name one of its passes")  # fmt: skip
        names.add(target)
    return frozenset(names)


def refuse_options_fit_leaves_unused(args: argparse.Namespace) -> None:
    """With ``--fit``, refuse the options of a single plan: the search plans every batch size with its
    own pipeline, so they would go unused."""
    if args.fit is None:
        return
    given = (("-p", args.passes), ("--plan-from", args.plan_from), ("--profile-from", args.profile_from),
             ("--calibrate-peak", args.calibrate_peak), ("--measure-choice", args.measure_choice),
             ("--memory-limit", args.memory_limit), ("--cache-dir", args.cache_dir))  # fmt: skip
    unused = [option for option, value in given if value]
    if unused:
        raise UsageError(f"--fit profiles once and plans every batch size with its own pipeline "
                         f"({FIT_PIPELINE}), so {unused[0]} would go unused; drop it, and use it on the "
                         "batch size --fit finds")  # fmt: skip


def refuse_fit_misuse(args: argparse.Namespace, backend: str) -> None:
    """Refuse ``--fit-margin`` and ``--fit-max-slowdown`` without ``--fit``, and ``--fit`` with a
    compiled backend."""
    fit_only = (("--fit-margin", args.fit_margin), ("--fit-max-slowdown", args.fit_max_slowdown))
    for option, value in fit_only:
        if value is not None and args.fit is None:
            raise UsageError(f"{option} applies to --fit; add --fit MEMORY (like --fit 16GiB)")
    if args.fit is not None and backend not in ("eager", AUTO):  # the search measures eager runs (auto: eager)
        raise UsageError(f"--fit searches with the eager backend, not {backend}; run --fit without "
                         "--backend, then the batch size it finds with --backend")  # fmt: skip


def refuse_backend_choices(args: argparse.Namespace, config: Config, device: torch.device, passes: list[Pass],
                           data_parallel: DataParallel | None) -> None:  # fmt: skip
    """Backend choices that cannot work here (``data_parallel``: the ranks of a torchrun launch),
    and ``--calibrate-peak`` or ``--measure-choice`` where they cannot run, refused before anything
    is captured."""
    fused = next((p.name for p in passes if getattr(p, "fused", False)), None)
    if fused is not None and not backend_services(config.backend)["fused_recompute"]:
        raise UsageError(f"{fused}{{fused=true}} prices recomputes as Inductor fuses them, but --backend is "
                         f"{config.backend}: use --backend inductor, or drop fused=true")  # fmt: skip
    if config.backend.endswith("cudagraphs") and device.type != "cuda":
        raise UsageError(f"--backend {config.backend} needs a CUDA device, this run is on {device}; use --backend "
                         "eager or inductor")  # fmt: skip
    refusal = None
    if data_parallel is not None:
        refusal = distributed.backend_refusal(config.backend, data_parallel, "--backend inductor")
        if refusal is not None:
            raise UsageError(refusal)
        refusal = distributed.planning_refusal(args.measure_choice, "--measure-choice")
    refusal = refusal or calibration_refusal(args.calibrate_peak, config.backend, passes, "--calibrate-peak",
                                             "--budget")  # fmt: skip
    refusal = refusal or choice_refusal(args.measure_choice, config.backend, passes, "--measure-choice",
                                        config.budget)  # fmt: skip
    if refusal is not None:
        raise UsageError(refusal)


def checked_out_dir(args: argparse.Namespace, config: Config, writes: bool) -> Path:
    """The output folder, checked, without creating anything yet, to be writable when this process
    ``writes`` it (rank 0 of a data-parallel run, or the only process)."""
    out = Path(args.out) if args.out else Path("mutwo-out") / config.name
    if not writes:
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


def memory_limit(args: argparse.Namespace) -> int | None:
    """``--memory-limit`` in bytes, or None."""
    if args.memory_limit is None:
        return None
    try:
        return parse_bytes(args.memory_limit)
    except BudgetError as error:
        raise UsageError(f"--memory-limit: {error}") from None
