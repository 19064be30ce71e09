"""Capture -> IR -> verify -> GraphModule trains bitwise like eager torch.optim on CPU."""

from __future__ import annotations

import pytest
import torch

from mutwo.ir import from_fx
from mutwo.ir.verifier import verify
from mutwo.runtime.capture.iteration import capture
from mutwo.runtime.execution.step import GraphStep
from tests import models

WORKLOADS = {"mlp": models.mlp, "cnn": models.cnn, "bert": models.bert}


def _state_dicts_equal(a: dict, b: dict) -> list[str]:
    diffs = []
    for key, value in a.items():
        other = b[key]
        if isinstance(value, torch.Tensor):
            if not torch.equal(value, other):
                diffs.append(key)
        elif isinstance(value, dict):
            diffs += [f"{key}.{d}" for d in _state_dicts_equal(value, other)]
        elif value != other:
            diffs.append(key)
    return diffs


@pytest.mark.parametrize("optimizer", sorted(models.OPTIMIZERS))
@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_graph_trains_bitwise_like_eager(workload: str, optimizer: str) -> None:
    mutwo_run, eager_run = WORKLOADS[workload](), WORKLOADS[workload]()
    mutwo_opt = models.OPTIMIZERS[optimizer](mutwo_run.model.parameters())
    eager_opt = models.OPTIMIZERS[optimizer](eager_run.model.parameters())
    captured, binding = capture(mutwo_run.model, mutwo_opt, mutwo_run.batch, mutwo_run.loss_fn)
    graph = from_fx(captured.graph_module, [(s.kind, s.label) for s in captured.slots], captured.gradient_labels)
    verify(graph)
    step = GraphStep(graph, captured, binding)
    names = [n for n, _ in eager_run.model.named_parameters()]
    for iteration in range(3):
        if iteration == 2:  # a scheduler's change of learning rate between iterations
            for opt in (mutwo_opt, eager_opt):
                for group in opt.param_groups:
                    group["lr"] *= 0.3
        torch.manual_seed(1000 + iteration)
        out = step(mutwo_run.batch)
        torch.manual_seed(1000 + iteration)
        eager_loss = models.eager_step(eager_run, eager_opt)
        assert torch.equal(out.loss, eager_loss), f"loss differs at iteration {iteration}"
        eager_params = dict(eager_run.model.named_parameters())
        for name in names:
            assert torch.equal(out.gradients[name], eager_params[name].grad), f"gradient of {name} at {iteration}"
        assert not _state_dicts_equal(mutwo_run.model.state_dict(), eager_run.model.state_dict()), iteration
        assert not _state_dicts_equal(mutwo_opt.state_dict()["state"], eager_opt.state_dict()["state"]), iteration
    # The run must really have trained: parameters moved away from their initial values.
    assert not torch.equal(next(mutwo_run.model.parameters()), next(WORKLOADS[workload]().model.parameters()))
