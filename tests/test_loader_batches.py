"""``for images, labels in loader`` with a model whose forward takes the images, as users write it:
the step calls ``model(images)`` and ``loss_fn(output, labels)``, trains bitwise like the eager
loop, and says how it called them (:mod:`mutwo.runtime.capture.batch_call`)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from mutwo.runtime.api import optimize
from mutwo.runtime.capture.batch_call import batch_call
from mutwo.runtime.capture.iteration import capture
from mutwo.runtime.capture.tracing import CaptureError
from mutwo.runtime.planning.step_planning import DEFAULT_PASSES
from tests.test_optim import bitwise_equal, first_difference

OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9, weight_decay=1e-4),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3),
}
PASSES = DEFAULT_PASSES.replace("profile", "profile{runs=1,warmup=0}", 1)  # the default pipeline, profiled once


def _loader(batches: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(2, 3, 32, 32, generator=generator), torch.randint(0, 10, (2,), generator=generator))
            for _ in range(batches)]  # fmt: skip


@pytest.mark.parametrize("name,budget", [("sgd", "min"), ("adam", None)])
def test_a_torchvision_model_trains_on_images_and_labels_bitwise_like_the_eager_loop(name: str,
                                                                                      budget: str | None) -> None:
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    eager = copy.deepcopy(model)
    optimizer, eager_optimizer = OPTIMIZERS[name](model.parameters()), OPTIMIZERS[name](eager.parameters())
    loader = _loader()
    step = optimize(model, optimizer, loader[0], F.cross_entropy, budget=budget, passes=PASSES)
    assert step.last is not None and step.last.captured.call.sentence() == (
        "mutwo: calling the model as model(batch[0]) and the loss as loss_fn(output, batch[1]) (an (inputs, labels) "
        "batch; ResNet.forward(x) takes the inputs)")  # fmt: skip
    if budget is not None:
        assert step.last.plan.entries, "the budget should make select recompute something"
    for index, (images, labels) in enumerate(loader):
        loss = step((images, labels))
        expected = F.cross_entropy(eager(images), labels)
        expected.backward()
        eager_optimizer.step()
        eager_optimizer.zero_grad()
        assert bitwise_equal(loss, expected.detach()), f"loss at step {index}"
        assert first_difference(model, optimizer, eager, eager_optimizer) is None
    for (buffer, mine), theirs in zip(model.named_buffers(), eager.buffers(), strict=True):
        assert bitwise_equal(mine, theirs), f"buffer {buffer}"


def test_the_model_takes_a_pair_whole_when_its_forward_takes_both() -> None:
    class Masked(nn.Module):
        def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
            return x

    call = batch_call(Masked(), (torch.ones(2), torch.zeros(2)))
    assert call.how == "whole"
    assert call.sentence() == ("mutwo: calling the model as model(*batch) and the loss as loss_fn(output, batch) "
                               "(Masked.forward(x, mask=...) gets batch[0] as x, batch[1] as mask)")  # fmt: skip


class _Keywords(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class _Three(_Keywords):
    def forward(self, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.linear(x + y + z)


@pytest.mark.parametrize("model,inputs,called", [
    (_Keywords, {"x": torch.ones(2, 4)}, "model(**batch[0])"),
    (_Three, (torch.ones(2, 4), torch.ones(2, 4), torch.ones(2, 4)), "model(*batch[0])"),
])  # fmt: skip
def test_inputs_that_are_a_dict_or_a_tuple_are_passed_as_keywords_or_spread(model: type[nn.Module], inputs: object,
                                                                            called: str) -> None:  # fmt: skip
    net = model()
    batch = (inputs, torch.randint(0, 3, (2,)))
    captured, _ = capture(net, torch.optim.SGD(net.parameters(), lr=0.1), batch, F.cross_entropy)
    assert f"as {called} and the loss as loss_fn(output, batch[1])" in captured.call.sentence()


def test_a_batch_that_fits_no_way_names_forward_and_the_ways() -> None:
    model = nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = (torch.randn(2, 4), torch.randint(0, 3, (2,)), torch.ones(2))
    with pytest.raises(CaptureError) as info:
        capture(model, optimizer, batch, lambda out, b: F.cross_entropy(out, b[1]))
    message = str(info.value)
    assert message.startswith("Linear.forward(input) cannot take the batch (too many positional arguments): the "
                              "batch is a 3-element tuple or list, passed as model(*batch); an (inputs, labels) "
                              "pair would be passed as model(inputs) with loss_fn(output, labels)")  # fmt: skip
    assert "wrap the model" in message and "\n" not in message


def test_a_loss_written_for_the_whole_batch_is_told_it_gets_the_labels() -> None:
    model = nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = (torch.randn(2, 4), torch.randint(0, 3, (2,)))
    with pytest.raises(CaptureError) as info:
        capture(model, optimizer, batch, lambda out, b: F.cross_entropy(out, b[1]))
    message = str(info.value)
    assert message.endswith("the batch is (inputs, labels) and the model takes the inputs, so the loss is called "
                            "as loss_fn(output, batch[1]), with the labels (F.cross_entropy works as it is)")
    assert "\n" not in message


def test_optimize_says_how_it_called_the_model(capsys: pytest.CaptureFixture[str]) -> None:
    """``verbose=True`` logs how the model and the loss took an (inputs, labels) batch."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 4))
    batch = (torch.randn(4, 8), torch.randint(0, 4, (4,)))
    optimize(net, torch.optim.SGD(net.parameters(), lr=0.1), batch, F.cross_entropy,
             verbose=True)  # fmt: skip
    assert "calling the model as model(batch[0]) and the loss as loss_fn(output, batch[1])" in capsys.readouterr().err
