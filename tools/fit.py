"""``mutwo-opt --fit 16GiB``: the largest batch size that fits, from a config (see :mod:`mutwo.runtime.fit`)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from mutwo.ir.pass_base import write_atomic
from mutwo.runtime.fit import FitError, fit, parse_limit
from mutwo.tools.cli import EXIT_OK, UsageError
from mutwo.tools.config import Config


def run_fit(cli: Any, config: Config, device: torch.device, out: Path) -> int:
    """Search from the config's batch size, print the batch, the plan and the peaks, write fit.json."""
    try:
        limit = parse_limit(cli.args.fit)
    except FitError as error:
        raise UsageError(f"--fit: {error}") from None
    if cli.args.budget is not None:
        raise UsageError("--fit chooses the batch size for a memory limit, which is the budget; drop --budget")
    fitted = fit(lambda batch: cli.capture(dataclasses.replace(config, batch_size=batch), device),
                 config.batch_size, limit, cli.log)  # fmt: skip
    result, point = fitted.result, fitted.point
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "fit.json", json.dumps({**result.to_json(), "plan": fitted.context.artifacts["plan"].to_json()},
                                              indent=2) + "\n")  # fmt: skip
    if result.measured_peak is not None:
        seconds = result.measured_seconds or 0.0
        measured = f", measured {result.measured_peak / 2**20:.1f} MiB ({seconds * 1e3:.1f} ms per iteration)"
    else:
        measured = f", measured: {result.measured_error}" if result.measured_error else " (CPU: nothing measured)"
    print(f"largest batch that fits in {cli.args.fit}: {point.batch_size} (tried {len(result.tried)} batch sizes); "
          f"plan: {point.note}; predicted peak {point.predicted_peak / 2**20:.1f} MiB{measured}; wrote {out}/fit.json")
    if result.over_limit():
        raise FitError(result.over_limit())
    return EXIT_OK
