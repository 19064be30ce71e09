"""``mutwo-opt --fit 16GiB``: the largest batch size that fits, from a config (see
:mod:`mutwo.runtime.planning.fit`)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from mutwo.ir.budget import readable_bytes
from mutwo.ir.pass_base import write_atomic
from mutwo.runtime.planning.captured import CapturedGraph
from mutwo.runtime.planning.fit import (
    DEFAULT_MARGIN,
    FitError,
    FitResult,
    check_margin,
    check_max_slowdown,
    fit,
    parse_limit,
)
from mutwo.runtime.planning.fit_search import MAX_BATCH, pace
from mutwo.tools.cli import EXIT_OK, UsageError
from mutwo.tools.config import Config


def fit_options(cli: Any) -> tuple[int, float, float | None]:
    """The limit, margin and slowdown bound the command line asks for; a usage error before anything runs."""
    try:
        limit = parse_limit(cli.args.fit)
    except FitError as error:
        raise UsageError(f"--fit: {error}") from None
    if cli.args.budget is not None:
        raise UsageError("--fit chooses the batch size for a memory limit, which is the budget; drop --budget")
    margin = DEFAULT_MARGIN if cli.args.fit_margin is None else cli.args.fit_margin
    try:
        check_margin(margin)
    except FitError as error:
        raise UsageError(f"--fit-margin: {error}") from None
    try:
        return limit, margin, check_max_slowdown(cli.args.fit_max_slowdown)
    except FitError as error:
        raise UsageError(f"--fit-max-slowdown: {error}") from None


def run_fit(cli: Any, config: Config, device: torch.device, out: Path) -> int:
    """Search from the config's batch size, print every measured run, the batch, the plan and the
    peaks (with --time-passes, then the search's phases), write fit.json (as the search goes, and
    also when no batch fits: the record of what was tried; ``finished`` says whether the search
    ended)."""
    limit, margin, max_slowdown = fit_options(cli)

    def record(result: FitResult, plan: dict[str, Any] | None = None, finished: bool = False) -> None:
        # Rewritten as the search goes: a run stopped from outside leaves what it had tried.
        write_atomic(out / "fit.json", json.dumps({**result.to_json(), "plan": plan, "finished": finished,
                                                   "phase_seconds": cli.rounded_phases()}, indent=2) + "\n")

    def capture_at(batch: int) -> CapturedGraph:
        with cli.timed("capture"):
            return cli.capture(dataclasses.replace(config, batch_size=batch), device)

    fitted = fit(capture_at, config.batch_size, limit, margin=margin, max_slowdown=max_slowdown, log=cli.log,
                 progress=record, timed=cli.timed)  # fmt: skip
    result = fitted.result
    record(result, fitted.plan.to_json() if fitted.plan is not None else None, finished=True)
    for attempt in result.attempts:
        print(f"measured run {attempt.describe()}")
    if not result.failure:
        print(summary(result, cli.args.fit, out))
    if cli.args.time_passes:
        print(cli.phase_report())
    if result.failure:
        raise FitError(result.failure)
    return EXIT_OK


def summary(result: FitResult, limit_text: str, out: Path) -> str:
    """The answer in one line: the batch, its plan, the predicted peak and time and the profile they
    come from, and the measured ones."""
    best = result.best
    assert best is not None
    if result.measured_peak is not None:
        measured = (f", measured {readable_bytes(result.measured_peak)} "
                    f"({pace(result.measured_seconds, best.batch_size)})")
    else:
        measured = " (CPU: nothing measured)"
    capped = (f"; the search stops at batch {MAX_BATCH:,}, and a larger one may fit too"
              if result.stopped_at_max_batch else "")  # fmt: skip
    # The prediction is the batch's own profile's, which says where it was measured.
    seconds = f", {pace(best.predicted_seconds, best.batch_size)}" if best.predicted_seconds is not None else ""
    return (f"largest batch that fits in {limit_text}: {best.batch_size} (planned {len(result.tried)} times, "
            f"{len(result.attempts)} measured runs); plan: {best.note}, for {readable_bytes(best.budget)} (margin "
            f"{result.margin:.0%}); predicted peak {readable_bytes(best.predicted_peak)}{seconds} from a profile "
            f"{best.profile}{measured}{capped}; wrote {out}/fit.json")  # fmt: skip
