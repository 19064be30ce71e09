"""Everything is planned in ``optimize()`` (issue 40): every graph the training loop will run
that is known in advance (gradient accumulation's first, middle and last micro-batches, the step
after the one in which the optimizer creates its state) is captured and planned before it
returns, leaving the model and the optimizer as they were; a budget one of them cannot reach is
refused there. Also what a user sees around a step: a check that passed says so, and
``loss.backward()`` after ``step(batch)`` says that the step already ran it.

Compared bitwise with the eager loop each stands for (CPU), as tests/test_training.py does.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable

import pytest
import torch
from torch import nn

from mutwo.ir.pass_manager import PipelineFailure
from mutwo.runtime import api
from mutwo.runtime.api import BACKWARD_AFTER_STEP, optimize
from tests.test_optim import bitwise_equal
from tests.test_training import _batches, _loss, _Net, _plain, _same

Optimizer = Callable[[nn.Module], torch.optim.Optimizer]


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _twins(make_optimizer: Optimizer = _adamw, warm: bool = True) -> tuple[tuple[nn.Module, torch.optim.Optimizer],
                                                                            tuple[nn.Module, torch.optim.Optimizer]]:
    """Two identical models and optimizers; ``warm``: after one eager step each, so that the
    optimizer state exists and optimize() has state to leave alone."""
    torch.manual_seed(0)
    mine = _Net()
    eager = copy.deepcopy(mine)
    pairs = (mine, make_optimizer(mine)), (eager, make_optimizer(eager))
    if warm:
        for model, optimizer in pairs:
            torch.manual_seed(100)
            _plain(model, optimizer, _batches(1)[0])
            optimizer.zero_grad(set_to_none=True)
    return pairs


def _captures_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """From here on, a capture (of a graph not planned up front) fails the test."""

    def refused(*args: object, **kwargs: object) -> None:
        raise AssertionError("a graph was captured in the training loop, not in optimize()")

    monkeypatch.setattr(api, "optimize_graph", refused)


def _trains_like_the_eager_loop(step: api.MutwoStep, batches: list[tuple[torch.Tensor, torch.Tensor]],
                                mine: tuple[nn.Module, torch.optim.Optimizer],
                                eager: tuple[nn.Module, torch.optim.Optimizer], k: int) -> None:  # fmt: skip
    """Each batch through ``step`` and through the eager loop of ``(loss / k).backward()``
    stepping every k-th: the same loss each call, the same state after each optimizer step."""
    (model, optimizer), (eager_model, eager_optimizer) = mine, eager
    for index, batch in enumerate(batches):
        torch.manual_seed(index)
        loss = step(batch)
        torch.manual_seed(index)
        expected = _loss(eager_model(batch[0]), batch)
        (expected / k if k > 1 else expected).backward()
        if (index + 1) % k == 0:
            eager_optimizer.step()
            eager_optimizer.zero_grad(set_to_none=True)
            _same(model, optimizer, eager_model, eager_optimizer)
        assert bitwise_equal(loss, expected.detach()), f"loss at call {index}"


@pytest.mark.parametrize("k", [2, 3])
def test_every_micro_batch_is_planned_in_optimize_which_leaves_the_state_as_it_was(
        k: int, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    (mine, my_opt), (eager, eager_opt) = _twins()
    batches = _batches(2 * k + 1)
    step = optimize(mine, my_opt, batches[0], _loss, passes="stats", accumulation_steps=k)
    _same(mine, my_opt, eager, eager_opt)  # bitwise: parameters, buffers, optimizer state
    assert all(p.grad is None for p in mine.parameters())
    assert sorted(key[-1] for key in step.steps) == sorted(["first", "last"] + (["middle"] if k > 2 else []))
    first = next(found for key, found in step.steps.items() if key[-1] == "first")
    assert step.last is first[0][0], "the graph the first call runs"
    assert step.micro == "first" and not step.accumulated, "the stand-ins for the accumulated gradients are gone"

    _captures_refused(monkeypatch)
    _trains_like_the_eager_loop(step, batches, (mine, my_opt), (eager, eager_opt), k)


@pytest.mark.parametrize("k", [1, 2], ids=["plain", "accumulating"])
def test_the_graph_after_the_optimizer_creates_its_state_is_planned_up_front(
        k: int, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """SGD with dampening creates its momentum buffer in its first step: the graph of the steps
    after it reads the buffer, and is planned in optimize() too, with the buffer not created yet."""

    def sgd(model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, dampening=0.5)

    (mine, my_opt), (eager, eager_opt) = _twins(sgd, warm=False)
    batches = _batches(3 * k)
    step = optimize(mine, my_opt, batches[0], _loss, passes="stats", accumulation_steps=k)
    assert not any(my_opt.state[p] for p in mine.parameters()), "no buffer before the first step, as in eager"
    stepping = next(found for key, found in step.steps.items() if key[-1] in ("step", "last"))
    assert len(stepping) == 2, "the first step's graph and the one after it"

    _captures_refused(monkeypatch)
    _trains_like_the_eager_loop(step, batches, (mine, my_opt), (eager, eager_opt), k)
    assert len(stepping) == 1, "the first step's graph is dropped once it created the state"


@pytest.mark.parametrize("warm", [True, False], ids=["with-state", "fresh-optimizer"])
def test_a_budget_only_the_last_micro_batch_cannot_reach_is_refused_by_optimize(warm: bool) -> None:
    """The first micro-batch's graph reaches the budget; the last one's, which holds the
    accumulated gradients and steps the optimizer, cannot: optimize() raises, naming that graph,
    and the model and optimizer are as they were (a fresh optimizer has no state still)."""
    batch = _batches(1)[0]
    (probe, probe_opt), _ = _twins()
    lowest = {key[-1]: found[0][0].plan.predicted_peak for key, found in
              optimize(probe, probe_opt, batch, _loss, budget="min", accumulation_steps=2).steps.items()}  # fmt: skip
    assert lowest["first"] < lowest["last"], lowest
    budget = (lowest["first"] + lowest["last"]) // 2

    (mine, my_opt), (eager, eager_opt) = _twins(warm=warm)
    with pytest.raises(PipelineFailure) as error:
        optimize(mine, my_opt, batch, _loss, budget=budget, accumulation_steps=2)
    message, notes = str(error.value), getattr(error.value, "__notes__", [])
    assert "unreachable" in message or "out of reach" in message, message
    assert len(notes) == 1 and "the last micro-batch's graph of gradient accumulation" in notes[0], notes
    assert len(set(re.findall(r"[\d.]+ (B|KiB|MiB)\b", message))) == 1, f"one unit in the refusal: {message}"
    assert bool(my_opt.state) == warm, "a fresh optimizer keeps no state from the planning that failed"
    _same(mine, my_opt, eager, eager_opt)


@pytest.mark.parametrize("verbose", [False, True], ids=["quiet", "verbose"])
def test_a_check_that_passes_says_so_in_one_line(verbose: bool, capsys: pytest.CaptureFixture[str]) -> None:
    (mine, my_opt), _ = _twins()
    step = optimize(mine, my_opt, _batches(1)[0], _loss, passes="stats", check=True, verbose=verbose)
    said = [line for line in capsys.readouterr().err.splitlines() if "check passed" in line]
    assert len(said) == 1, said
    assert said[0].startswith("mutwo: check passed: ") and "equivalent over 3 iterations" in said[0]
    assert "bitwise" in said[0]
    assert step.last is not None and step.last.report is not None and step.last.report.equivalent


def test_backward_on_the_loss_a_step_returned_says_the_step_already_ran_it() -> None:
    (mine, my_opt), (eager, eager_opt) = _twins()
    batch = _batches(1)[0]
    step = optimize(mine, my_opt, batch, _loss, passes="stats")
    torch.manual_seed(0)
    loss = step(batch)
    torch.manual_seed(0)
    assert bitwise_equal(loss, _plain(eager, eager_opt, batch)), "the value is the step's loss"
    for backward in (loss.backward, lambda: (loss / 2).backward()):
        with pytest.raises(RuntimeError) as error:
            backward()
        assert str(error.value) == BACKWARD_AFTER_STEP and "\n" not in BACKWARD_AFTER_STEP
    _same(mine, my_opt, eager, eager_opt)  # nothing stepped twice
    assert loss.grad_fn is not None
    leaf = loss.grad_fn.next_functions[0][0].variable
    assert leaf.data_ptr() == loss.data_ptr(), "an alias of the loss: the only thing its graph keeps"
    total = loss.detach().clone()
    loss += 1.0  # in place, as on eager's loss
    assert loss.item() == total.item() + 1.0
