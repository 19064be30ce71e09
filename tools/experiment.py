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

This module is the sweep: its arguments, one worker process per configuration and the results.
A worker runs its configuration with
:func:`mutwo.tools.experiment_configuration.run_configuration` (built and measured by
:mod:`mutwo.tools.experiment_measure`, planned by :mod:`mutwo.tools.experiment_planning`); the
plots are drawn by :mod:`mutwo.tools.experiment_plots`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from mutwo.ir.pass_base import write_atomic
from mutwo.runtime.measurement.expandable_segments import ALLOCATORS, user_allocator_settings
from mutwo.tools.cli import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, Parser, UsageError
from mutwo.tools.experiment_configuration import run_configuration
from mutwo.tools.experiment_measure import OUT_OF_MEMORY

ROOT = Path(__file__).resolve().parent.parent


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``mutwo-experiment``, with its hidden ``--worker`` for one configuration."""
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
    """Measure every batch size and variant of ``args``, each in a worker process, write
    ``results.json`` after each and the plots at the end; returns the exit code."""
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
    if config.accumulation_steps > 1:  # its eager baseline and measured steps are whole optimizer steps
        raise UsageError(f"accumulation_steps: {config.accumulation_steps}: mutwo-experiment measures whole "
                         "optimizer steps on one batch; set it to 1, or plan the accumulating step with mutwo-opt")
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
    if user_allocator_settings() is None:  # every variant with the allocator mutwo's rows get: equal allocators
        env["PYTORCH_CUDA_ALLOC_CONF"] = ALLOCATORS["expandable"]
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
