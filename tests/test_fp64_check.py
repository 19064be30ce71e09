"""A compiled step's check against an fp64 run of the original (docs/backends.md, Equivalence):
a tensor outside the direct tolerance passes when its error from fp64 is within torch's
accuracy runs' multiple of eager fp32's; a real error fails and is named; and where the fp64
run cannot serve as a reference, the check says so and the direct tolerance alone decides."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mutwo.ir.graph import Graph
from mutwo.ir.to_fx import to_fx
from mutwo.runtime.execution.backends import compile_graph
from mutwo.runtime.measurement import fp64_reference
from mutwo.runtime.measurement.equivalence import Tolerance, check_graphs, compare_graphs
from mutwo.runtime.planning.captured import CapturedGraph, capture_graph
from tests import models

OFFSET = 1e5


class OffsetRegression(nn.Module):
    """Predicts targets near 1e5: the loss's gradient, prediction minus target, cancels 1e5 against
    1e5, so eager fp32 keeps about two digits of it (fp32's spacing at 1e5 is 0.008)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
        with torch.no_grad():
            self.net[2].bias.fill_(OFFSET)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)


def _mse(output: torch.Tensor, batch: Any) -> torch.Tensor:
    return F.mse_loss(output, batch[1])


def _offset_regression(device: str = "cpu") -> CapturedGraph:
    torch.manual_seed(0)
    model = OffsetRegression().to(device)
    batch = (torch.randn(16, 8, device=device), OFFSET + torch.randn(16, device=device))
    return capture_graph(model, torch.optim.SGD(model.parameters(), lr=1e-3), batch, _mse)


def _computing_in_fp64(graph: Graph, dtype: torch.dtype = torch.float32) -> Callable[..., Any]:
    """A step that computes the iteration in float64 and stores its results in ``dtype`` (the
    graph's): more accurate than eager, so it differs from eager by eager's own rounding error."""
    wide = fp64_reference.widen(to_fx(graph))

    def run(*flat: torch.Tensor) -> list[torch.Tensor]:
        state = [fp64_reference.as_fp64(t) for t in flat]
        with fp64_reference.default_dtype(torch.float64):
            outputs = wide(*state)
        for mine, exact in zip(flat, state, strict=True):
            mine.copy_(exact)
        return [output.to(dtype) for output in outputs]

    return run


@pytest.fixture(scope="module")
def mlp_compiled() -> tuple[CapturedGraph, Callable[..., Any]]:
    """The MLP (with dropout) test_backends compiles too: a second compile comes from the cache."""
    workload = models.mlp(batch_size=8)
    lowered = capture_graph(workload.model, torch.optim.SGD(workload.model.parameters(), lr=0.1), workload.batch,
                            workload.loss_fn)  # fmt: skip
    return lowered, compile_graph(lowered.graph, lowered.inputs, "inductor").run


def test_an_inductor_step_passes_and_the_fp64_run_is_made(mlp_compiled: tuple[CapturedGraph, Any]) -> None:
    """Dropout's Bernoulli masks are the same in float64 on the CPU: the fp64 run is made."""
    lowered, run = mlp_compiled
    report = check_graphs(lowered.graph, lowered.graph, lowered.inputs, candidate_run=run, tolerance=Tolerance())
    assert report.equivalent and report.fp64_failure is None, report.summary()
    assert "torch._dynamo.utils.same's fp64 criterion" in report.summary()
    assert "by the direct rule" in report.summary()


def test_a_perturbed_gradient_fails_both_rules_and_is_named(mlp_compiled: tuple[CapturedGraph, Any]) -> None:
    lowered, run = mlp_compiled
    label = lowered.graph.output.args[0][2].label  # the second gradient returned

    def perturbed(*flat: torch.Tensor) -> list[torch.Tensor]:
        outputs = list(run(*flat))
        outputs[2] = outputs[2] * 1.01  # 1% off: far beyond both eager's and the compiled step's rounding
        return outputs

    report = check_graphs(lowered.graph, lowered.graph, lowered.inputs, candidate_run=perturbed, tolerance=Tolerance())
    assert not report.equivalent
    assert {(m.what, m.label) for m in report.mismatches} == {("gradient", label)}, report.summary()
    first = report.mismatches[0]
    assert first.fp64 is not None and first.fp64.startswith("RMSE from fp64: compiled")
    assert f"gradient {label} differs" in report.summary() and "RMSE from fp64" in report.summary()


def test_a_step_more_accurate_than_eager_fails_the_direct_rule_and_passes_by_fp64() -> None:
    """The ResNet-152 situation in small: eager fp32 is itself far from the exact result, so a step
    that rounds differently misses the direct tolerance, but it is no further from fp64 than eager."""
    lowered = _offset_regression()
    candidate = _computing_in_fp64(lowered.graph)
    direct = compare_graphs(lowered.graph, lowered.graph, lowered.inputs, candidate_run=candidate,
                            tolerance=Tolerance(fp64=False))  # fmt: skip
    assert not direct.equivalent and {m.what for m in direct.mismatches} >= {"gradient"}, direct.summary()
    report = compare_graphs(lowered.graph, lowered.graph, lowered.inputs, candidate_run=candidate,
                            tolerance=Tolerance())  # fmt: skip
    assert report.equivalent, report.summary()
    assert report.passed_by_fp64 == len(direct.mismatches)
    assert f"{report.passed_by_fp64} by the fp64 rule" in report.summary()


def test_the_fp64_rule_has_torchs_constants() -> None:
    big, small, one_by_one = torch.zeros(1000), torch.zeros(999), torch.zeros(64, 32, 1, 1)
    assert [fp64_reference.multiplier(t, 1e-3) for t in (big, small, one_by_one)] == [2.0, 3.0, 3.0]
    assert fp64_reference.multiplier(big.bfloat16(), 1e-3) == fp64_reference.multiplier(big, 2e-2) == 3.0
    exact = torch.linspace(-1, 1, 1000, dtype=torch.float64)
    eager = exact.float() + 1e-4
    judged = fp64_reference.verdict(eager, exact.float() + 2e-4, exact, rtol=1e-3, atol=1e-5)
    assert judged is not None and judged.allowed == pytest.approx(2 * 1e-4 + 1e-6, rel=1e-3) and judged.passed
    judged = fp64_reference.verdict(eager, exact.float() + 2.2e-4, exact, rtol=1e-3, atol=1e-5)
    assert judged is not None and not judged.passed


@pytest.mark.parametrize("size", [7, 1000, 100_003])
def test_dropouts_draw_the_same_masks_in_float64_on_the_cpu(size: int) -> None:
    """What lets the fp64 run keep a graph with dropout on the CPU (:data:`SAME_DRAWS_ON_CPU`)."""
    aten = torch.ops.aten
    draws = {aten.bernoulli_.float: lambda x: x.bernoulli_(0.9), aten.bernoulli.p: lambda x: aten.bernoulli.p(x, 0.9),
             aten.native_dropout.default: lambda x: aten.native_dropout(x, 0.1, True)[0]}  # fmt: skip
    assert set(draws) == fp64_reference.SAME_DRAWS_ON_CPU
    for draw in draws.values():
        masks = []
        for dtype in (torch.float32, torch.float64):
            torch.manual_seed(size)
            masks.append(draw(torch.ones(size, dtype=dtype)) != 0)
        assert torch.equal(*masks)


@torch.library.custom_op("mutwo_test::fp32_only", mutates_args=())
def fp32_only(x: torch.Tensor) -> torch.Tensor:
    """An op with a float32 kernel only, as some fused or quantized kernels are."""
    if x.dtype != torch.float32:
        raise RuntimeError(f"fp32_only is not implemented for {x.dtype}")
    return x * 2


@fp32_only.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class Prescaled(nn.Module):
    def __init__(self, noise: bool) -> None:
        super().__init__()
        self.linear, self.noise = nn.Linear(8, 4), noise

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        x = x + torch.randn_like(x) if self.noise else torch.ops.mutwo_test.fp32_only(x)
        return self.linear(x)


@pytest.mark.parametrize(("noise", "statement"), [
    (False, "the fp64 run of the original failed in iteration 0: RuntimeError: fp32_only is not implemented for "
            "torch.float64"),
    (True, "the fp64 run of the original not run: its random ops (aten.randn_like.default) need not draw the same "
           "numbers in float64 as in float32 on cpu"),
])  # fmt: skip
def test_without_an_fp64_reference_the_check_says_so_and_the_direct_rule_decides(noise: bool, statement: str) -> None:
    torch.manual_seed(0)
    model = Prescaled(noise)
    batch = (torch.randn(4, 8), torch.randint(0, 4, (4,)))
    lowered = capture_graph(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, models.cross_entropy)
    eager = to_fx(lowered.graph)
    report = compare_graphs(lowered.graph, lowered.graph, lowered.inputs, candidate_run=eager, tolerance=Tolerance())
    assert report.equivalent and statement in report.summary(), report.summary()
    assert "so the direct tolerance alone decided" in report.summary()

    def off(*flat: torch.Tensor) -> Any:
        loss, *gradients = eager(*flat)
        return [loss * 1.01, *gradients]

    report = compare_graphs(lowered.graph, lowered.graph, lowered.inputs, candidate_run=off, tolerance=Tolerance())
    assert [m.label for m in report.mismatches] == ["loss"] * 3
    assert report.mismatches[0].fp64 is not None and report.mismatches[0].fp64.startswith("no fp64 reference: ")


def test_a_bfloat16_graph_gets_its_fp64_run() -> None:
    """Reduced-precision parameters compute in float64 in the fp64 run, as in torch's accuracy runs."""
    workload = models.mlp(batch_size=8)
    workload.model.to(torch.bfloat16)
    batch = (workload.batch[0].bfloat16(), workload.batch[1])
    lowered = capture_graph(workload.model, torch.optim.SGD(workload.model.parameters(), lr=0.1), batch,
                            workload.loss_fn)  # fmt: skip
    report = compare_graphs(lowered.graph, lowered.graph, lowered.inputs,
                            candidate_run=_computing_in_fp64(lowered.graph, torch.bfloat16), tolerance=Tolerance())
    assert report.fp64_failure is None and report.equivalent and report.passed_by_fp64, report.summary()


@pytest.mark.cuda
def test_on_the_gpu_the_fp64_run_is_made_unless_the_graph_draws_random_numbers() -> None:
    lowered = _offset_regression("cuda")
    report = check_graphs(lowered.graph, lowered.graph, lowered.inputs,
                          candidate_run=_computing_in_fp64(lowered.graph), tolerance=Tolerance())  # fmt: skip
    assert report.equivalent and report.fp64_failure is None and report.passed_by_fp64, report.summary()
    workload = models.mlp(batch_size=8)  # with dropout
    model, batch = workload.model.cuda(), tuple(t.cuda() for t in workload.batch)
    lowered = capture_graph(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, workload.loss_fn)
    report = check_graphs(lowered.graph, lowered.graph, lowered.inputs, candidate_run=to_fx(lowered.graph),
                          tolerance=Tolerance())  # fmt: skip
    assert report.equivalent and "need not draw the same numbers in float64 as in float32 on cuda" in report.summary()
