"""Peak calibration (:mod:`mutwo.runtime.planning.peak_calibration`): re-planning until a step's
measured peak (on CUDA what the process holds) is at most the budget and within 3% under it."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import mutwo
import mutwo.runtime.planning.captured as captured
import mutwo.runtime.planning.peak_calibration as peak_calibration
from mutwo.ir.budget import Budget, parse_budget
from mutwo.ir.pass_base import PassContext
from mutwo.ir.swap import OFFLOAD
from mutwo.runtime.api import optimize_graph
from mutwo.runtime.planning.peak_calibration import CalibrationRound, calibrate, next_budget
from mutwo.tools.experiment_configuration import run_configuration
from mutwo.tools.mutwo_opt import EXIT_OK, EXIT_USAGE, main
from tests import models

REPO = Path(__file__).resolve().parent.parent
TINY_MLP = REPO / "examples" / "tiny_mlp.yaml"


def compiled_step_keeping(share: float) -> Any:
    """A stand-in for planning and measuring: the plan simulates exactly its budget, and the
    compiled step peaks at ``share`` of that (under 1: Inductor freed buffers the plan counts)."""
    budgets: list[int] = []

    def plan_and_measure(budget: int) -> tuple[CalibrationRound, int]:
        budgets.append(budget)
        return CalibrationRound(budget, budget, int(budget * share)), len(budgets)

    return plan_and_measure, budgets


def test_a_step_under_its_plan_is_replanned_with_the_gap_added() -> None:
    plan_and_measure, budgets = compiled_step_keeping(0.85)
    calibration = calibrate(1000, 3, plan_and_measure)
    # 1000 measured 850: the next plan may simulate the 135 up to the middle of [970, 1000] more;
    # it measured 964, still under the window: the step held 0.84 bytes more per byte of budget
    # between the two, so the third moves by 21 / 0.84 = 25 and measures 986.
    assert budgets == [1000, 1135, 1160]
    assert calibration.rounds[2].measured_peak_bytes == 986
    assert calibration.chosen == 2 and calibration.step == 3 and calibration.within
    assert "kept round 3" in calibration.summary() and "within 3% under it" in calibration.summary()


def test_a_re_plan_predicted_under_one_percent_faster_than_a_fitting_step_is_not_compiled() -> None:
    """BERT-base b64 under a 16 GiB cap on an H200 (session 29): its first step held 3.5% under the
    window's top and fitted, and the re-plan, predicted no faster, cost a 75 s compile. A re-plan
    must be predicted at least 1% faster than the fitting round; one that is compiles as before."""
    def calibration_predicting(speedup: float) -> tuple[Any, list[int], list[int], list[str]]:
        budgets: list[int] = []
        previewed: list[int] = []
        messages: list[str] = []

        def plan_and_measure(budget: int) -> tuple[CalibrationRound, int]:
            budgets.append(budget)
            return CalibrationRound(budget, budget, int(budget * 0.85), predicted_seconds=1.0), len(budgets)

        def predict(budget: int) -> float:
            previewed.append(budget)
            return 1.0 - speedup

        calibration = calibrate(1000, 3, plan_and_measure, messages.append, predict=predict)
        return calibration, budgets, previewed, messages

    calibration, budgets, previewed, messages = calibration_predicting(0.009)
    assert budgets == [1000] and previewed == [1135] and calibration.chosen == 0 and not calibration.within
    assert "predicted 991.0 ms per iteration against 1000.0 ms for the 0.0 MiB plan whose step fits" in messages[-1]
    assert "0.90% faster, under the 1% worth a compile" in messages[-1] and messages[-1].endswith("; stopping")
    assert calibration.describe()["stopped"] == calibration.stopped != ""
    assert calibration.over_budget() is None  # it fits: nothing to warn about
    calibration, budgets, previewed, _ = calibration_predicting(0.0101)
    assert budgets == [1000, 1135, 1160] and previewed == budgets[1:] and calibration.within
    assert calibration.stopped == ""
    _, _, _, messages = calibration_predicting(-0.05)
    assert "(5.00% slower, under the 1% worth a compile)" in messages[-1]
    _, _, _, messages = calibration_predicting(0.0)
    assert "(no faster, under the 1% worth a compile)" in messages[-1]


def test_a_re_plan_is_compared_with_the_fitting_round_of_the_largest_budget() -> None:
    """Each round predicts another time: the re-plan is weighed against the round calibration
    would keep (the largest budget whose step fitted), not the first or the last round, and never
    against a round that ran out of memory (whose peak is recorded as its budget, under the target)."""
    def round_at(budget: int, peak: int, seconds: float) -> CalibrationRound:
        return CalibrationRound(budget, budget, peak, predicted_seconds=seconds)

    # 1000 and 1135 fit, 1160 held over: the next budget lies between 1135 and 1160, and its plan
    # (0.995 s) is weighed against 1135's 1.00 s, not the first round's 1.20 s or the last's 0.99 s.
    rounds = [round_at(1000, 850, 1.20), round_at(1135, 964, 1.00), round_at(1160, 1100, 0.99)]
    asked: list[int] = []
    reason = peak_calibration.not_worth_a_compile(rounds, 1000, 1147, lambda b: asked.append(b) or 0.995)
    assert asked == [1147] and "against 1000.0 ms for the 0.0 MiB plan" in reason and "0.50% faster" in reason
    ran_out = [rounds[0], CalibrationRound(1200, 1200, 1000, out_of_memory=True, predicted_seconds=2.0)]
    reason = peak_calibration.not_worth_a_compile(ran_out, 1000, 1300, lambda b: 1.195)
    assert "against 1200.0 ms" in reason  # the round that ran out of memory is not the one kept


def test_a_re_plan_is_previewed_only_after_a_step_that_fits_and_only_upward() -> None:
    """No round fitted (the step held over the target), or the next budget is under the fitting
    one's: the next plan is compiled without asking what it predicts."""
    asked: list[int] = []

    def predict(budget: int) -> float:
        asked.append(budget)
        return 1.0

    def over(budget: int) -> tuple[CalibrationRound, None]:
        return CalibrationRound(budget, budget, int(budget * 1.10), predicted_seconds=1.0), None

    calibrate(1000, 1, over, predict=predict)
    assert asked == []
    rounds = [CalibrationRound(1000, 1000, 900, predicted_seconds=1.0)]
    assert peak_calibration.not_worth_a_compile(rounds, 1000, 990, predict) == "" and asked == []
    unknown = [CalibrationRound(1000, 1000, 900)]  # a plan without a predicted time: nothing to compare
    assert peak_calibration.not_worth_a_compile(unknown, 1000, 1100, predict) == "" and asked == []
    assert peak_calibration.not_worth_a_compile(rounds, 1000, 1100, lambda budget: None) == ""  # no plan reaches it


def test_a_step_over_its_plan_is_replanned_lower() -> None:
    plan_and_measure, budgets = compiled_step_keeping(1.10)
    calibration = calibrate(1000, 3, plan_and_measure)
    assert budgets == [1000, 885]
    assert calibration.chosen == 1 and calibration.rounds[1].measured_peak_bytes == 973


def test_a_step_over_the_budget_is_never_within_however_close() -> None:
    """A budget is a ceiling: 1% over is not within 3% (it was, when the window was ±3%)."""
    plan_and_measure, budgets = compiled_step_keeping(1.01)
    calibration = calibrate(1000, 1, plan_and_measure)
    assert budgets == [1000, 975] and calibration.chosen == 1 and calibration.within


def test_the_largest_budget_that_fits_is_kept_when_no_round_converges() -> None:
    peaks = iter([850, 1020, 1200])  # under by 15%, over by 2%, over by 20%: none within 1% under

    def plan_and_measure(budget: int) -> tuple[CalibrationRound, int]:
        return CalibrationRound(budget, budget, next(peaks)), budget

    calibration = calibrate(1000, 2, plan_and_measure, tolerance=0.01)
    assert [r.budget_bytes for r in calibration.rounds] == [1000, 1145, 1124]
    assert calibration.chosen == 0 and not calibration.within  # only 850 is under the budget
    assert "NOT within 1%" in calibration.summary()


def test_a_kept_step_over_the_budget_is_worded_as_a_warning_with_the_fix() -> None:
    """GPT-2 small on the H100 (session 23): both plans held over the budget, the second more than
    the first; the kept step's excess is said, with what to do, and a fitting step says nothing."""
    peaks = iter([1072, 1083])
    with pytest.warns(UserWarning, match="7.2% over the budget"):
        calibration = calibrate(1000, 1, lambda budget: (CalibrationRound(budget, budget, next(peaks)), budget))
    warning = calibration.over_budget()
    assert calibration.chosen == 0 and warning is not None
    assert "holds 1,072 B, 7.2% over the budget of 1,000 B after 2 plan(s)" in warning, warning
    assert "--calibrate-peak" in warning and "memory_limit=" in warning
    plan_and_measure, _ = compiled_step_keeping(0.9)
    assert calibrate(1000, 0, plan_and_measure).over_budget() is None


def test_a_step_calibrated_over_its_budget_warns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the whole loop: every measurement 50% over its plan, one re-plan allowed (none made:
    no plan of the tiny MLP reaches the lower budget it would need, which the warning says)."""
    real = peak_calibration.measured_peak
    monkeypatch.setattr(peak_calibration, "measured_peak", lambda run, inputs: (int(real(run, inputs)[0] * 1.5), None))
    with pytest.warns(UserWarning, match=r"% over the budget of .*, and no plan reaches"):
        row = run_configuration(TINY_MLP, 64, "0.95", tmp_path, device="cpu", warmup=0, iterations=1,
                                calibrate_peak=1)  # fmt: skip
    assert "error" not in row, row.get("error")


def test_mutwo_opt_prints_the_over_budget_warning_as_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    real = peak_calibration.measured_peak
    monkeypatch.setattr(peak_calibration, "measured_peak", lambda run, inputs: (int(real(run, inputs)[0] * 1.5), None))
    code = main(["-q", "--device", "cpu", "--budget", "0.95", "--calibrate-peak", "1", "-o", str(tmp_path / "out"),
                 str(TINY_MLP)])  # fmt: skip
    err = capsys.readouterr().err
    assert code == EXIT_OK, err
    lines = [line for line in err.splitlines() if "over the budget" in line]
    assert len(lines) == 1 and lines[0].startswith("mutwo: the planned step holds"), err
    assert "UserWarning" not in err and "warnings.warn" not in err, err


def test_a_round_within_the_tolerance_is_kept_over_a_larger_budget_far_under() -> None:
    peaks = iter([800, 1250, 990])  # budget 1000 peaks far under, 1185 over, 1076 within 3% under

    def plan_and_measure(budget: int) -> tuple[CalibrationRound, int]:
        return CalibrationRound(budget, budget, next(peaks)), budget

    calibration = calibrate(1000, 2, plan_and_measure)
    assert [r.budget_bytes for r in calibration.rounds] == [1000, 1185, 1076]
    assert calibration.chosen == 2 and calibration.within


def test_a_round_out_of_memory_is_planned_lower_and_never_kept() -> None:
    """Under a memory limit a plan's step may run out of memory when measured: the next plan is 10%
    of the budget lower, and the round is not kept even though its recorded peak is the budget."""

    def plan_and_measure(budget: int) -> tuple[CalibrationRound, int]:
        if budget >= 1000:
            return CalibrationRound(budget, budget, budget, out_of_memory=True), budget
        return CalibrationRound(budget, budget, budget + 60), budget

    messages: list[str] = []
    calibration = calibrate(1000, 2, plan_and_measure, messages.append)
    assert [r.budget_bytes for r in calibration.rounds] == [1000, 900, 925]
    assert calibration.chosen == 2 and calibration.within  # 985
    assert any("ran out of memory" in m for m in messages) and "out of memory" in calibration.summary()


def test_every_round_out_of_memory_is_one_sentence() -> None:
    """Past the re-plans given, rounds go on while all ran out of memory, down to half the budget."""
    budgets: list[int] = []

    def plan_and_measure(budget: int) -> tuple[CalibrationRound, int]:
        budgets.append(budget)
        return CalibrationRound(budget, budget, budget, out_of_memory=True), budget

    with pytest.raises(peak_calibration.CalibrationOutOfMemory, match="ran out of device memory") as raised:
        calibrate(1000, 2, plan_and_measure)
    assert "lower budget" in str(raised.value) and "\n" not in str(raised.value)
    assert budgets == [1000, 900, 800, 700, 600, 500] and "6 round(s), down to" in str(raised.value)


def test_rounds_out_of_memory_go_on_past_the_re_plans_given_until_one_runs() -> None:
    """ResNet-152-cl b128 under a 12 GiB limit on the H200 ran out of memory at 100, 90 and 80% of
    its budget with two re-plans given: a fourth round, 10% lower, is planned and kept, and the
    log says why it ran past the limit; nothing more once one ran, even under the window."""

    def plan_and_measure(budget: int) -> tuple[CalibrationRound, int]:
        if budget > 750:
            return CalibrationRound(budget, budget, budget, out_of_memory=True), budget
        return CalibrationRound(budget, budget, budget + 200), budget

    messages: list[str] = []
    calibration = calibrate(1000, 2, plan_and_measure, messages.append)
    assert [r.budget_bytes for r in calibration.rounds] == [1000, 900, 800, 700]
    assert calibration.chosen == 3 and not calibration.within  # 900: under the budget, 10% under
    assert any("round 4 past the 3 given" in m for m in messages)
    assert any("every plan so far ran out of memory" in m and "past the 2 re-plan(s) given" in m for m in messages)


@pytest.mark.parametrize(("held_over", "expected"), [
    (200, 785),  # the step held 200 over its allocation by the failure: 1000 + 200 is 215 over the window's middle
    (10, 900),  # less than the 10% step says: the 10% step
    (900, 500),  # never under half the budget by the estimate alone
], ids=["estimate", "ten-percent", "floor"])  # fmt: skip
def test_a_round_out_of_memory_steps_by_what_it_held_over_its_allocation(held_over: int, expected: int) -> None:
    """The plan's simulated peak plus what the process held over its allocation when the step
    failed estimates what the whole step would hold."""
    failed = CalibrationRound(1000, 1000, 1000, None, allocated_peak_bytes=1000 - held_over, out_of_memory=True,
                              held_at_failure_bytes=1000)  # fmt: skip
    assert failed.held_over_allocated_at_failure == held_over
    assert next_budget(1000, [failed]) == expected


def test_under_a_limit_no_round_is_planned_where_the_rounds_ratios_say_it_runs_out() -> None:
    """The 0.5B Llama under a 12 GiB cap (session29_h200/, scaled to a limit of 1000): two plans
    alike held 1.3% over and 0.8% under their simulated peaks, a flat slope whose secant step
    planned over the limit itself, and that round ran out of memory. Under the limit the next plan
    is made where a step holding 1.3% over its simulated peak holds the limit; without one the
    secant step stands."""
    rounds = [CalibrationRound(942, 936, 948), CalibrationRound(968, 966, 958)]
    assert next_budget(990, rounds) == 1015  # 17 under the window's middle, over a slope of 10/26
    assert next_budget(990, rounds, limit_bytes=1000) == int(1000 / (948 / 936)) == 987
    # Between a round that fitted and one that ran out, the bracket's middle (970) is over the
    # ceiling (943) too.
    bracketed = [CalibrationRound(940, 900, 954), CalibrationRound(1000, 990, 1000, out_of_memory=True)]
    assert next_budget(990, bracketed) == 970
    assert next_budget(990, bracketed, limit_bytes=1000) == int(1000 / (954 / 900)) == 943


def test_the_ceiling_never_plans_under_a_budget_that_fitted() -> None:
    """A round simulated well under its budget and held 5.6% over that: the ceiling (947) is under
    the round's own budget (960), so the same budget comes again and the round that fitted is kept,
    rather than compiling a plan that recomputes more and lands further under the window; the log
    says why the next plan was not made where the gap pointed."""

    def plan_and_measure(budget: int) -> tuple[CalibrationRound, int]:
        return CalibrationRound(budget, 900, 950), budget

    messages: list[str] = []
    calibration = calibrate(990, 2, plan_and_measure, messages.append, first_budget=960, limit_bytes=1000)
    assert [r.budget_bytes for r in calibration.rounds] == [960] and calibration.chosen == 0
    assert any("the next budget is" in m and "the process may hold" in m for m in messages), messages


def test_a_round_out_of_memory_says_what_it_held_when_it_failed() -> None:
    def plan_and_measure(budget: int) -> tuple[CalibrationRound, int]:
        if budget >= 1000 * 2**20:
            held, allocated = 1000 * 2**20, 700 * 2**20
            return CalibrationRound(budget, budget, budget, None, allocated, True, held), budget
        return CalibrationRound(budget, budget, budget + 200 * 2**20), budget

    messages: list[str] = []
    calibration = calibrate(1000 * 2**20, 2, plan_and_measure, messages.append)
    assert any("ran out of memory (holding 1,000.0 MiB, 300.0 MiB over its allocation, when it failed)" in m
               for m in messages)  # fmt: skip
    assert calibration.rounds[1].budget_bytes == (1000 - 315) * 2**20  # 1000 + 300 over 985, the window's middle


def test_failure_peaks_are_unknown_off_cuda() -> None:
    assert peak_calibration.failure_peaks([torch.zeros(2)]) == (None, None)


@pytest.mark.parametrize(("budget", "limit", "aimed"), [
    (1000, None, 1000),  # no limit known (the CPU without a memory limit)
    (1000, 2000, 1000),  # far under the limit
    (990, 1000, 990),  # 1% under it already
    (1000, 1000, 990),  # a budget at the limit (issue 38's rows): held 1% under it
    (1200, 1000, 990),  # over it
], ids=["no-limit", "far-under", "at-the-headroom", "at-the-limit", "over"])  # fmt: skip
def test_a_budget_at_the_limit_is_held_one_percent_under_it(budget: int, limit: int | None, aimed: int) -> None:
    held, note = peak_calibration.held_target(budget, limit)
    assert held == aimed and bool(note) == (aimed != budget)


def test_a_memory_limit_at_the_budget_calibrates_under_it_and_says_why(monkeypatch: pytest.MonkeyPatch,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """On the CPU a memory limit is what the process may hold: with the budget at it, the step is
    held 1% under it, the log says why, and the kept round's measured peak is under that target."""
    real = peak_calibration.measured_peak
    monkeypatch.setattr(peak_calibration, "measured_peak", lambda run, inputs: (int(real(run, inputs)[0] * 0.8), None))
    monkeypatch.setattr(peak_calibration, "MIN_REPLAN_GAIN", float("-inf"))  # re-plans, whatever the CPU's times
    work = models.cnn(batch_size=32)
    optimizer = torch.optim.Adam(work.model.parameters(), lr=1e-3)
    twin = copy.deepcopy(work.model)
    planned = mutwo.optimize(twin, torch.optim.Adam(twin.parameters(), lr=1e-3), work.batch, work.loss_fn,
                             budget=0.85, backend="eager", cache=False)  # fmt: skip
    assert planned.last is not None
    budget = planned.last.plan.budget_bytes  # 85% of the unoptimized peak, in bytes
    capsys.readouterr()
    step = mutwo.optimize(work.model, optimizer, work.batch, work.loss_fn, budget=budget, memory_limit=budget,
                          backend="inductor", calibrate_peak=2, verbose=True)  # fmt: skip
    said = capsys.readouterr()
    messages = (said.out + said.err).splitlines()
    calibration = step.last.calibration if step.last is not None else None
    assert calibration is not None and calibration.target_bytes == int(0.99 * budget)
    assert "1% under the" in calibration.target_note and "1% under the" in calibration.summary()
    assert any("holding the step to" in m and "from process to process" in m for m in messages)
    assert calibration.rounds[calibration.chosen].measured_peak_bytes <= calibration.target_bytes
    # The first plan was made for the window under the target, not for the budget at the limit.
    assert calibration.rounds[0].budget_bytes == peak_calibration.first_plan_aim(calibration.target_bytes)
    assert any("the first plan is made for" in m and "1% under the" in m for m in messages)


@pytest.mark.parametrize(("budget", "limit", "rounds", "first"), [
    ("1000B", 1000, 2, 952),  # at the limit: held to 990, its window's middle 990 - 14, over 1.025
    ("1200B", 1000, 1, 952),  # over it
    (None, 1000, 2, 952),  # no budget: select plans for the limit
    ("900B", 1000, 2, 865),  # under the headroom: held to 900, its window's middle 900 - 13, over 1.025
    ("1000B", 1000, 0, None),  # no calibration: nothing moves a plan's held memory under the limit
    ("0.9", 1000, 2, None),  # a fraction, resolved by select, which asks where to aim
    ("1000B", None, 2, None),  # no limit known
], ids=["at-the-limit", "over", "no-budget", "under", "no-rounds", "fraction", "no-limit"])  # fmt: skip
def test_a_calibrated_first_plan_aims_at_calibrations_window(budget: str | None, limit: int | None, rounds: int,
                                                             first: int | None) -> None:  # fmt: skip
    """A plan made for the target itself simulates at its top and its step holds more than it
    simulates: over the budget, or out of memory under a limit, and planned and compiled again. The
    first plan is made so that a step holding :data:`FIRST_PLAN_HELD_RATIO` times its simulated peak
    holds the middle of the window instead, and calibration still holds the step to what the budget
    asked allows."""
    ctx = PassContext()
    asked = parse_budget(budget) if budget is not None else None
    ctx.services["budget"] = asked
    if limit is not None:
        ctx.services["device_memory"] = limit
    line = peak_calibration.plan_first_at_window(ctx, rounds)
    if first is None:
        assert line is None and ctx.services["budget"] is asked and peak_calibration.ASKED_BUDGET not in ctx.services
    else:
        assert ctx.services["budget"] == Budget(bytes=first) and line is not None and "990.0" not in line
        assert ctx.services[peak_calibration.ASKED_BUDGET] == (asked.bytes if asked is not None else limit)


def test_a_fraction_at_the_limit_makes_its_first_plan_where_bytes_would(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """``budget=0.9`` with the memory limit at 90% of the unoptimized peak: the fraction resolves in
    select to the limit itself, where a plan simulates over calibration's target; select makes the
    first plan where a budget in bytes at the limit makes it, says so, and calibration holds the
    step to what the resolved fraction allows."""
    real = peak_calibration.measured_peak
    monkeypatch.setattr(peak_calibration, "measured_peak", lambda run, inputs: (int(real(run, inputs)[0] * 0.8), None))
    twin = models.cnn(batch_size=32)
    planned = mutwo.optimize(twin.model, torch.optim.Adam(twin.model.parameters(), lr=1e-3), twin.batch, twin.loss_fn,
                             budget=0.85, backend="eager", cache=False)  # fmt: skip
    assert planned.last is not None
    limit = int(0.9 * planned.last.plan.unoptimized_peak)
    work = models.cnn(batch_size=32)
    capsys.readouterr()
    step = mutwo.optimize(work.model, torch.optim.Adam(work.model.parameters(), lr=1e-3), work.batch, work.loss_fn,
                          budget=0.9, memory_limit=limit, backend="eager", calibrate_peak=1, cache=False,
                          verbose=True)  # fmt: skip
    said = capsys.readouterr()
    messages = (said.out + said.err).splitlines()
    calibration = step.last.calibration if step.last is not None else None
    assert calibration is not None and calibration.target_bytes == int(0.99 * limit)
    assert calibration.rounds[0].budget_bytes == peak_calibration.first_plan_aim(calibration.target_bytes)
    assert any("select: the first plan is made for" in m and "the budget 0.9 asks" in m for m in messages), messages


@pytest.mark.filterwarnings("ignore:mutwo. the planned step holds")  # over its target at the floor: expected
def test_a_first_plan_whose_aim_is_out_of_reach_is_kept_within_the_budget_asked(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """With the budget and the limit at the lowest peak recomputation reaches, the first plan's
    aim (in the window under 1% below the limit) is out of reach: select keeps the lowest
    plan, which is within the budget asked, says so, and calibration goes on from it (it used to
    refuse a budget that it could plan)."""
    real = peak_calibration.measured_peak
    monkeypatch.setattr(peak_calibration, "measured_peak", lambda run, inputs: (int(real(run, inputs)[0] * 0.8), None))
    work = models.cnn(batch_size=32)
    twin = copy.deepcopy(work.model)
    lowest = mutwo.optimize(twin, torch.optim.Adam(twin.parameters(), lr=1e-3), work.batch, work.loss_fn,
                            budget="min", backend="eager", cache=False)  # fmt: skip
    assert lowest.last is not None
    floor = lowest.last.plan.predicted_peak
    capsys.readouterr()
    step = mutwo.optimize(work.model, torch.optim.Adam(work.model.parameters(), lr=1e-3), work.batch, work.loss_fn,
                          budget=floor, memory_limit=floor, backend="eager", calibrate_peak=1, cache=False,
                          verbose=True)  # fmt: skip
    said = capsys.readouterr()
    messages = (said.out + said.err).splitlines()
    assert any("the first plan is made for" in m for m in messages)
    assert any("is out of reach; keeping the plan that peaks at" in m and "within the" in m for m in messages)
    calibration = step.last.calibration if step.last is not None else None
    assert calibration is not None and calibration.target_bytes == int(0.99 * floor)
    assert calibration.rounds[0].budget_bytes == peak_calibration.first_plan_aim(calibration.target_bytes)
    assert calibration.rounds[0].planned_peak_bytes <= floor


def test_a_plan_cache_hit_under_a_limit_says_no_first_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """A hit makes no plan (it rewrites with the entry's): the first plan's aim is said on the miss
    only, and the hit trains the plan the miss kept."""
    real = peak_calibration.measured_peak
    monkeypatch.setattr(peak_calibration, "measured_peak", lambda run, inputs: (int(real(run, inputs)[0] * 0.8), None))
    said = []
    for _ in range(2):
        work = models.cnn(batch_size=32)
        budget = 1_200_000  # bytes: under the unoptimized peak, over the lowest
        step = mutwo.optimize(work.model, torch.optim.Adam(work.model.parameters(), lr=1e-3), work.batch,
                              work.loss_fn, budget=budget, memory_limit=budget, backend="eager", calibrate_peak=1,
                              cache=tmp_path, verbose=True)  # fmt: skip
        out = capsys.readouterr()
        said.append((step.last.cache_hit if step.last is not None else None, out.out + out.err))
    (first_hit, first_log), (second_hit, second_log) = said
    assert first_hit is False and "the first plan is made for" in first_log
    assert second_hit is True and "the first plan is made for" not in second_log


def test_a_round_out_of_memory_planned_under_its_budget_steps_from_its_plan() -> None:
    """A budget over the peak with nothing recomputed plans nothing: stepping 10% down from the
    budget would plan the same graph again (and stop), so the step starts at the plan's peak."""
    failed = CalibrationRound(1000, 850, 1000, 850, out_of_memory=True)
    assert next_budget(1000, [failed]) == 750


def test_the_first_round_is_recorded_at_the_budget_its_plan_was_made_for() -> None:
    """Held 1% under a limit, calibration's target is under the budget the first plan was made
    for: that round is recorded (and the next budget moved) from the budget it was planned at."""
    plan_and_measure, budgets = compiled_step_keeping(1.0)
    calibration = calibrate(990, 1, plan_and_measure, target_note="1% under the limit", first_budget=1000)
    assert budgets[0] == 1000 and calibration.rounds[0].budget_bytes == 1000
    assert budgets[1] == 976  # 1000 held at 1000 moves by the gap to the window's middle, 990 - 14
    assert "(1% under the limit)" in calibration.summary()


def test_a_step_over_the_headroom_under_a_limit_is_warned_as_such() -> None:
    """Over the target held 1% under a limit the step still fits this process: the warning says
    another process may run out, and does not ask for a memory limit already set."""
    rounds = [CalibrationRound(1000, 1000, 995 * 2**20)]
    warning = peak_calibration.Calibration(990 * 2**20, rounds, [0], 0, target_note="1% under the limit").over_budget()
    assert warning is not None and "another process may run out of memory" in warning
    assert "memory_limit=" not in warning and "(1% under the limit)" in warning


def test_no_re_plans_given_means_none_after_running_out_of_memory() -> None:
    def plan_and_measure(budget: int) -> tuple[CalibrationRound, int]:
        return CalibrationRound(budget, budget, budget, out_of_memory=True), budget

    with pytest.raises(peak_calibration.CalibrationOutOfMemory, match=r"\(1 round\(s\)"):
        calibrate(1000, 0, plan_and_measure)


@pytest.mark.parametrize(("rounds", "device", "passes", "expected"), [
    (None, "cpu", "profile,select,rewrite", 0),  # the CPU holds what it allocates
    (None, "cuda", "profile,select,rewrite", peak_calibration.DEFAULT_ROUNDS),
    (None, "cuda", "profile,select-swap,insert-swap", peak_calibration.DEFAULT_ROUNDS),
    (None, "cuda", "profile,select{budget=0.5},rewrite", 0),  # the pass's own budget
    (None, "cuda", "profile", 0),
    (0, "cuda", "profile,select,rewrite", 0),
    (3, "cpu", "profile,select,rewrite", 3),
], ids=["cpu", "cuda", "cuda-swap", "pass-budget", "no-select", "zero", "given"])  # fmt: skip
def test_calibration_rounds_by_default(rounds: int | None, device: str, passes: str, expected: int) -> None:
    from mutwo.ir.registry import PassRegistry

    pipeline = PassRegistry().build_pipeline(passes)
    assert peak_calibration.calibration_rounds(rounds, torch.device(device), pipeline) == expected


def test_nothing_fits_keeps_the_lowest_peak() -> None:
    def plan_and_measure(budget: int) -> tuple[CalibrationRound, int]:
        return CalibrationRound(budget, budget, 2000 + budget // 100), budget

    with pytest.warns(UserWarning, match="100.0% over the budget"):
        calibration = calibrate(1000, 1, plan_and_measure)
    assert [r.budget_bytes for r in calibration.rounds] == [1000, 1]  # the budget never goes under 1 byte
    assert calibration.chosen == 1 and not calibration.within  # 2000 < 2010


def test_the_third_round_moves_by_the_slope_the_first_two_measured() -> None:
    """A step holding 0.35 bytes more per byte of budget (GPT-2 small's rows on the H100 held
    0.31-0.36): the gap alone moves the second plan too little (8% under), the slope between the
    two rounds brings the third within the window."""
    budgets: list[int] = []

    def plan_and_measure(budget: int) -> tuple[CalibrationRound, None]:
        budgets.append(budget)
        return CalibrationRound(budget, budget, 530 + int(0.35 * budget)), None

    calibration = calibrate(1000, 2, plan_and_measure)
    assert budgets == [1000, 1105, 1306] and calibration.within and calibration.chosen == 2
    # ResNet-152-cl at checkpointing's held memory on the H100 (MiB): 10,694 held 13,894, then
    # 7,334 held 9,776 (8.6% under): 1.225 held per budget, so the next plan is for 7,952
    rounds = [CalibrationRound(10694, 10672, 13894), CalibrationRound(7334, 7223, 9776)]
    assert next_budget(10694, rounds) == 7952
    # a slope outside the believable range (two plans alike) is not used: the gap alone
    flat = [CalibrationRound(1000, 1000, 880), CalibrationRound(1105, 1105, 880)]
    assert next_budget(1000, flat) == 1105 + 105
    # a slope under 0.3 is not believed (1135 + 105, not 1135 + 105 / 0.22), and one just above
    # moves at most three times the gap (an overshoot under a memory limit runs out of memory, and
    # fails a data-parallel run): 1100 + 3 x 103, not 1100 + 103 / 0.32
    assert next_budget(1000, [CalibrationRound(1000, 1000, 850), CalibrationRound(1135, 1135, 880)]) == 1240
    assert next_budget(1000, [CalibrationRound(1000, 1000, 850), CalibrationRound(1100, 1100, 882)]) == 1409
    # two budgets 0.1% apart: their slope is the measurements' noise, not used
    assert next_budget(1000, [CalibrationRound(1000, 1000, 850), CalibrationRound(1001, 1001, 880)]) == 1106
    # after running out of memory, the next plan stays above a budget that fitted
    fitted_then_failed = [CalibrationRound(1000, 1000, 960), CalibrationRound(1020, 1020, 1020, out_of_memory=True)]
    assert next_budget(1000, fitted_then_failed) == 1010


def test_the_next_budget_stays_between_a_fitting_round_and_one_over() -> None:
    """A step that held 1200 at a budget of 1000 and 770 (23% under) below it: each next plan lies
    between the largest budget that fitted and the smallest that did not, and the largest fitting
    round is kept; when no byte lies between them, the fitting budget comes back, measured
    already, and the rounds stop."""
    calls = []

    def plan_and_measure(budget: int) -> tuple[CalibrationRound, None]:
        calls.append(budget)
        return CalibrationRound(budget, budget, 1200 if budget >= 1000 else 770), None

    calibration = calibrate(1000, 5, plan_and_measure)
    assert calls == [1000, 785, 893, 946, 973, 986]
    assert calibration.chosen == 5 and not calibration.within
    assert next_budget(1000, [CalibrationRound(1000, 1000, 1200), CalibrationRound(999, 999, 770)]) == 999
    stopped = []

    def steep(budget: int) -> tuple[CalibrationRound, None]:
        stopped.append(budget)
        return CalibrationRound(budget, budget, 1200 if budget >= 1000 else 770 + budget - 990), None

    calibrate(1000, 5, steep)
    assert stopped[-1] != stopped[-2] and len(stopped) == len(set(stopped))  # no budget measured twice


def test_rounds_stop_once_the_step_recomputing_nothing_was_measured() -> None:
    """As on the H100 (BERT-base b64 at torch.compile 0.5's peak): the graph simulates 1100 with
    nothing recomputed and its compiled step measures 950, under the target of 1000 whatever the
    budget. The second round plans nothing; a third would plan nothing again, so it is not run."""
    calls = []

    def plan_and_measure(budget: int) -> tuple[CalibrationRound, None]:
        calls.append(budget)
        planned = min(budget, 1100)
        return CalibrationRound(budget, planned, 800 if budget < 1100 else 950, 1100), None

    messages: list[str] = []
    calibration = calibrate(1000, 5, plan_and_measure, messages.append)
    assert calls == [1000, 1185]  # 1185 plans nothing: the next budget (1228) would too
    assert any("with nothing recomputed, whose step was measured already" in m for m in messages)
    assert calibration.chosen == 1 and not calibration.within  # 950 is 5% under: the best there is
    # Without the unoptimized peak the rounds go on, as before.
    rounds = calibrate(1000, 2, lambda b: (CalibrationRound(b, min(b, 1100), 800 if b < 1100 else 950), None)).rounds
    assert [r.budget_bytes for r in rounds] == [1000, 1185, 1228]


def test_negative_rounds_are_refused() -> None:
    with pytest.raises(ValueError, match="rounds must be 0 or more"):
        calibrate(1000, -1, compiled_step_keeping(1.0)[0])


def test_an_inductor_step_on_the_cpu_is_replanned_and_the_kept_plan_reported(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The whole loop on a tiny MLP compiled by Inductor on the CPU: its measured peak is scaled down
    by 20% (as BERT's compiled steps peaked under their plans on the H100), so calibration must plan
    again with a larger budget, compile again, and report the kept round's plan."""
    real = peak_calibration.measured_peak
    monkeypatch.setattr(peak_calibration, "measured_peak", lambda run, inputs: (int(real(run, inputs)[0] * 0.8), None))
    monkeypatch.setattr(peak_calibration, "MIN_REPLAN_GAIN", float("-inf"))  # re-plans, whatever the CPU's times
    row = run_configuration(TINY_MLP, 512, "0.9", tmp_path, device="cpu", warmup=0, iterations=1,
                            backend="inductor", calibrate_peak=2)  # fmt: skip
    assert "error" not in row, row.get("error")
    rounds = row["calibration"]["rounds"]
    assert len(rounds) >= 2 and rounds[1]["budget_bytes"] > rounds[0]["budget_bytes"]
    kept = rounds[row["calibration"]["chosen_round"]]
    assert row["planned_peak_bytes"] == kept["planned_peak_bytes"]  # the row describes the kept plan
    assert kept["measured_peak_bytes"] <= 1.03 * row["calibration"]["target_bytes"]
    assert row["calibration_seconds"] >= 0 and row["iteration_ms"] > 0


def test_the_bench_harness_weighs_a_re_plan_before_compiling_it(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The experiment runner (bench/compare.py's rows) calibrates as ``optimize`` does: with every
    re-plan made not worth a compile, the first round, which fitted, is kept, and its rounds carry
    their plans' predicted times."""
    real = peak_calibration.measured_peak
    monkeypatch.setattr(peak_calibration, "measured_peak", lambda run, inputs: (int(real(run, inputs)[0] * 0.8), None))
    monkeypatch.setattr(peak_calibration, "MIN_REPLAN_GAIN", 1.0)
    row = run_configuration(TINY_MLP, 512, "0.9", tmp_path, device="cpu", warmup=0, iterations=1,
                            backend="inductor", calibrate_peak=2)  # fmt: skip
    assert "error" not in row, row.get("error")
    calibration = row["calibration"]
    assert len(calibration["rounds"]) == 1 and "under the 100% worth a compile" in calibration["stopped"]
    assert calibration["rounds"][0]["predicted_seconds"] > 0


def test_an_eager_step_is_calibrated_too(tmp_path: Path) -> None:
    """On CUDA the eager executor's process holds more than its simulated peak (the allocator's
    cached blocks), so calibration is not only for compiled steps; on the CPU it measures the
    allocated peak, which the simulated one matches, and keeps the first plan."""
    row = run_configuration(TINY_MLP, 64, "0.9", tmp_path, device="cpu", warmup=0, iterations=1, calibrate_peak=1)
    assert "error" not in row, row.get("error")
    assert row["calibration"]["rounds"][0]["measured_peak_bytes"] > 0


def test_mutwo_opt_keeps_the_calibrated_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """``mutwo-opt --calibrate-peak``: with the compiled step's measured peak scaled down by 20%, a
    second plan at a larger budget is made and kept; plan.json, final.ir.txt and summary.json
    describe that plan, and --check passes on it."""
    real = peak_calibration.measured_peak
    monkeypatch.setattr(peak_calibration, "measured_peak", lambda run, inputs: (int(real(run, inputs)[0] * 0.8), None))
    monkeypatch.setattr(peak_calibration, "MIN_REPLAN_GAIN", float("-inf"))  # re-plans, whatever the CPU's times
    out = tmp_path / "out"
    code = main(["-q", "--device", "cpu", "--backend", "inductor", "--budget", "0.85", "--calibrate-peak", "2",
                 "--check", "-o", str(out), str(TINY_MLP)])  # fmt: skip
    assert code == EXIT_OK, capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    calibration = summary["calibration"]
    assert len(calibration["rounds"]) >= 2 and calibration["chosen_round"] >= 1
    kept = calibration["rounds"][calibration["chosen_round"]]
    plan = json.loads((out / "plan.json").read_text())
    assert plan["budget_bytes"] == kept["budget_bytes"] and plan["predicted_peak"] == kept["planned_peak_bytes"]
    assert summary["equivalent"] is True
    # The step peaked under its plan, so the kept plan may simulate more than the first one did.
    assert kept["planned_peak_bytes"] >= calibration["rounds"][0]["planned_peak_bytes"]


@pytest.mark.parametrize(("argv", "words"), [
    (["--backend", "inductor", "--calibrate-peak", "-1"], "0 (none) or more"),
    (["--backend", "inductor", "--calibrate-peak", "2", "-p", "profile,select{budget=0.5},rewrite"],
     "give the budget with --budget"),
    (["--backend", "inductor", "--calibrate-peak", "2", "-p", "profile,select-swap{budget=0.5},insert-swap"],
     "select-swap{budget=...} overrides"),
    (["--backend", "inductor", "--calibrate-peak", "2", "-p", "profile"], "the pipeline runs neither"),
], ids=["negative-rounds", "select-budget-option", "select-swap-budget-option", "no-select"])  # fmt: skip
def test_calibrate_peak_refusals(argv: list[str], words: str, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    out = tmp_path / "out"
    code = main(["-q", "--device", "cpu", "-o", str(out), *argv, str(TINY_MLP)])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and len(err.splitlines()) == 1 and "Traceback" not in err
    assert "--calibrate-peak" in err and words in err
    assert not out.exists()


def test_a_swap_plan_is_calibrated_like_a_recompute_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """``optimize(passes="profile,select-swap{allow=swap},insert-swap", backend="inductor",
    calibrate_peak=2)``: every compiled step is made to measure 5% over the first budget, so
    select-swap plans again at a budget lowered by that gap; the kept plan swaps, and its graph
    passes the check."""
    work = models.cnn(batch_size=32)
    swap_only = "profile{runs=1,warmup=0},select-swap{allow=swap},insert-swap"

    def optimized(**calibration: Any) -> Any:
        return optimize_graph(work.model, torch.optim.Adam(work.model.parameters(), lr=1e-3), work.batch,
                              work.loss_fn, passes=swap_only, budget=parse_budget("0.9"), backend="inductor",
                              **calibration)  # fmt: skip

    first_budget = optimized().plan.budget_bytes
    monkeypatch.setattr(peak_calibration, "measured_peak", lambda run, inputs: (int(first_budget * 1.05), None))
    with pytest.warns(UserWarning, match="5.0% over the budget"):  # every round measures the same
        kept = optimized(calibrate_peak=2, check=True)
    calibration = kept.calibration
    assert calibration is not None and len(calibration.rounds) >= 2
    first, second = calibration.rounds[:2]
    aim = first_budget - int(peak_calibration.TOLERANCE * first_budget / 2)  # the middle of the window under it
    assert first.budget_bytes == first_budget and second.budget_bytes == first_budget + aim - int(first_budget * 1.05)
    assert kept.plan.of("swap") and any(node.target is OFFLOAD for node in kept.graph)
    assert kept.report is not None and kept.report.equivalent, kept.report


def test_the_api_keeps_the_calibrated_plan_and_trains_with_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """``mutwo.optimize(..., backend="inductor", calibrate_peak=2)``: the step it returns runs the
    kept round's graph, which passed the check; its rounds are on ``step.last.calibration``."""
    real = peak_calibration.measured_peak
    monkeypatch.setattr(peak_calibration, "measured_peak", lambda run, inputs: (int(real(run, inputs)[0] * 0.8), None))
    work = models.cnn(batch_size=32)
    optimizer = torch.optim.Adam(work.model.parameters(), lr=1e-3)
    step = mutwo.optimize(work.model, optimizer, work.batch, work.loss_fn, budget=0.85, backend="inductor",
                          calibrate_peak=2, check=True)  # fmt: skip
    optimized = step.last
    assert optimized is not None and optimized.calibration is not None
    assert len(optimized.calibration.rounds) >= 2 and optimized.calibration.chosen >= 1
    assert optimized.report is not None and optimized.report.equivalent
    assert optimized.step is not None and optimized.step.graph is optimized.graph
    assert optimized.plan.budget_bytes == optimized.calibration.rounds[optimized.calibration.chosen].budget_bytes
    assert torch.isfinite(step(work.batch))


def test_the_api_previews_a_re_plan_and_compiles_only_one_worth_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through ``optimize``: each round carries its plan's predicted time, and with every re-plan
    made not worth a compile (a gain of 100% asked) the rounds end after the first, which fitted,
    and the log says why; the previewed plan is not planned twice when it is compiled."""
    real = peak_calibration.measured_peak
    monkeypatch.setattr(peak_calibration, "measured_peak", lambda run, inputs: (int(real(run, inputs)[0] * 0.8), None))
    work = models.cnn(batch_size=32)

    def optimized(lines: list[str]) -> Any:
        model = copy.deepcopy(work.model)
        return optimize_graph(model, torch.optim.Adam(model.parameters(), lr=1e-3),
                              work.batch, work.loss_fn, budget=parse_budget("0.85"), backend="inductor",
                              calibrate_peak=2, log=lines.append)  # fmt: skip

    monkeypatch.setattr(peak_calibration, "MIN_REPLAN_GAIN", float("-inf"))  # every re-plan compiled, first
    lines: list[str] = []
    calibration = optimized(lines).calibration
    assert len(calibration.rounds) >= 2 and all(r.predicted_seconds is not None for r in calibration.rounds)
    planned = [line for line in lines if line.startswith("select: recompute")]
    assert len(planned) == len(calibration.rounds) + (calibration.chosen > 0), planned  # the kept one writes its files
    monkeypatch.setattr(peak_calibration, "MIN_REPLAN_GAIN", 1.0)
    lines = []
    calibration = optimized(lines).calibration
    assert len(calibration.rounds) == 1 and calibration.chosen == 0 and calibration.stopped
    assert any("under the 100% worth a compile); stopping" in line for line in lines), lines


def test_a_kept_round_planned_again_differently_trains_the_step_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kept round's passes run again to write their files; should planning give another graph
    (a profile an earlier round's slicing priced once made it, on the H100), the step trained is
    the one measured, and the log says the files do not describe it."""
    real = peak_calibration.measured_peak
    monkeypatch.setattr(peak_calibration, "measured_peak", lambda run, inputs: (int(real(run, inputs)[0] * 0.8), None))
    monkeypatch.setattr(peak_calibration, "same_plan", lambda graph, other: False)
    monkeypatch.setattr(peak_calibration, "MIN_REPLAN_GAIN", float("-inf"))  # re-plans, whatever the CPU's times
    lines: list[str] = []
    work = models.cnn(batch_size=32)
    optimized = optimize_graph(work.model, torch.optim.Adam(work.model.parameters(), lr=1e-3), work.batch,
                               work.loss_fn, budget=parse_budget("0.85"), backend="inductor", calibrate_peak=2,
                               log=lines.append)  # fmt: skip
    calibration = optimized.calibration
    assert calibration is not None and calibration.chosen >= 1
    assert optimized.graph is calibration.step.graph  # the measured round's, not the one planned again
    assert any("made another plan than round" in line for line in lines), lines


def test_a_budget_that_plans_the_same_graph_again_is_not_compiled_or_measured_again(
        monkeypatch: pytest.MonkeyPatch, evenly_timed: Callable[[ModuleType], None]) -> None:  # fmt: skip
    """The MLP's plan at 0.9 peaks 4.6% under its budget (one recompute frees a whole layer's
    activation), so each round raises the budget by the gap and plans the same graph: its compile
    (minutes on a real model) and its peak are known from the first round. Every op is priced
    alike: which plan a raised budget allows follows the profile's times, and measured ones on a
    loaded CI machine once made a cheaper plan fit the second round. A re-plan whose graph was
    measured already costs no compile, so the gain a compile must buy (:data:`MIN_REPLAN_GAIN`)
    does not stop the rounds."""
    real, measured = peak_calibration.measured_peak, []
    monkeypatch.setattr(peak_calibration, "measured_peak", lambda run, inputs: measured.append(1) or real(run, inputs))
    evenly_timed(captured)
    work = models.mlp(batch_size=512)
    optimized = optimize_graph(work.model, torch.optim.Adam(work.model.parameters(), lr=1e-3), work.batch,
                               work.loss_fn, passes="profile{runs=1,warmup=0},select,rewrite",
                               budget=parse_budget("0.9"), backend="inductor", calibrate_peak=2)  # fmt: skip
    rounds = optimized.calibration.rounds
    assert len(rounds) == 3 and len({r.budget_bytes for r in rounds}) == 3
    assert len({(r.planned_peak_bytes, r.measured_peak_bytes) for r in rounds}) == 1, "the same plan each round"
    assert len(measured) == 1, "the same graph was measured again"


def test_the_api_refuses_negative_calibration_rounds() -> None:
    work = models.mlp()
    with pytest.raises(ValueError, match="calibrate_peak takes the number of re-plans, 0"):
        mutwo.optimize(work.model, torch.optim.SGD(work.model.parameters(), lr=0.1), work.batch, work.loss_fn,
                       calibrate_peak=-1)  # fmt: skip


def test_mutwo_opt_says_in_one_line_when_every_round_ran_out_of_memory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """Under a memory limit, a budget whose every plan runs out of memory when measured is a user's
    error: one line naming a lower budget or a higher limit, no traceback, nothing written."""

    def out_of_memory(run: Any, inputs: Any) -> tuple[int, int | None]:
        raise torch.OutOfMemoryError("CUDA out of memory (made up by the test)")

    monkeypatch.setattr(peak_calibration, "measured_peak", out_of_memory)
    out = tmp_path / "out"
    code = main(["-q", "--device", "cpu", "--budget", "0.9", "--calibrate-peak", "1", "-o", str(out),
                 str(TINY_MLP)])  # fmt: skip
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "ran out of device memory" in err and "higher memory limit" in err
    assert not out.exists()


def test_a_plan_without_a_budget_in_bytes_is_not_calibrated() -> None:
    """``budget="min"`` or no budget: nothing in bytes to hold the step to; the step is kept as
    planned, not measured (which would record a CUDA graph once more) nor re-planned."""
    from types import SimpleNamespace

    from mutwo.ir.pass_manager import PassManager
    from mutwo.runtime.planning.peak_calibration import Calibrated, calibrated_step

    lines: list[str] = []
    context = SimpleNamespace(artifacts={"plan": SimpleNamespace(budget_bytes=0)}, services={})
    first = Calibrated(graph=None, compiled=None, ctx=context)  # type: ignore[arg-type]

    def never(*_: object) -> None:
        raise AssertionError("nothing is compiled or measured")

    kept = calibrated_step(2, PassManager([]), None, None, first, never, None, lines.append)  # type: ignore[arg-type]
    assert kept is first and kept.calibration is None
    assert lines == ["peak calibration: the plan has no budget in bytes to hold the step to; not calibrated"]


def test_no_calibration_by_default_without_a_budget() -> None:
    """Without a budget the step is planned for the whole device: calibrating it would only
    measure it, recording its CUDA graph once more; asked for, the rounds still run."""
    from mutwo.ir.registry import PassRegistry

    pipeline = PassRegistry().build_pipeline("profile,select,rewrite")
    cuda = torch.device("cuda")
    assert peak_calibration.calibration_rounds(None, cuda, pipeline, budgeted=False) == 0
    assert peak_calibration.calibration_rounds(2, cuda, pipeline, budgeted=False) == 2


def test_a_step_over_the_budget_that_no_lower_plan_reaches_says_so_not_to_re_plan() -> None:
    """A CUDA test's process held 1.2 GB of other tests' leftovers: its step held 75% over the
    budget, and the lower budget the next round needed was below what any plan reaches. More
    re-plans cannot help; the warning says what the process holds beyond the plan, and the fix."""

    def plan_and_measure(budget: int) -> tuple[CalibrationRound, int] | None:
        return (CalibrationRound(budget, budget, 1750), budget) if budget == 1000 else None

    with pytest.warns(UserWarning, match="no plan reaches"):
        calibration = calibrate(1000, 2, plan_and_measure)
    warning = calibration.over_budget()
    assert warning is not None and calibration.unreachable_bytes is not None
    assert "holds 1.7 KiB, 75.0% over the budget of 1.0 KiB" in warning, warning
    assert "the process holds 0.7 KiB beyond what the plan counts" in warning, warning
    assert "ask for a larger budget" in warning and "--calibrate-peak" not in warning
