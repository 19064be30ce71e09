"""Capture: reference models at batch 2 on CPU, library compile-guards, and readable failures."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mutwo.ir import from_fx
from mutwo.ir.node import NodeKind, Phase
from mutwo.ir.verifier import verify
from mutwo.runtime.capture.iteration import capture
from mutwo.runtime.capture.tracing import CaptureError
from mutwo.runtime.execution.step import GraphStep
from tests import models


def _lower(workload: models.Workload, optimizer: torch.optim.Optimizer):
    captured, binding = capture(workload.model, optimizer, workload.batch, workload.loss_fn)
    graph = from_fx(captured.graph_module, [(s.kind, s.label) for s in captured.slots], captured.gradient_labels)
    verify(graph)
    return graph, GraphStep(graph, captured, binding)


def _first_loss_matches_eager(make: object, optimizer_name: str) -> None:
    mutwo_run, eager_run = make(), make()
    graph, step = _lower(mutwo_run, models.OPTIMIZERS[optimizer_name](mutwo_run.model.parameters()))
    assert {n.phase for n in graph} == set(Phase)
    torch.manual_seed(0)
    loss = step(mutwo_run.batch).loss
    torch.manual_seed(0)
    eager = models.eager_step(eager_run, models.OPTIMIZERS[optimizer_name](eager_run.model.parameters()))
    assert torch.equal(loss, eager)


@pytest.mark.slow
def test_resnet152_captures_and_lowers_at_batch_2() -> None:
    import torchvision

    def make() -> models.Workload:
        torch.manual_seed(0)
        net = torchvision.models.resnet152()
        batch = (torch.randn(2, 3, 224, 224), torch.randint(0, 1000, (2,)))
        return models.Workload(models.Classifier(net), batch, models.cross_entropy)

    _first_loss_matches_eager(make, "adam")


@pytest.mark.slow
@pytest.mark.parametrize("mask", [True, False], ids=["with-mask", "no-mask"])
def test_bert_base_masked_lm_captures_with_sdpa(mask: bool) -> None:
    from transformers import BertConfig, BertForMaskedLM

    def make() -> models.Workload:
        torch.manual_seed(0)
        model = BertForMaskedLM(BertConfig(attn_implementation="sdpa"))
        ids = torch.randint(0, model.config.vocab_size, (2, 64))
        batch = {"input_ids": ids, "labels": ids.clone()}
        if mask:
            batch["attention_mask"] = torch.ones(2, 64, dtype=torch.long)
        return models.Workload(model, batch, lambda output, _batch: output.loss)

    _first_loss_matches_eager(make, "adamw")


class _GuardedMask(nn.Module):
    """Like transformers' mask helpers: a data-dependent shortcut skipped when compiling."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling() and torch.all(mask == 1):
            return self.linear(x)
        return self.linear(x) * mask


def test_libraries_take_their_compile_path_while_capturing() -> None:
    model = _GuardedMask()
    batch = (torch.randn(3, 4), torch.ones(3, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    graph, _ = _lower(models.Workload(model, batch, lambda out, b: out.sum()), optimizer)
    assert any(n.op_name == "aten.mul.Tensor" and n.phase is Phase.FORWARD for n in graph)
    assert torch.compiler.is_compiling() is False  # restored after capture


class _DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        if y.sum() > 0:  # data-dependent control flow
            return y.relu()
        return y


def test_data_dependent_control_flow_fails_with_one_sentence_naming_the_line() -> None:
    model = _DataDependent()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(CaptureError) as info:
        capture(model, optimizer, (torch.randn(2, 4),), lambda out, b: out.sum())
    message = str(info.value)
    assert "data-dependent control flow" in message
    assert f"{__file__}:" in message and "if y.sum() > 0" in message
    assert "\n" not in message


def test_non_scalar_loss_is_refused() -> None:
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(CaptureError, match="scalar floating-point tensor"):
        capture(model, optimizer, (torch.randn(2, 4),), lambda out, b: out)


def test_an_inputs_and_labels_batch_for_a_model_that_takes_the_inputs_calls_model_inputs_and_loss_labels() -> None:
    model = nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = (torch.randn(2, 4), torch.randint(0, 3, (2,)))
    captured, _ = capture(model, optimizer, batch, nn.functional.cross_entropy)
    assert captured.call.sentence().startswith("mutwo: calling the model as model(batch[0]) and the loss as "
                                               "loss_fn(output, batch[1])")  # fmt: skip
    assert [s.label for s in captured.slots if s.kind is NodeKind.INPUT] == ["batch[0]", "batch[1]"]


def test_optimizer_over_foreign_tensors_is_refused() -> None:
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1)
    with pytest.raises(CaptureError, match="not a parameter of the model"):
        capture(model, optimizer, (torch.randn(2, 4),), lambda out, b: out.sum())


def test_frozen_parameters_get_no_gradient_and_no_update() -> None:
    workload = models.mlp()
    first = workload.model.net[0]
    first.weight.requires_grad_(False)
    before = first.weight.detach().clone()
    optimizer = torch.optim.Adam([p for p in workload.model.parameters() if p.requires_grad], lr=0.1)
    graph, step = _lower(workload, optimizer)
    gradients = {n.label for n in graph if n.kind is NodeKind.GRADIENT}
    assert "net.0.weight" not in gradients and "net.0.bias" in gradients
    step(workload.batch)
    assert torch.equal(first.weight, before)
