"""The captured step with torch.optim's multi-tensor (foreach) form, which is the CUDA default.

On CPU it is asked for with ``foreach=True``; eager torch.optim then takes the same form, and the
captured step must train bitwise like it, with one multi-tensor update per bucket of parameters
instead of a dozen ops per parameter.
"""

from __future__ import annotations

import pytest
import torch

from mutwo.ir import from_fx
from mutwo.ir.verifier import verify
from mutwo.runtime.capture.iteration import capture
from mutwo.runtime.execution.step import GraphStep
from tests import models


def _foreach(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    for group in optimizer.param_groups:
        group["foreach"] = True
    return optimizer


def _step(workload: models.Workload, optimizer: torch.optim.Optimizer) -> GraphStep:
    captured, binding = capture(workload.model, optimizer, workload.batch, workload.loss_fn)
    graph = from_fx(captured.graph_module, [(s.kind, s.label) for s in captured.slots], captured.gradient_labels)
    verify(graph)
    return GraphStep(graph, captured, binding)


def _assert_same_training(mine: models.Workload, my_opt: torch.optim.Optimizer, eager: models.Workload,
                          eager_opt: torch.optim.Optimizer, step: GraphStep, iterations: int = 3) -> None:  # fmt: skip
    for iteration in range(iterations):
        torch.manual_seed(iteration)
        loss = step(mine.batch).loss
        torch.manual_seed(iteration)
        eager_loss = models.eager_step(eager, eager_opt)
        assert torch.equal(loss, eager_loss), f"loss differs at iteration {iteration}"
    for (name, p), (_, q) in zip(mine.model.named_parameters(), eager.model.named_parameters(), strict=True):
        assert torch.equal(p, q), name
        for key, value in eager_opt.state[q].items():
            assert torch.equal(my_opt.state[p][key], value), f"{name}: {key}"


@pytest.mark.parametrize("optimizer", sorted(models.OPTIMIZERS))
@pytest.mark.parametrize("make", [models.cnn, models.bert], ids=["cnn", "bert"])
def test_foreach_captured_step_trains_bitwise_like_eager_foreach(make: object, optimizer: str) -> None:
    mine, eager = make(), make()
    my_opt = _foreach(models.OPTIMIZERS[optimizer](mine.model.parameters()))
    eager_opt = _foreach(models.OPTIMIZERS[optimizer](eager.model.parameters()))
    step = _step(mine, my_opt)
    targets = {node.target for node in step.graph.nodes if node.op == "call_function"}
    assert any("foreach" in str(target) for target in targets), "the update must take the multi-tensor form"
    _assert_same_training(mine, my_opt, eager, eager_opt, step)


def test_foreach_graph_is_much_smaller_than_the_single_tensor_one() -> None:
    single, multi = models.bert(), models.bert()
    single_step = _step(single, models.OPTIMIZERS["adam"](single.model.parameters()))
    multi_step = _step(multi, _foreach(models.OPTIMIZERS["adam"](multi.model.parameters())))
    n_params = sum(1 for _ in single.model.parameters())

    def optimizer_ops(step: GraphStep) -> int:
        """Optimizer-phase ops that launch device work: not list-element getitems, nor the host
        numbers (a step size from a CPU step count) that torch.optim computes in Python per parameter."""
        return sum(1 for node in step.graph.nodes if node.phase.name == "OPTIMIZER" and node.op == "call_function"
                   and "getitem" not in str(node.target) and "host_scalar" not in str(node.target))  # fmt: skip

    assert optimizer_ops(multi_step) < 40 < 5 * n_params < optimizer_ops(single_step)


def _two_step_counts(make_optimizer: object) -> tuple[models.Workload, torch.optim.Optimizer]:
    """A workload whose optimizer has run 2 steps for its first parameter and 1 for the rest."""
    workload = models.cnn()
    optimizer = _foreach(make_optimizer(workload.model.parameters()))
    models.eager_step(workload, optimizer)
    first = next(workload.model.parameters())
    optimizer.state[first]["step"] += 1
    return workload, optimizer


def test_parameters_with_different_step_counts_stay_bitwise() -> None:
    """torch.optim's foreach Adam takes one bias correction per parameter: unequal step counts
    (at capture, and again after the state is replaced) train like eager."""
    mine, my_opt = _two_step_counts(models.OPTIMIZERS["adam"])
    eager, eager_opt = _two_step_counts(models.OPTIMIZERS["adam"])
    step = _step(mine, my_opt)
    _assert_same_training(mine, my_opt, eager, eager_opt, step)
    for workload, optimizer in ((mine, my_opt), (eager, eager_opt)):
        first = next(workload.model.parameters())
        optimizer.state[first]["step"] = optimizer.state[first]["step"] + 5
    _assert_same_training(mine, my_opt, eager, eager_opt, step)


class _WithUnusedParameter(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = torch.nn.Linear(4, 4)
        self.unused = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x).square().mean()


def test_a_parameter_without_gradient_is_not_stepped_and_does_not_trip_the_check() -> None:
    torch.manual_seed(0)
    model = _WithUnusedParameter()
    optimizer = _foreach(torch.optim.Adam(model.parameters(), lr=1e-2))
    batch = torch.randn(3, 4)
    captured, binding = capture(model, optimizer, batch, lambda output, _batch: output)
    graph = from_fx(captured.graph_module, [(s.kind, s.label) for s in captured.slots], captured.gradient_labels)
    step = GraphStep(graph, captured, binding)
    for _ in range(2):
        step(batch)
    steps = {name: float(optimizer.state[p]["step"]) for name, p in model.named_parameters()}
    assert steps == {"used.weight": 2.0, "used.bias": 2.0, "unused.weight": 0.0, "unused.bias": 0.0}
    # State replaced by equal values (as load_state_dict does): checked again, and still consistent.
    for p in model.parameters():
        optimizer.state[p]["step"] = optimizer.state[p]["step"].clone()
    step(batch)
    assert float(optimizer.state[model.used.weight]["step"]) == 3.0
