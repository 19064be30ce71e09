"""The equivalence check's own rules: when it compares bit for bit, and what it says when it cannot."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from mutwo.ir.to_fx import to_fx
from mutwo.runtime.capture.training import TrainingOptions
from mutwo.runtime.measurement import equivalence
from mutwo.runtime.measurement.equivalence import EquivalenceReport, _varies_between_runs
from mutwo.runtime.planning.captured import capture_graph
from tests import models


def test_a_reference_that_varies_between_runs_is_named() -> None:
    """A graph whose output differs between two runs from the same state (a kernel that is not
    deterministic on the device) is caught before a bitwise comparison would blame the rewrite."""
    counter = itertools.count()

    def varying(*state: torch.Tensor) -> tuple[torch.Tensor, ...]:
        state[0].add_(1)
        return torch.tensor(float(next(counter))), state[0] * 2

    def steady(*state: torch.Tensor) -> tuple[torch.Tensor, ...]:
        state[0].add_(1)
        return state[0].sum(), state[0] * 2

    inputs = [torch.ones(3)]
    names: dict[str, Any] = {"output_names": ["loss", "gradient w"], "input_names": ["w"]}
    assert _varies_between_runs(varying, inputs, 0, **names) == "loss (max |diff| 1)"  # type: ignore[arg-type]
    assert _varies_between_runs(steady, inputs, 0, **names) is None  # type: ignore[arg-type]
    assert torch.equal(inputs[0], torch.ones(3)), "the probe runs on clones"


def test_the_summary_says_why_a_check_is_not_bitwise() -> None:
    report = EquivalenceReport(3, bitwise=False, compared=10, reference_varies="gradient w (max |diff| 1e-06)")
    assert "not bitwise because the original itself varies from run to run (gradient w" in report.summary()


def _noisy_to_fx(noise: dict[int, float]) -> Any:
    """``to_fx`` whose modules add ``noise[graph id]`` times a fresh count to the loss: a reference
    that is not deterministic run to run, as some GPU kernels are even in deterministic mode."""
    counter = itertools.count(1)

    def build(graph: Any) -> Any:
        module = to_fx(graph)

        def run(*state: torch.Tensor) -> Any:
            loss, *rest = module(*state)
            return (loss + noise[id(graph)] * next(counter), *rest)

        return run

    return build


@pytest.mark.parametrize(("candidate_noise", "equivalent"), [(1e-3, True), (1e-1, False)])
def test_a_varying_reference_bounds_the_candidate_by_its_own_variation(
        monkeypatch: pytest.MonkeyPatch, candidate_noise: float, equivalent: bool) -> None:  # fmt: skip
    """Off the CPU, a reference that varies by itself is compared within tolerances or within a few
    times its own variation (:data:`REFERENCE_SPREAD`; 1e-3 is beyond the tolerances), and the report
    says so."""
    lowered = capture_graph(*_mlp_with_sgd())
    reference, candidate = lowered.graph, lowered.graph.copy()
    monkeypatch.setattr(equivalence, "to_fx", _noisy_to_fx({id(reference): 1e-3, id(candidate): candidate_noise}))
    monkeypatch.setattr(equivalence, "device_of", lambda inputs: torch.device("meta"))
    report = equivalence.compare_graphs(reference, candidate, lowered.inputs, bitwise=True)
    assert report.reference_varies is not None and report.reference_varies.startswith("loss")
    assert not report.bitwise and report.equivalent is equivalent, report.summary()


@pytest.mark.parametrize(("shift_in_lr", "equivalent"), [(1.5, True), (3.0, False)])
def test_a_varying_reference_allows_adam_its_learning_rate_sized_answer_to_noise(
        monkeypatch: pytest.MonkeyPatch, shift_in_lr: float, equivalent: bool) -> None:  # fmt: skip
    """Adam moves a parameter whose gradient is rounding noise by up to the learning rate either way,
    so when the original itself varies (bf16 BERT on the H100), an Adam-updated parameter may differ
    by up to twice the learning rate, each iteration from the reference's state, and no more."""
    workload = models.mlp()
    model = workload.model.eval()
    lr = 1e-3
    lowered = capture_graph(model, torch.optim.Adam(model.parameters(), lr=lr), workload.batch, workload.loss_fn)
    reference, candidate = lowered.graph, lowered.graph.copy()
    parameters = [i for i, p in enumerate(candidate.placeholders) if p.kind.value == "parameter"]
    counter = itertools.count(1)

    def noisy(graph: Any) -> Any:
        module = to_fx(graph)

        def run(*state: torch.Tensor) -> Any:
            loss, *rest = module(*state)
            if graph is candidate:  # moved by a multiple of the (scheduled) learning rate
                scheduled = float(state[next(i for i, p in enumerate(graph.placeholders) if p.label.startswith("lr:"))])
                for i in parameters:
                    state[i].add_(shift_in_lr * scheduled)
            return (loss + 1e-7 * next(counter), *rest)  # the reference varies in the loss only

        return run

    monkeypatch.setattr(equivalence, "to_fx", noisy)
    monkeypatch.setattr(equivalence, "device_of", lambda inputs: torch.device("meta"))
    report = equivalence.compare_graphs(reference, candidate, lowered.inputs, bitwise=True)
    assert report.reference_varies is not None and report.tolerance is not None
    assert report.equivalent is equivalent, report.summary()
    assert equivalent or all(m.what == "parameter" for m in report.mismatches), report.summary()
    assert "2.0 x lr" in report.summary()


def _mlp_with_sgd() -> tuple[Any, ...]:
    workload = models.mlp()
    model = workload.model.eval()  # no dropout: the graphs differ only by the injected noise
    return model, torch.optim.SGD(model.parameters(), lr=0.1), workload.batch, workload.loss_fn


@pytest.mark.parametrize(("precision", "expected"), [("fp32", (equivalence.CUDA_RTOL, equivalence.CUDA_ATOL)),
                                                     ("bf16-autocast", (1.6e-2, 1e-5)),
                                                     ("fp16-autocast", (1e-3, 1e-5))])  # fmt: skip
def test_tolerances_follow_the_graphs_lowest_precision(precision: str, expected: tuple[float, float]) -> None:
    """When not bitwise, a graph that computes in bf16 or fp16 is compared with torch.testing's
    tolerances for that dtype, and the summary states them."""
    lowered = capture_graph(*_mlp_with_sgd(), TrainingOptions(precision=precision))
    assert equivalence.tolerances(lowered.graph) == expected
    report = EquivalenceReport(3, bitwise=False, rtol=expected[0], atol=expected[1])
    assert f"rtol={expected[0]:g}, atol={expected[1]:g}" in report.summary()
