"""Random ops under Inductor draw what eager draws (docs/backends.md, "Random numbers"): issue 40's
TinyLM (MultiheadAttention, SDPA and F.dropout) passes ``mutwo-opt --check --backend inductor``;
the other random ops a step may hold, on the layouts Inductor changed; the rewrite itself, run
eagerly; the refusal of an op that cannot be drawn so; and the check's message naming random
numbers as a possible cause. Two Inductor compiles in all (tens of seconds each on 2 cores)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import mutwo
from mutwo.ir.to_fx import to_fx
from mutwo.runtime.execution.backends import BackendError, compile_graph
from mutwo.runtime.execution.compiled_random import draw_as_eager
from mutwo.runtime.measurement.equivalence import EquivalenceReport, Mismatch, compare_graphs, random_ops
from mutwo.runtime.planning.captured import capture_graph
from mutwo.tools.mutwo_opt import main
from tests import models, tinylm

TINYLM = Path(__file__).with_name("tinylm.py")


def test_tinylm_passes_the_check_under_inductor(tmp_path: Path) -> None:
    """Issue 40: the loss differed at the first step and the check failed on a ``pos`` gradient:
    the mask of the dropout after MultiheadAttention, drawn eagerly into a transposed buffer, was
    drawn compiled in another order (without the rewrite, 89 mismatches here)."""
    config = tmp_path / "tinylm.yaml"
    config.write_text(f"model: {{source: python, name: '{TINYLM}:tinylm'}}\nbatch_size: 4\n"
                      "optimizer: {name: sgd, lr: 0.1}\n", encoding="utf-8")  # fmt: skip
    out = tmp_path / "out"
    code = main(["-q", "--check", "--backend", "inductor", "--device", "cpu", "-p", "profile{runs=1,warmup=0}",
                 "-o", str(out), str(config)])  # fmt: skip
    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    assert code == 0 and summary["equivalent"] is True, summary.get("error")


class RandomOps(nn.Module):
    """Each random op a step may hold, on the layouts where Inductor laid out otherwise than eager
    (a transposed and a channels-last tensor), each output weighing differently in the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 6, 5))
        self.w4 = nn.Parameter(torch.randn(2, 3, 4, 5))

    def forward(self, x: torch.Tensor, x4: torch.Tensor) -> torch.Tensor:
        t = (x * self.w).transpose(0, 1)
        cl = (x4 * self.w4).contiguous(memory_format=torch.channels_last)
        drawn = [
            F.dropout(t, 0.2, True), F.alpha_dropout(t, 0.2, True), F.dropout2d(cl, 0.5, True),
            F.scaled_dot_product_attention(cl, cl, cl, dropout_p=0.3),
            torch.bernoulli(t.sigmoid()), torch.empty_like(t).bernoulli_(t.sigmoid().detach()) * t,
            torch.rand_like(cl) * cl, torch.randn_like(cl) * cl, torch.randint_like(cl, 10) * cl,
            torch.empty_like(cl).normal_() * cl, torch.empty_like(t).exponential_() * t,
            torch.rand(3, 4) * self.w4[0, 0, :3, :4],
        ]  # fmt: skip
        return sum(out.sum() * (i + 1) for i, out in enumerate(drawn))  # type: ignore[return-value]


def _random_ops_workload() -> models.Workload:
    torch.manual_seed(0)
    return models.Workload(RandomOps(), (torch.randn(8, 6, 5), torch.randn(2, 3, 4, 5)), lambda out, _batch: out)


def test_random_ops_draw_under_inductor_what_eager_draws() -> None:
    workload = _random_ops_workload()
    optimizer = torch.optim.SGD(workload.model.parameters(), lr=0.1)
    step = mutwo.optimize(workload.model, optimizer, workload.batch, workload.loss_fn, check=True, backend="inductor")
    report = step.last.report
    assert report is not None and report.equivalent, report.summary()


def test_the_rewrite_draws_what_the_captured_step_draws() -> None:
    """Run eagerly, the rewritten step draws every number the captured one draws, in its place
    (loss, gradients, updated parameters and generator bitwise): a Bernoulli mask drawn into a
    contiguous buffer in memory order is the mask eager draws into the transposed one."""
    model, batch, loss_fn = tinylm.tinylm(batch_size=2)
    lowered = capture_graph(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, loss_fn)
    rewritten = to_fx(lowered.graph)
    draw_as_eager(rewritten, lowered.graph, lowered.inputs, "inductor")
    permuted = [n for n in rewritten.graph.nodes if n.target is torch.ops.aten.permute.default
                and getattr(n.args[0].target, "overloadpacket", None) is torch.ops.aten.bernoulli_]  # fmt: skip
    assert permuted, "no mask was drawn into a transposed buffer: the test would not exercise the rewrite"
    report = compare_graphs(lowered.graph, lowered.graph, lowered.inputs, candidate_run=rewritten)
    assert report.bitwise and report.equivalent, report.summary()


def test_a_random_op_inductor_may_draw_otherwise_is_refused_in_one_sentence() -> None:
    class Noisy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.poisson(self.linear(x).exp())

    model = Noisy()
    lowered = capture_graph(model, torch.optim.SGD(model.parameters(), lr=0.1), (torch.randn(3, 4),),
                            lambda out, _batch: out.sum())  # fmt: skip
    with pytest.raises(BackendError, match=r"^the inductor backend cannot draw the random numbers of %\d+ "
                                           r"\(aten\.poisson\.default\) as eager does: [^.]*; use --backend eager"):
        compile_graph(lowered.graph, lowered.inputs, "inductor")


def test_a_mismatch_in_a_step_with_random_ops_says_random_numbers_may_be_the_cause() -> None:
    mismatch = Mismatch(0, "gradient", "pos", 0.00199, 0.0124)
    report = EquivalenceReport(3, bitwise=False, mismatches=[mismatch], random_ops={"aten.bernoulli_.float": 7})
    assert report.summary().endswith(
        "first: iteration 0: gradient pos differs (max |diff| 0.00199, |values| up to 0.0124); the step draws random "
        "numbers (7 aten.bernoulli_.float), which may be the cause: a draw in another place changes every number "
        "computed from it; the same check with every dropout probability at 0 tells")  # fmt: skip
    assert "random" not in EquivalenceReport(3, bitwise=True, mismatches=[mismatch]).summary()


def test_a_step_that_draws_another_count_of_random_numbers_is_told_so() -> None:
    """A candidate drawing one number more than the original: its masks and the generator's state
    differ, and the message says the random numbers differ, not only that they may."""
    workload = models.mlp()
    lowered = capture_graph(workload.model, torch.optim.SGD(workload.model.parameters(), lr=0.1), workload.batch,
                            workload.loss_fn)  # fmt: skip
    assert random_ops(lowered.graph) == {"aten.bernoulli_.float": 1}
    module = to_fx(lowered.graph)

    def one_more_draw(*flat: torch.Tensor) -> object:
        torch.rand(1)
        return module(*flat)

    report = compare_graphs(lowered.graph, lowered.graph, lowered.inputs, candidate_run=one_more_draw)
    assert not report.equivalent and "random generator" in {m.what for m in report.mismatches}
    assert "; random numbers differ: the steps drew different counts of them (the generator states differ after " \
           "iteration 0; random ops: 1 aten.bernoulli_.float)" in report.summary()  # fmt: skip
