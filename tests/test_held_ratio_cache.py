"""What a graph's compiled steps held over their simulated peaks, kept by the plan cache so that a
start at another budget aims its first plan with it (mutwo.runtime.planning.held_ratio_cache)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import pytest
import torch

import mutwo
import mutwo.runtime.planning.peak_calibration as peak_calibration
from mutwo.ir.budget import Budget, parse_budget
from mutwo.ir.pass_base import PassContext
from mutwo.runtime.planning.held_ratio_cache import KEPT_ROUNDS, HeldRatios, held_key, measured_ratios
from tests import models


def _round(planned: int, measured: int, out_of_memory: bool = False, sliced: bool = False) -> dict[str, Any]:
    return {"budget_bytes": planned, "planned_peak_bytes": planned, "measured_peak_bytes": measured,
            "out_of_memory": out_of_memory, "head_sliced": sliced}  # fmt: skip


def _key(**settings: Any) -> dict[str, Any]:
    base = {"budget": {"bytes": 100}, "memory_limit": 200, "backend": "inductor-cudagraphs", "calibration_rounds": 2,
            "measure_choice": False, "keep_grads": False, "precision": "fp32"}  # fmt: skip
    return {"format": 1, "graph": "g", "device": {"type": "cuda"}, "device_memory": 300,
            "settings": {**base, **settings}, "pipeline": [], "torch": "2", "mutwo": "0", "mutwo_source": "s"}


def test_the_key_leaves_out_what_sets_the_budget_and_keeps_what_changes_the_excess() -> None:
    same = held_key(_key())
    assert held_key(_key(budget={"bytes": 50}, memory_limit=None, calibration_rounds=1, measure_choice=True)) == same
    assert held_key({**_key(), "device_memory": 10}) == same
    for changed in ({"backend": "eager"}, {"keep_grads": True}, {"precision": "bf16"}):
        assert held_key(_key(**changed)) != same, changed
    assert held_key({**_key(), "graph": "other"}) != same


def test_only_measured_plausible_rounds_count_each_graph_once() -> None:
    calibration = {"rounds": [_round(1000, 1048), _round(1000, 0, out_of_memory=True), _round(1000, 3000),
                              _round(0, 5), _round(900, 830, sliced=True), _round(1000, 1048)]}  # fmt: skip
    assert measured_ratios(calibration) == [(1.048, False), (830 / 900, True)]
    assert measured_ratios(None) == [] and measured_ratios({"rounds": []}) == []


def test_the_first_plan_aims_with_head_whole_rounds_where_there_are_any(tmp_path: Path) -> None:
    """A sliced head's steps held 0.92 times their simulation where whole ones held 1.05 (BERT-base
    on the H200): the plan is made before chunk decides, and aiming for the larger ratio leaves a
    sliced step under the budget rather than a whole one over it."""
    store = HeldRatios(tmp_path, _key(), lambda line: None)
    store.keep({"rounds": [_round(1000, 920, sliced=True), _round(1100, 1012, sliced=True)]})
    assert store.ratio() == pytest.approx(0.92), "only sliced rounds: theirs"
    store.keep({"rounds": [_round(1000, 1050), _round(1000, 910, sliced=True)]})
    assert store.ratio() == pytest.approx(1.05)


def test_a_ratio_under_one_never_aims_over_the_windows_middle() -> None:
    assert peak_calibration.first_plan_aim(1000, 0.92) == peak_calibration.window_middle(1000)
    assert peak_calibration.first_plan_aim(1000, 1.05) == int(peak_calibration.window_middle(1000) / 1.05)
    ctx = PassContext()
    ctx.services["budget"], ctx.services["device_memory"] = parse_budget("900B"), 1000
    line = peak_calibration.plan_first_at_window(ctx, 2, held_ratio=0.92)
    assert ctx.services["budget"] == Budget(bytes=peak_calibration.window_middle(900)) and line is not None
    assert "a step holding its simulated peak (this graph's steps held -8.0% over theirs" in line


def test_kept_ratios_are_the_latest_rounds_and_their_median_aims(tmp_path: Path) -> None:
    lines: list[str] = []
    store = HeldRatios(tmp_path, _key(), lines.append)
    assert store.ratio() is None
    store.keep({"rounds": [_round(1000, 1040), _round(1000, 1050)]})
    assert store.ratio() == pytest.approx(1.045)
    other_budget = HeldRatios(tmp_path, _key(budget={"bytes": 70}), lines.append)
    assert other_budget.ratio() == pytest.approx(1.045), "another budget reads the same ratios"
    for _ in range(KEPT_ROUNDS):
        other_budget.keep({"rounds": [_round(1000, 1010)]})
    assert store.ratio() == pytest.approx(1.01), f"only the last {KEPT_ROUNDS} rounds are kept"
    assert HeldRatios(tmp_path, _key(backend="eager"), lines.append).ratio() is None
    assert lines == []


def test_a_corrupt_file_is_said_in_one_line_and_replaced(tmp_path: Path) -> None:
    lines: list[str] = []
    store = HeldRatios(tmp_path, _key(), lines.append)
    store.path.parent.mkdir(parents=True)
    store.path.write_text("{not json")
    assert store.ratio() is None
    [line] = lines
    assert line.startswith("plan cache: ignoring the kept held ratios ") and "JSONDecodeError" in line
    store.keep({"rounds": [_round(1000, 1030)]})
    assert store.ratio() == pytest.approx(1.03)


def test_an_unwritable_folder_is_said_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "held").write_text("a file where the folder would be")
    lines: list[str] = []
    HeldRatios(tmp_path, _key(), lines.append).keep({"rounds": [_round(1000, 1030)]})
    [line] = lines
    assert line.startswith(f"plan cache: could not keep the held ratios in {tmp_path} (")


@pytest.mark.parametrize(("budget", "aimed"), [("900B", 865), ("0.9", None)])
def test_the_first_plan_aims_with_a_kept_ratio(budget: str, aimed: int | None) -> None:
    """A budget in bytes aims with the ratio at once; a fraction hands it to select, which aims with
    it once the fraction is resolved."""
    ctx = PassContext()
    ctx.services["budget"], ctx.services["device_memory"] = parse_budget(budget), 1000
    line = peak_calibration.plan_first_at_window(ctx, 2, held_ratio=1.05)
    if aimed is not None:  # held to 900: its window's middle 887, over 1.05
        assert ctx.services["budget"] == Budget(bytes=int(887 / 1.05)) and line is not None
        assert "+5.0% over its simulated peak (as this graph's steps held in the calibrations the plan cache" in line
    else:
        assert line is None
        aim, why = ctx.services[peak_calibration.FIRST_PLAN_AIM](900)
        assert aim == int(887 / 1.05) and "+5.0% over its simulated peak" in why


def test_a_start_at_another_budget_aims_with_what_the_first_starts_steps_held(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Calibrated on the CPU with each step made to hold 1.2 times its plan's simulated peak (as
    a graph's CUDA-graph pool and allocator add to it on a GPU), a first start keeps its rounds'
    ratios; a start at another budget misses the plan cache and makes its first plan where a step
    holding that ratio lands in the window. (Whether it then does depends on how close to its aim
    the plan comes: this CNN's plans are a few coarse steps apart.)"""
    real_plan = peak_calibration.pipeline_plan
    measuring: list[Any] = []

    def plan_measured(artifacts: dict[str, Any]) -> Any:
        measuring.append(real_plan(artifacts))  # calibration reads the plan of each step it measures
        return measuring[-1]

    monkeypatch.setattr(peak_calibration, "pipeline_plan", plan_measured)
    monkeypatch.setattr(peak_calibration, "measured_peak", lambda run, inputs: (int(measuring[-1].predicted_peak * 1.2),
                                                                                None))  # fmt: skip
    twin = models.cnn(batch_size=32)
    planned = mutwo.optimize(twin.model, torch.optim.Adam(twin.model.parameters(), lr=1e-3), twin.batch, twin.loss_fn,
                             budget=0.85, backend="eager", cache=False)  # fmt: skip
    assert planned.last is not None
    peak = planned.last.plan.unoptimized_peak

    def start(share: float) -> Any:
        work = models.cnn(batch_size=32)
        step = mutwo.optimize(work.model, torch.optim.Adam(work.model.parameters(), lr=1e-3), work.batch,
                              work.loss_fn, budget=f"{int(share * peak)}B", memory_limit=f"{peak * 2}B",
                              backend="eager", calibrate_peak=2, cache=tmp_path, verbose=True)  # fmt: skip
        assert step.last is not None and step.last.calibration is not None and step.last.cache_hit is False
        return step.last.calibration

    first = start(1.1)
    ratios = [r.measured_peak_bytes / r.planned_peak_bytes for r in first.rounds if not r.out_of_memory]
    assert not any(r.head_sliced for r in first.rounds), "a CNN has no language-model head"
    assert ratios == [pytest.approx(1.2, abs=1e-5)] * len(ratios)
    assert len(first.rounds) >= 2, "aimed for 1.025, a step holding 1.2 times its plan is planned again"
    capsys.readouterr()
    second = start(1.0)
    err = capsys.readouterr().err
    ratio = statistics.median(ratios)
    assert second.rounds[0].budget_bytes == peak_calibration.first_plan_aim(second.target_bytes, ratio)
    assert "(as this graph's steps held in the calibrations the plan cache kept)" in err
