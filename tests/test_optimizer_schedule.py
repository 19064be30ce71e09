"""Optimizer-in-backward and foreach buckets: the optimizer step rescheduled, trained bitwise like eager.

Each optimized step is run next to eager torch.optim training from identical copies of the
model and optimizer, for 3 iterations, and compared bitwise (loss, parameters, optimizer state).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from mutwo.ir.memory import MemorySimulation
from mutwo.ir.node import NodeKind, Phase
from mutwo.ir.optimizer_updates import analyse
from mutwo.ir.pass_base import PassContext
from mutwo.passes.optimizer_in_backward import OptimizerInBackwardPass
from mutwo.passes.optimizer_schedule import ScheduleOutcome, change, raised_peak
from mutwo.runtime.api import Optimized, optimize_graph
from mutwo.runtime.capture.training import TrainingOptions
from mutwo.runtime.execution.step import GraphStep
from mutwo.tools.mutwo_opt import main
from tests import models

PASSES = {
    "optimizer-in-backward": "optimizer-in-backward{when=always,group_bytes=1KiB}",
    "foreach-buckets": "foreach-buckets{when=always,max_bytes=1KiB}",
}


def _with_unused_parameter(seed: int = 0) -> models.Workload:
    """The tiny MLP with a parameter the loss never reaches: it gets no gradient and no update."""
    workload = models.mlp(seed)
    torch.manual_seed(seed)
    workload.model.unused = nn.Linear(3, 3)
    return workload


def _optimizer(workload: models.Workload, name: str, foreach: bool) -> torch.optim.Optimizer:
    optimizer = models.OPTIMIZERS[name](workload.model.parameters())
    for group in optimizer.param_groups:
        group["foreach"] = foreach
    return optimizer


def _optimize(workload: models.Workload, optimizer: torch.optim.Optimizer, passes: str) -> Optimized:
    return optimize_graph(workload.model, optimizer, workload.batch, workload.loss_fn, passes=passes)


def _train_side_by_side(mine: models.Workload, my_opt: torch.optim.Optimizer, optimized: Optimized,
                        eager: models.Workload, eager_opt: torch.optim.Optimizer) -> None:  # fmt: skip
    step = GraphStep(optimized.graph, optimized.captured, optimized.binding)
    for iteration in range(3):
        torch.manual_seed(iteration)
        loss = step(mine.batch).loss
        torch.manual_seed(iteration)
        assert torch.equal(loss, models.eager_step(eager, eager_opt)), f"loss differs at iteration {iteration}"
        for group in (*my_opt.param_groups, *eager_opt.param_groups):
            group["lr"] *= 0.5  # as a scheduler would: the rate is a graph input
    for (name, p), (_, q) in zip(mine.model.named_parameters(), eager.model.named_parameters(), strict=True):
        assert torch.equal(p, q), name
        if not eager_opt.state[q]:  # no gradient: capture sets up its state, which stays zero
            assert all(not torch.any(value) for value in my_opt.state[p].values()), name
        for key, value in eager_opt.state[q].items():
            assert torch.equal(my_opt.state[p][key], value), f"{name}: {key}"


@pytest.mark.parametrize("optimizer", sorted(models.OPTIMIZERS))
@pytest.mark.parametrize(("pass_name", "foreach"), [("optimizer-in-backward", False), ("optimizer-in-backward", True),
                                                    ("foreach-buckets", True)])  # it splits multi-tensor ops only
def test_rescheduled_optimizer_trains_bitwise_like_eager(pass_name: str, foreach: bool, optimizer: str) -> None:
    mine, eager = _with_unused_parameter(), _with_unused_parameter()
    my_opt, eager_opt = _optimizer(mine, optimizer, foreach), _optimizer(eager, optimizer, foreach)
    optimized = _optimize(mine, my_opt, PASSES[pass_name])
    outcome = optimized.context.artifacts[pass_name]
    assert outcome.applied, outcome.reason
    if pass_name == "optimizer-in-backward":  # an update now runs before the last backward node
        phases = [node.phase.value for node in optimized.graph.nodes]
        assert phases.index("optimizer") < len(phases) - 1 - phases[::-1].index("backward")
        assert optimized.graph.output.args[0][1:] == (), "the gradients are freed, not returned"
    else:
        assert sum(1 for n in optimized.graph.nodes if "foreach" in n.op_name) > sum(
            1 for n in optimized.original.nodes if "foreach" in n.op_name), "the multi-tensor ops are split"
    _train_side_by_side(mine, my_opt, optimized, eager, eager_opt)


def test_optimizer_in_backward_lowers_tiny_gpt2_peak_by_freeing_the_gradients() -> None:
    """Tiny GPT-2's peak is late in the backward, where most gradients are already made: updating
    each parameter as its gradient is final frees them there (the peak was in the optimizer step,
    all gradients live, only while a dead division per parameter ran there: no longer traced)."""
    workload = models.gpt2()
    optimizer = torch.optim.Adam(workload.model.parameters(), lr=1e-3)
    optimized = _optimize(workload, optimizer, "memory,optimizer-in-backward,memory")
    outcome = optimized.context.artifacts["optimizer-in-backward"]
    assert outcome.applied, outcome.reason
    gradient_bytes = sum(p.numel() * p.element_size() for p in workload.model.parameters())
    assert outcome.details["freed_gradient_bytes"] == gradient_bytes
    # The peak sums the tied embedding's two gradients, the backward's last: by then every other
    # parameter is updated and its gradient freed.
    tied = workload.model.transformer.wte.weight
    assert outcome.peak_before - outcome.peak_after >= gradient_bytes - tied.numel() * tied.element_size()
    assert optimized.context.artifacts["memory"].peak_bytes == outcome.peak_after


def test_a_small_model_s_peaks_read_apart_not_as_zero_mib() -> None:
    """A peak before and after is written in one unit that tells the two apart, and a small size
    in KiB (each once read '0.0 MiB' or '0.1 MiB')."""
    kib = 2**10
    outcome = ScheduleOutcome(True, "", 120 * kib, 100 * kib, {"moved_parameters": 2, "freed_gradient_bytes": 20 * kib})
    assert OptimizerInBackwardPass()._applied(outcome) == ("2 parameter updates run in the backward, 20.0 KiB of "
                                                           "gradients freed after their update; simulated peak "
                                                           "120.0 KiB -> 100.0 KiB")  # fmt: skip
    assert change(3 * 2**20, 3 * 2**20 + 4 * kib) == "3,072.0 KiB -> 3,076.0 KiB"
    before, after = (MemorySimulation("cpu", [], 0, peak, 0, 0, "optimizer", {}) for peak in (90 * kib, 100 * kib))
    assert raised_peak(before, after) == "it would raise the simulated peak from 90.0 KiB to 100.0 KiB"


def test_optimizer_in_backward_keeps_gradients_when_asked() -> None:
    workload = models.mlp()
    optimizer = models.OPTIMIZERS["adam"](workload.model.parameters())
    optimized = _optimize(workload, optimizer, "optimizer-in-backward{keep_grads=true,when=always}")
    outcome = optimized.context.artifacts["optimizer-in-backward"]
    assert not outcome.applied and "keep_grads" in outcome.reason
    assert len(optimized.graph.output.args[0]) == 1 + sum(1 for _ in workload.model.parameters())


def test_optimizer_in_backward_says_why_a_global_gradient_dependence_stops_it() -> None:
    """A node of the optimizer phase that combines two parameters' gradients (as norm clipping or
    a GradScaler inf check do) makes every update wait for the whole backward."""
    workload = models.mlp()
    optimizer = models.OPTIMIZERS["sgd"](workload.model.parameters())
    graph = _optimize(workload, optimizer, "stats").graph
    gradients = [node for node in graph.nodes if node.kind is NodeKind.GRADIENT]
    pair = next((a, b) for a in gradients for b in gradients
                if a is not b and a.tensors[0].shape == b.tensors[0].shape)  # fmt: skip
    first_update = next(node for node in graph.nodes if node.phase is Phase.OPTIMIZER)
    graph.create_node("call_function", torch.ops.aten.add.Tensor, pair, name="mix", phase=Phase.OPTIMIZER,
                      tensors=(pair[0].tensors[0],), before=first_update)  # fmt: skip
    assert analyse(graph).mixing()[0][1] == frozenset(node.label for node in pair)
    outcome = OptimizerInBackwardPass(when="always").run(graph, PassContext())
    assert not outcome.applied
    assert "combines the gradients of 2 parameters" in outcome.reason and "clipping" in outcome.reason


@pytest.mark.parametrize("foreach", [False, True], ids=["single-tensor", "foreach"])
def test_optimizer_in_backward_does_not_apply_under_gradient_norm_clipping(foreach: bool) -> None:
    """Clipping scales every gradient by a factor read from all of them, in the backward phase:
    no gradient is final before the backward ends, and the pass says so rather than "moving"
    updates that free nothing."""
    workload = models.mlp()
    optimizer = _optimizer(workload, "adam", foreach)
    optimized = optimize_graph(workload.model, optimizer, workload.batch, workload.loss_fn,
                               passes="optimizer-in-backward{when=always}",
                               training=TrainingOptions(max_grad_norm=1.0))  # fmt: skip
    outcome = optimized.context.artifacts["optimizer-in-backward"]
    assert not outcome.applied
    assert "gradient-norm clipping" in outcome.reason or "combines the gradients" in outcome.reason, outcome.reason


@pytest.mark.parametrize(("passes", "message"), [
    ("optimizer-in-backward{when=sometimes}", "when must be one of lower, always, not 'sometimes'"),
    ("optimizer-in-backward{group_bytes=1}", "group_bytes: '1' is not a memory size: give bytes with a unit"),
    ("foreach-buckets{max_bytes=0.5}", "max_bytes: '0.5' is not a memory size: give bytes with a unit"),
])  # fmt: skip
def test_bad_options_are_usage_errors(passes: str, message: str, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    example = Path(__file__).resolve().parents[1] / "examples" / "tiny_mlp.yaml"
    assert main([str(example), "--passes", passes, "-o", str(tmp_path / "out"), "-q"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_a_budget_out_of_reach_in_the_optimizer_step_points_to_the_optimizer_passes() -> None:
    """The advice names a pipeline (which mutwo-opt's -p and optimize(passes=...) both take), not a
    flag of one tool."""
    from mutwo.ir.budget import parse_budget
    from mutwo.ir.pass_manager import PipelineFailure

    workload = models.mlp()  # its peak is in the optimizer step: few activations, Adam's state
    optimizer = torch.optim.AdamW(workload.model.parameters(), lr=1e-3)
    with pytest.raises(PipelineFailure) as failure:
        optimize_graph(workload.model, optimizer, workload.batch, workload.loss_fn,
                       passes="profile{runs=1,warmup=0},select,rewrite", budget=parse_budget("0.5"))  # fmt: skip
    assert "the peak is in the optimizer step" in str(failure.value)
    assert "the optimizer passes can: plan with the pipeline profile,optimizer,select,rewrite" in str(failure.value)
