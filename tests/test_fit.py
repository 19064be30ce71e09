"""``mutwo-opt --fit``: the search over batch sizes, and the command end to end on CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import mutwo
from mutwo.ir.budget import readable_bytes
from mutwo.ir.memory import simulate
from mutwo.passes.select import SelectPass
from mutwo.runtime.planning.captured import CapturedGraph
from mutwo.runtime.planning.fit import FitError, FitPoint, FitResult, Measure, Measured, search
from mutwo.runtime.planning.fit_search import MAX_BATCH
from mutwo.tools import mutwo_opt
from mutwo.tools.fit import summary
from mutwo.tools.mutwo_opt import MutwoOpt, main
from tests import models

EXAMPLE = str(Path(__file__).resolve().parents[1] / "examples" / "tiny_mlp.yaml")


def _linear(bytes_per_sample: int, fixed: int, limit: int):  # noqa: ANN202 (a closure)
    def predict(batch: int) -> FitPoint:
        peak = fixed + batch * bytes_per_sample
        return FitPoint(batch, peak <= limit, peak, budget=limit)

    return predict


@pytest.mark.parametrize("start", [1, 7, 64, 500])
def test_search_finds_the_largest_fitting_batch_within_a_sixteenth(start: int) -> None:
    limit = 10_000 + 300 * 100
    found = search(_linear(100, 10_000, limit), start, limit)
    assert found.best is not None and found.best.fits
    best = found.best.batch_size
    assert best <= 300 and 300 - best <= max(1, best // 16)
    assert all(p.fits == (p.batch_size <= 300) for p in found.tried)
    assert len({p.batch_size for p in found.tried}) == len(found.tried), "each size is planned once"


def test_search_bisects_through_sizes_already_captured_where_it_can() -> None:
    limit = 10_000 + 300 * 100
    found = search(_linear(100, 10_000, limit), 64, limit, cheap=frozenset({280, 310, 330}))
    assert found.best is not None and 300 - found.best.batch_size <= found.best.batch_size // 16
    tried = [p.batch_size for p in found.tried]
    assert tried[:6] == [64, 128, 256, 512, 330, 280], "the captured sizes nearest the middles"


def test_search_stops_at_the_largest_batch_it_may_try() -> None:
    found = search(_linear(1, 0, 10**9), 3, 10**9, max_batch=40)
    assert found.best is not None and found.best.batch_size == 40
    assert search(_linear(1, 0, 10**9), 3, 10**9, max_batch=0).failure


def test_search_says_when_it_stops_at_the_largest_batch_it_tries(tmp_path: Path) -> None:
    found = search(_linear(1, 0, 10**12), 3, 10**12)
    assert found.best is not None and found.best.batch_size == MAX_BATCH and found.capped
    assert not search(_linear(100, 10_000, 10_000 + 300 * 100), 64, 10_000 + 300 * 100).capped
    result = FitResult(10**12, 3, 0.1, 9 * 10**11, best=found.best, tried=found.tried, stopped_at_max_batch=True)
    assert f"the search stops at batch {MAX_BATCH:,}, and a larger one may fit too" in summary(result, "1TB", tmp_path)


def test_search_says_when_not_even_one_sample_fits() -> None:
    found = search(_linear(100, 10_000, 5_000), 4, 5_000)
    assert found.best is None and "not even batch size 1 fits" in found.failure
    # batch 1 peaks at 10,100 B against a limit of 6,000 B, planned at 5,000 B
    found = search(_linear(100, 10_000, 5_000), 4, 5_000, limit=6_000)
    assert found.failure.startswith("not even batch size 1 fits: its best plan peaks at 9.9 KiB, the limit is 5.9 KiB "
                                    "(4.9 KiB to plan for after the margin); give it more memory")  # fmt: skip


def test_a_batch_that_does_not_fit_says_what_it_needs_against_the_limit() -> None:
    """The bytes every plan needs where select knows them (its estimate, or the lowest peak it
    searched for), else the best plan's peak; a batch too slow says so instead."""
    point = FitPoint(1, False, 0, "select failed", 2 * 2**30, needs=int(3.2 * 2**30))
    assert point.shortfall(int(2.5 * 2**30)) == ("it needs at least 3,276.8 MiB, the limit is 2,560.0 MiB "
                                                 "(2,048.0 MiB to plan for after the margin)")  # fmt: skip
    assert point.shortfall(2 * 2**30) == "it needs at least 3,276.8 MiB, the limit is 2,048.0 MiB"  # no margin
    planned = FitPoint(1, False, 3 * 2**20, "select failed", 2 * 2**20)
    assert planned.shortfall(2 * 2**20) == "its best plan peaks at 3.0 MiB, the limit is 2.0 MiB"
    unprofiled = FitPoint(1, False, 0, "it cannot be profiled within the limit (...)", 2 * 2**20)
    assert unprofiled.shortfall(2 * 2**20) == "it could not be planned, the limit is 2.0 MiB"
    slow = FitPoint(1, False, 2**20, "over the bound of 1.00×", 2 * 2**20, too_slow=True)
    assert slow.shortfall(2 * 2**20) == "its plan fits in 2.0 MiB but is too slow"


def test_fit_on_cpu_writes_the_batch_plan_and_peaks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([EXAMPLE, "--fit", "2MiB", "--batch-size", "256", "-o", str(tmp_path), "-q"]) == 0
    fit = json.loads((tmp_path / "fit.json").read_text())
    best = fit["best"]["batch_size"]
    budget = int(2 * 2**20 * 0.9)  # the default margin keeps a tenth of the limit free
    assert fit["limit_bytes"] == 2 * 2**20 and fit["profiled_batch"] == 256 and fit["planning_budget"] == budget
    assert fit["best"]["predicted_peak"] <= budget == fit["plan"]["budget_bytes"] == fit["best"]["budget"]
    assert fit["plan"]["predicted_peak"] == fit["best"]["predicted_peak"]
    larger = [p for p in fit["tried"] if p["batch_size"] > best]
    assert larger and not any(p["fits"] for p in larger), "a larger batch was tried and did not fit"
    assert fit["measured_peak"] is None and fit["attempts"] == [] and "profiled at its own size" in fit["assumptions"]
    # The answer's numbers come from a profile measured at its batch size, and fit.json says how.
    assert fit["best"]["profiled_at"] == best and fit["best"]["profile"].startswith(f"measured at batch {best}, ")
    assert [p["batch_size"] for p in fit["profiles"]] == [256, best]
    assert fit["profiles"][1]["memory"] in fit["best"]["profile"]
    assert fit["finished"] and not fit["failure"]
    plan = fit["plan"]  # each plan says what its recomputation costs: the price of the larger batch
    assert plan["added_seconds"] > 0 and plan["base_seconds"] > 0
    slower = 1 + plan["added_seconds"] / plan["base_seconds"]
    assert fit["best"]["note"].endswith(f"recomputed, predicted {slower:.2f}× the time without it")
    out = capsys.readouterr().out
    assert f"largest batch that fits in 2MiB: {best}" in out and f"from a profile measured at batch {best}, " in out
    assert f"predicted peak {readable_bytes(fit['best']['predicted_peak'])}, " in out


def test_fit_that_finds_nothing_fails_in_one_line_and_keeps_its_record(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert main([EXAMPLE, "--fit", "1KiB", "--batch-size", "2", "-o", str(tmp_path), "-q"]) == 1
    err = capsys.readouterr().err
    fit = json.loads((tmp_path / "fit.json").read_text())
    needs = fit["tried"][1]["needs"]  # select's estimate for batch 1, which no plan gets under
    assert needs > 2**10 and fit["tried"][1]["predicted_peak"] == 0  # refused on the estimate: nothing simulated
    assert (f"mutwo-opt: failed: not even batch size 1 fits: it needs at least {readable_bytes(needs)}, the limit is "
            "1.0 KiB (921 B to plan for after the margin); give it more memory or train a smaller model; planning "
            "batch 1: pass 'select' failed") in err  # fmt: skip
    assert "ask for budget" not in err  # --fit sets the budget itself
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert fit["finished"] and fit["best"] is None and fit["plan"] is None
    assert [p["batch_size"] for p in fit["tried"]] == [2, 1] and fit["failure"] in err


def test_fit_times_its_phases(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--time-passes with --fit prints the search's phase table, as a normal run prints its own, and
    fit.json keeps the phases: the captures count apart from the planning they happen in, and the
    phases with the rest add up to the total (a search that finds nothing prints it too)."""
    assert main([EXAMPLE, "--fit", "1KiB", "--batch-size", "2", "--time-passes", "-o", str(tmp_path), "-q"]) == 1
    stdout = capsys.readouterr().out
    table = stdout[stdout.index("===== mutwo-opt run timing ====="):].splitlines()
    rows = {line.split(None, 2)[2]: float(line.split()[0]) for line in table[2:]}
    assert set(rows) == {"capture", "profile", "plan", "other (setup, reports, files)", "total"}
    assert rows["capture"] > 0 and rows["profile"] > 0 and rows["plan"] > 0
    assert sum(v for k, v in rows.items() if k != "total") == pytest.approx(rows["total"], abs=1e-3)
    fit = json.loads((tmp_path / "fit.json").read_text())
    assert set(fit["phase_seconds"]) == {"capture", "profile", "plan"}
    assert fit["phase_seconds"]["capture"] == pytest.approx(rows["capture"], abs=1e-3)


def test_a_phase_timed_inside_another_counts_toward_itself_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """--fit captures while it plans: the capture's seconds count as capture, not also as plan."""
    clock = iter([0.0, 2.0, 5.0, 9.0, 10.0, 10.5])  # plan 0-9 with a capture 2-5 in it; then capture 10-10.5
    monkeypatch.setattr(mutwo_opt.time, "perf_counter", lambda: next(clock))
    run = type("Run", (), {"timed": MutwoOpt.timed, "phase_seconds": {}, "inner_seconds": 0.0})()
    with run.timed("plan"):
        with run.timed("capture"):
            pass
    with run.timed("capture"):
        pass
    assert run.phase_seconds == {"capture": 3.5, "plan": 6.0}


@pytest.mark.parametrize(("argv", "message"), [
    (["--fit", "0.5"], "--fit: memory limit: '0.5' is not a memory size: give bytes with a unit, like 16GiB"),
    (["--fit", "lots"], "--fit: memory limit: 'lots' is not a memory size: give bytes with a unit, like 16GiB"),
    (["--fit", "16GiBs"], "--fit: memory limit: '16GiBs' has unknown unit 'GiBs'; use B, KiB, MiB"),
    (["--fit", "2MiB", "--budget", "0.5"], "drop --budget"),
    (["--fit", "2MiB", "--fit-margin", "1.5"], "--fit-margin: margin 1.5 is not a share of the limit"),
    (["--fit", "2MiB", "--fit-margin", "-0.1"], "--fit-margin: margin -0.1 is not a share of the limit"),
    (["--fit-margin", "0.2"], "--fit-margin applies to --fit"),
    (["--fit", "2MiB", "--fit-max-slowdown", "0.9"], "--fit-max-slowdown: max slowdown 0.9 is below 1"),
    (["--fit-max-slowdown", "1.2"], "--fit-max-slowdown applies to --fit"),
])  # fmt: skip
def test_fit_usage_errors(argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([EXAMPLE, *argv, "-o", str(tmp_path / "out"), "-q"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists(), "nothing is written"


def _mlp_fit(memory: str, measure: Measure | None = None, margin: float = 0.1,
             max_slowdown: float | None = None) -> FitResult:  # fmt: skip
    workload = models.mlp()
    optimizer = models.OPTIMIZERS["adam"](workload.model.parameters())

    def make_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 16), torch.randint(0, 5, (n,))

    return mutwo.fit_batch(workload.model, optimizer, make_batch, workload.loss_fn, memory, start=64, margin=margin,
                           max_slowdown=max_slowdown, measure=measure)  # fmt: skip


@pytest.fixture(scope="module")
def predicted() -> FitResult:
    """The MLP's fit in 256 KiB with nothing measured: the simulator's answer."""
    return _mlp_fit("256KiB")


def test_fit_batch_from_the_api(predicted: FitResult) -> None:
    result = predicted
    assert result.best is not None and result.best.fits and result.best.predicted_peak <= 0.9 * 256 * 2**10
    assert result.best.batch_size > 64 and result.measured_peak is None and not result.attempts
    assert any(not p.fits and p.batch_size > result.best.batch_size for p in result.tried)
    with pytest.raises(FitError, match="is not a memory size"):
        _mlp_fit("0.5")


def test_fit_bounds_the_predicted_slowdown(predicted: FitResult) -> None:
    """With no slowdown allowed, the batch found is the largest whose plan recomputes nothing: smaller
    than the largest that fits, and the larger ones that fit in memory say they are over the bound."""
    assert predicted.best is not None and not predicted.best.note.startswith("0 activations")
    bounded = _mlp_fit("256KiB", max_slowdown=1.0)
    assert bounded.best is not None and bounded.max_slowdown == 1.0
    assert bounded.best.note.startswith("0 activations recomputed, predicted 1.00×")
    assert bounded.best.batch_size < predicted.best.batch_size
    assert any(p.too_slow and "over the bound of 1.00×" in p.note and p.batch_size > bounded.best.batch_size
               for p in bounded.tried)  # fmt: skip


class FakeGpu:
    """A measurement that runs out of memory above ``fits_up_to`` samples, and otherwise peaks at
    the rewritten graph's simulated peak times ``factor`` (what the simulator does not see).
    ``fits_up_to`` may be a share of the first batch measured instead (a float below 1): each fit
    profiles afresh, so the batch it first measures varies from run to run."""

    def __init__(self, fits_up_to: float, factor: float = 1.0) -> None:
        self.fits_up_to, self.factor, self.batches = fits_up_to, factor, []

    def __call__(self, batch: int, lowered: CapturedGraph, limit: int) -> Measured:
        if not self.batches and self.fits_up_to < 1:
            self.fits_up_to = int(batch * self.fits_up_to)
        self.batches.append(batch)
        if batch > self.fits_up_to:
            return Measured(None, None, "out of memory under the cap")
        return Measured(int(simulate(lowered.graph).peak_bytes * self.factor), 0.01)


def test_fit_steps_back_after_a_run_out_of_memory() -> None:
    gpu = FakeGpu(fits_up_to=2 / 3)  # two thirds of the first batch measured
    result = _mlp_fit("256KiB", gpu)
    assert result.best is not None and result.best.batch_size <= gpu.fits_up_to
    # Every later search stays below the failed first run, so the largest batch any search
    # predicted to fit is the first search's answer: the batch measured first.
    simulated = max(p.batch_size for p in result.tried if p.fits)
    assert gpu.batches[0] == simulated, "the first run measures the simulator's answer"
    assert result.attempts[0].error == "out of memory under the cap" and not result.attempts[0].fits
    assert len(result.attempts) == len(gpu.batches) <= 4
    assert [a.batch_size for a in result.attempts] == gpu.batches
    fitting = [a for a in result.attempts if a.fits]
    assert fitting and result.best.batch_size == max(a.batch_size for a in fitting)
    assert result.measured_peak is not None and result.measured_peak <= 256 * 2**10
    # every run after the first is below the smallest batch that failed before it
    for index, attempt in enumerate(result.attempts[1:], start=1):
        assert attempt.batch_size < min(a.batch_size for a in result.attempts[:index] if not a.fits)


def test_fit_steps_back_by_the_measured_overshoot() -> None:
    gpu = FakeGpu(fits_up_to=10**6, factor=1.3)  # the real peak is 30% above the simulated one
    result = _mlp_fit("256KiB", gpu, margin=0.0)
    first = result.attempts[0]
    assert not first.fits and first.measured_peak is not None and first.measured_peak > 256 * 2**10
    assert result.attempts[1].planned_budget < first.planned_budget * 256 * 2**10 / first.measured_peak
    assert result.best is not None and result.measured_peak is not None and result.measured_peak <= 256 * 2**10


def test_fit_fails_in_one_line_when_no_run_fits() -> None:
    with pytest.raises(FitError) as error:
        _mlp_fit("256KiB", FakeGpu(fits_up_to=0))
    message = str(error.value)
    assert message.startswith("no batch size measured within 256.0 KiB in 4 runs (batch ")  # once '0.25 MiB'
    assert "out of memory under the cap" in message and "\n" not in message


def test_select_can_stop_at_an_unreachable_budget(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # What --fit's search plans with: a batch whose budget is out of reach fails at once.
    # 200 KiB: over what the inputs hold (105 KiB, refused before profiling), far under the lowest peak.
    argv = [EXAMPLE, "-p", "profile,select{lowest=false},rewrite", "--budget", "200KiB", "-o", str(tmp_path), "-q"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "is out of reach: recomputing every activation idle at the peak, the estimate stays at" in err
    assert "lowest=false" in err
    assert len(err.strip().splitlines()) == 1


def test_a_plan_that_crashes_is_an_error_not_a_batch_that_does_not_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    # A crash inside select (BERT-base once hit Python's recursion limit there) once read as
    # "does not fit", and the search went on to smaller batches as if nothing was wrong.
    def crash(*args: object, **kwargs: object) -> None:
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(SelectPass, "_greedy_plan", crash)
    with pytest.raises(FitError, match=r"planning batch 64 failed: pass 'select' failed .*maximum recursion depth"):
        _mlp_fit("256KiB")


def test_a_measured_run_says_when_the_allocator_thrashed() -> None:
    """A run whose caching allocator emptied its cache and retried (each retry synchronises the GPU)
    says so, with what may avoid it; an out-of-memory run keeps what the allocator held."""
    from mutwo.runtime.planning.fit_search import Attempt

    point = FitPoint(72, True, 15 * 2**30, "161 activations recomputed", 15 * 2**30)
    slow = Attempt.of(point, Measured(15 * 2**30, 4.2, "", allocator_retries=7, reserved_peak=16 * 2**30), 16 * 2**30)
    assert slow.fits and slow.allocator_retries == 7
    assert "retried 7 times" in slow.describe() and "expandable_segments:True" in slow.describe()
    calm = Attempt.of(point, Measured(15 * 2**30, 0.9, "", allocator_retries=0), 16 * 2**30)
    assert "retried" not in calm.describe() and "(900.0 ms/iteration, 12.50 ms/sample)" in calm.describe()
    failed = Attempt.of(point, Measured(None, None, "out of memory under the cap; the allocator had reserved ...",
                                        allocator_retries=2), 16 * 2**30)  # fmt: skip
    assert not failed.fits and failed.describe().endswith("expandable_segments:True may avoid it)")
    assert "the allocator had reserved" in failed.describe()
