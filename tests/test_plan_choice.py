"""The measured choice between select-swap's plan and recompute only (:mod:`mutwo.runtime.planning.plan_choice`),
through mutwo-opt and the API, on the CPU under Inductor: with copies priced free, select-swap's
plan swaps; which plan ran faster is made so by scaling the measured times (the CPU's own would
decide by noise)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import mutwo
import mutwo.runtime.planning.captured as captured
import mutwo.runtime.planning.plan_choice as plan_choice
from mutwo.ir.registry import PassRegistry
from mutwo.ir.timeline import TransferModel
from mutwo.runtime.planning.plan_choice import RECOMPUTE_ONLY, SWAP_AND_RECOMPUTE, recompute_only_passes
from mutwo.tools.mutwo_opt import EXIT_OK, EXIT_USAGE, main
from tests import models

REPO = Path(__file__).resolve().parent.parent
TINY_MLP = REPO / "examples" / "tiny_mlp.yaml"
FREE_COPIES = TransferModel(1e13, 1e13, 0.0, overlap=True, device="cpu")


@pytest.fixture
def faster(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch,
           evenly_timed: Callable[[ModuleType], None]) -> Iterator[str]:  # fmt: skip
    """Copies priced free and every node at 1 ms (so that select-swap's plan swaps, whatever this
    machine's load: its swaps must be predicted 1% faster than recompute only), and the candidate
    named by the test's parameter measured 3x faster."""
    monkeypatch.setattr(captured, "measure_transfers", lambda device: FREE_COPIES)
    evenly_timed(captured)
    measured = plan_choice.measure_iterations
    seconds = {SWAP_AND_RECOMPUTE: 3.0, RECOMPUTE_ONLY: 3.0, request.param: 1.0}
    order = iter([SWAP_AND_RECOMPUTE, RECOMPUTE_ONLY])  # the order the choice measures its candidates in

    def scaled(run: Any, inputs: list[torch.Tensor], **kwargs: Any) -> Any:
        result = measured(run, inputs, **kwargs)
        return type(result)(seconds[next(order)], result.peak_bytes, result.runs)

    monkeypatch.setattr(plan_choice, "measure_iterations", scaled)
    yield request.param


@pytest.mark.parametrize("faster", [RECOMPUTE_ONLY, SWAP_AND_RECOMPUTE], indirect=True)
def test_mutwo_opt_keeps_the_plan_measured_faster(faster: str, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    out = tmp_path / "out"
    code = main(["-q", "--device", "cpu", "--backend", "inductor", "--budget", "0.85", "-p", "profile,swap",
                 "--measure-choice", "--check", "-o", str(out), str(TINY_MLP)])  # fmt: skip
    assert code == EXIT_OK, capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    choice = summary["measured_choice"]
    assert choice["kept"] == faster
    assert [c["plan"] for c in choice["candidates"]] == [SWAP_AND_RECOMPUTE, RECOMPUTE_ONLY]
    assert choice["candidates"][0]["swapped_tensors"] > 0 and choice["candidates"][1]["swapped_tensors"] == 0
    assert (out / "swap_plan.json").exists()  # select-swap's plan, kept or not
    # the kept plan's files: plan.json and clones.json of recompute only, or select-swap's clones
    assert (out / "plan.json").exists() == (faster == RECOMPUTE_ONLY)
    final = (out / "final.ir.txt").read_text()
    if faster == RECOMPUTE_ONLY:  # clones.json is the kept plan's, no longer select-swap's
        clones = json.loads((out / "clones.json").read_text())
        assert sum(len(c) for c in clones.values()) == summary["cloned_nodes"], (clones, summary["cloned_nodes"])
    assert ("offload" in final) == (faster == SWAP_AND_RECOMPUTE)  # the kept plan's graph was written and checked
    assert summary["equivalent"] is True


@pytest.mark.parametrize(("argv", "words"), [
    (["-p", "profile,swap"], "use the inductor, inductor-cudagraphs or cudagraphs backend"),
    (["--backend", "inductor", "-p", "profile,select,rewrite"], "runs no select-swap"),
    (["--backend", "inductor", "-p", "profile,select-swap{budget=min},insert-swap"], "'min' gives each its own"),
    (["--fit", "1GiB", "--backend", "inductor"], "--measure-choice would go unused"),
])  # fmt: skip
def test_mutwo_opt_refuses_a_measured_choice_it_cannot_make(argv: list[str], words: str, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    out = tmp_path / "out"
    code = main(["-q", "--device", "cpu", "--budget", "0.85", "--measure-choice", *argv, "-o", str(out),
                 str(TINY_MLP)])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert code == EXIT_USAGE and words in err and len(err.splitlines()) == 1, err
    assert not out.exists()  # nothing half-written


@pytest.mark.parametrize("faster", [RECOMPUTE_ONLY], indirect=True)
def test_the_api_trains_with_the_plan_measured_faster(faster: str) -> None:
    work = models.mlp(batch_size=512)
    optimizer = torch.optim.Adam(work.model.parameters(), lr=1e-3)
    step = mutwo.optimize(work.model, optimizer, work.batch, work.loss_fn, budget=0.85, passes="profile,swap",
                          backend="inductor", measure_choice=True, check=True)  # fmt: skip
    optimized = step.last
    assert optimized is not None and optimized.choice is not None and optimized.choice["kept"] == faster
    assert "plan" in optimized.context.artifacts and optimized.step is not None
    assert optimized.step.graph is optimized.graph and optimized.report is not None and optimized.report.equivalent
    assert torch.isfinite(step(work.batch))


@pytest.mark.parametrize("faster", [RECOMPUTE_ONLY], indirect=True)
def test_a_kept_recompute_only_plan_keeps_the_gradients_the_caller_reads(faster: str) -> None:
    """With optimizer-in-backward and keep_grads, the recompute-only plan the choice makes keeps
    the gradients too (it is planned in a context that says the caller reads them)."""
    work = models.mlp(batch_size=512)
    optimizer = torch.optim.Adam(work.model.parameters(), lr=1e-3)
    step = mutwo.optimize(work.model, optimizer, work.batch, work.loss_fn, budget=0.85,
                          passes="profile,optimizer,swap", backend="inductor", measure_choice=True,
                          keep_grads=True)  # fmt: skip
    assert step.last is not None and step.last.choice is not None and step.last.choice["kept"] == faster
    step(work.batch)
    assert all(p.grad is not None for p in work.model.parameters())


def test_a_candidate_that_ran_out_of_memory_is_not_kept() -> None:
    measured = [{"plan": SWAP_AND_RECOMPUTE, "error": "out of memory"},
                {"plan": RECOMPUTE_ONLY, "iteration_ms": 9.0, "peak_bytes": 120}]  # fmt: skip
    assert plan_choice.choose_measured(measured, 100) == 1
    assert plan_choice.choose_measured(measured[:1], 100) is None


def test_the_recompute_only_pipeline_keeps_select_swaps_budget_and_the_other_passes() -> None:
    passes = PassRegistry().build_pipeline("profile,optimizer,select-swap{budget=0.6,fused=false},insert-swap")
    names = [p.name for p in recompute_only_passes(passes)]
    assert names == ["optimizer-in-backward", "foreach-buckets", "select", "extract", "insert-recompute",
                     "share-gathers"]  # fmt: skip
    assert recompute_only_passes(passes)[2].budget == "0.6"


@pytest.mark.cuda
def test_cuda_mutwo_opt_measures_the_choice_under_inductor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """On the GPU, with copies priced free (so that select-swap's plan swaps): both plans are
    compiled and calibrated, measured one after the other, the kept one passes --check and is
    measured; both peaks are measured. (A config's optimizer is not capturable, so mutwo-opt
    refuses the CUDA-graph backends for it; tests/test_experiment.py's CUDA test runs the choice
    under inductor-cudagraphs.)"""
    monkeypatch.setattr(captured, "measure_transfers", lambda device: TransferModel(1e13, 1e13, 0.0, True, str(device)))
    out = tmp_path / "out"
    code = main(["-q", "--device", "cuda", "--backend", "inductor", "--budget", "0.85", "-p",
                 "profile,swap", "--calibrate-peak", "1", "--measure-choice", "--check", "-o", str(out),
                 str(TINY_MLP)])  # fmt: skip
    assert code == EXIT_OK, capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    choice = summary["measured_choice"]
    assert choice["kept"] in (SWAP_AND_RECOMPUTE, RECOMPUTE_ONLY), choice
    assert all(c["peak_bytes"] > 0 and c["iteration_ms"] > 0 for c in choice["candidates"]), choice
    assert summary["equivalent"] is True and "calibration" in summary


@pytest.mark.parametrize("measure", [False, True])
def test_select_swap_hints_at_the_measured_choice_only_when_it_is_not_made(
        measure: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, evenly_timed: Callable[[ModuleType], None],
        capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    monkeypatch.setattr(captured, "measure_transfers", lambda device: FREE_COPIES)
    evenly_timed(captured)
    code = main(["--device", "cpu", "--backend", "inductor", "--budget", "0.85", "-p", "profile,swap",
                 *(["--measure-choice"] if measure else []), "-o", str(tmp_path / "out"), str(TINY_MLP)])  # fmt: skip
    err = capsys.readouterr().err
    assert code == EXIT_OK, err
    assert ("--measure-choice (measure_choice=True) measures both" in err) != measure, err


@pytest.mark.parametrize("faster", [RECOMPUTE_ONLY], indirect=True)
@pytest.mark.filterwarnings("ignore:mutwo. the planned step holds")  # the CPU's peaks are not the point here
def test_under_a_limit_the_recompute_only_plan_is_first_made_for_calibrations_window(
        faster: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:  # fmt: skip
    """Under a memory limit at the budget, both candidates' calibrations start from a plan made for
    the window under the target (1% under the limit), as the first plan does: a plan for the target
    itself would run out of memory under the limit. The kept recompute-only plan's
    files are written from the plan it kept."""
    import mutwo.runtime.planning.peak_calibration as peak_calibration

    real = peak_calibration.measured_peak
    monkeypatch.setattr(peak_calibration, "measured_peak", lambda run, inputs: (int(real(run, inputs)[0] * 0.8), None))
    work = models.mlp(batch_size=512)
    twin = models.mlp(batch_size=512)
    planned = mutwo.optimize(twin.model, torch.optim.Adam(twin.model.parameters(), lr=1e-3), twin.batch, twin.loss_fn,
                             budget=0.85, backend="eager", cache=False)  # fmt: skip
    assert planned.last is not None
    budget = planned.last.plan.budget_bytes
    step = mutwo.optimize(work.model, torch.optim.Adam(work.model.parameters(), lr=1e-3), work.batch, work.loss_fn,
                          budget=budget, memory_limit=budget, passes="profile,swap", backend="inductor",
                          measure_choice=True, calibrate_peak=1, cache=False, out_dir=tmp_path)  # fmt: skip
    optimized = step.last
    assert optimized is not None and optimized.choice is not None and optimized.choice["kept"] == faster
    calibration = optimized.calibration
    assert calibration is not None and calibration.target_bytes == int(0.99 * budget)
    target = calibration.target_bytes
    aim = peak_calibration.first_plan_aim(target)
    assert aim < target - int(peak_calibration.TOLERANCE * target / 2)  # under the window's middle
    assert calibration.rounds[0].budget_bytes == aim  # the recompute-only candidate's own calibration
    assert (tmp_path / "plan.json").exists()
