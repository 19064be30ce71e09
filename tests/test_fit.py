"""``mutwo-opt --fit``: the search over batch sizes, and the command end to end on CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import mutwo
from mutwo.runtime.fit import FitError, FitPoint, search
from mutwo.tools.mutwo_opt import main
from tests import models

EXAMPLE = str(Path(__file__).resolve().parents[1] / "examples" / "tiny_mlp.yaml")


def _linear(bytes_per_sample: int, fixed: int, limit: int):  # noqa: ANN202 (a closure)
    def predict(batch: int) -> FitPoint:
        peak = fixed + batch * bytes_per_sample
        return FitPoint(batch, peak <= limit, peak)

    return predict


@pytest.mark.parametrize("start", [1, 7, 64, 500])
def test_search_finds_the_largest_fitting_batch_within_a_sixteenth(start: int) -> None:
    limit = 10_000 + 300 * 100
    result = search(_linear(100, 10_000, limit), start, limit, start)
    assert result.best is not None and result.best.fits
    best = result.best.batch_size
    assert best <= 300 and 300 - best <= max(1, best // 16)
    assert all(p.fits == (p.batch_size <= 300) for p in result.tried)
    assert len({p.batch_size for p in result.tried}) == len(result.tried), "each size is planned once"


def test_search_stops_at_the_largest_batch_it_tries() -> None:
    result = search(_linear(1, 0, 10**9), 3, 10**9, 3, max_batch=40)
    assert result.best is not None and result.best.batch_size == 40


def test_search_says_when_not_even_one_sample_fits() -> None:
    with pytest.raises(FitError, match="not even batch size 1 fits"):
        search(_linear(100, 10_000, 5_000), 4, 5_000, 4)


def test_fit_on_cpu_writes_the_batch_plan_and_peaks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([EXAMPLE, "--fit", "2MiB", "--batch-size", "256", "-o", str(tmp_path), "-q"]) == 0
    fit = json.loads((tmp_path / "fit.json").read_text())
    best = fit["best"]["batch_size"]
    assert fit["limit_bytes"] == 2 * 2**20 and fit["profiled_batch"] == 256
    assert fit["best"]["predicted_peak"] <= 2 * 2**20 == fit["plan"]["budget_bytes"]
    assert fit["plan"]["predicted_peak"] == fit["best"]["predicted_peak"]
    larger = [p for p in fit["tried"] if p["batch_size"] > best]
    assert larger and not any(p["fits"] for p in larger), "a larger batch was tried and did not fit"
    assert fit["measured_peak"] is None and "scaled linearly" in fit["assumptions"]
    assert f"largest batch that fits in 2MiB: {best}" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "message"), [
    (["--fit", "0.5"], "--fit: memory limit: '0.5' is not a memory size: give bytes with a unit, like 16GiB"),
    (["--fit", "lots"], "--fit:"),
    (["--fit", "2MiB", "--budget", "0.5"], "drop --budget"),
])  # fmt: skip
def test_fit_usage_errors(argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([EXAMPLE, *argv, "-o", str(tmp_path / "out"), "-q"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists(), "nothing is written"


def test_fit_batch_from_the_api() -> None:
    workload = models.mlp()
    optimizer = models.OPTIMIZERS["adam"](workload.model.parameters())

    def make_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 16), torch.randint(0, 5, (n,))

    result = mutwo.fit_batch(workload.model, optimizer, make_batch, workload.loss_fn, "256KiB", start=8)
    assert result.best is not None and result.best.fits and result.best.predicted_peak <= 256 * 2**10
    assert result.best.batch_size > 8 and result.measured_peak is None
    assert any(not p.fits and p.batch_size > result.best.batch_size for p in result.tried)
    with pytest.raises(FitError, match="is not a memory size"):
        mutwo.fit_batch(workload.model, optimizer, make_batch, workload.loss_fn, "0.5")
