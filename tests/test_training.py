"""Training the way eager loops train: modes, gradient clipping, mixed precision.

Each test trains a copy of the model through ``mutwo.optimize`` and another through the eager
loop it stands for, from identical state, and compares the loss, parameters, buffers and
optimizer state bitwise after every step (CPU).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from mutwo.runtime.api import optimize
from mutwo.runtime.capture.tracing import CaptureError
from mutwo.runtime.capture.training import TrainingOptionError
from tests.test_optim import bitwise_equal, first_difference

Batch = tuple[torch.Tensor, torch.Tensor]


class _Net(nn.Module):
    """Batch norm (running statistics) and dropout: what train and eval mode change."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(12, 24)
        self.norm = nn.BatchNorm1d(24)
        self.drop = nn.Dropout(0.3)
        self.second = nn.Linear(24, 5)

    def forward(self, x: torch.Tensor, _labels: torch.Tensor | None = None) -> torch.Tensor:
        return self.second(self.drop(torch.relu(self.norm(self.first(x)))))


def _loss(output: torch.Tensor, batch: Batch) -> torch.Tensor:
    return nn.functional.cross_entropy(output, batch[1])


def _batches(n: int) -> list[Batch]:
    generator = torch.Generator().manual_seed(5)
    return [(torch.randn(16, 12, generator=generator) * 3, torch.randint(0, 5, (16,), generator=generator))
            for _ in range(n)]  # fmt: skip


def _same(mine: nn.Module, my_opt: torch.optim.Optimizer, eager: nn.Module, eager_opt: torch.optim.Optimizer) -> None:
    difference = first_difference(mine, my_opt, eager, eager_opt)
    assert difference is None, difference
    for (name, a), b in zip(mine.named_buffers(), eager.buffers(), strict=True):
        assert bitwise_equal(a, b), f"buffer {name}"


def _side_by_side(batches: list[Batch], eager_step: Callable[[nn.Module, torch.optim.Optimizer, Batch], torch.Tensor],
                  dtype: torch.dtype = torch.float32, between: Callable[[int, nn.Module], None] = lambda i, m: None,
                  compare_at: Callable[[int], bool] = lambda i: True,
                  **options: object) -> Callable[..., object]:  # fmt: skip
    """Train through mutwo and eagerly; ``between(i, model)`` runs on both models before step ``i``;
    the models and optimizers are compared after each step ``i`` where ``compare_at(i)``."""
    torch.manual_seed(0)
    mine = _Net().to(dtype)
    eager = copy.deepcopy(mine)
    my_opt = torch.optim.AdamW(mine.parameters(), lr=1e-2)
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    step = optimize(mine, my_opt, batches[0], _loss, passes="stats", **options)  # type: ignore[arg-type]
    for index, batch in enumerate(batches):
        between(index, mine)
        between(index, eager)
        torch.manual_seed(index)
        loss = step(batch)
        torch.manual_seed(index)
        expected = eager_step(eager, eager_opt, batch)
        assert bitwise_equal(loss, expected), f"loss at step {index}: {loss.item()} vs {expected.item()}"
        if compare_at(index):
            _same(mine, my_opt, eager, eager_opt)
    return step


def _plain(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch) -> torch.Tensor:
    optimizer.zero_grad(set_to_none=True)
    loss = _loss(model(batch[0]), batch)
    loss.backward()
    optimizer.step()
    return loss.detach()


def test_the_step_follows_train_and_eval_mode_with_one_graph_per_mode() -> None:
    def modes(index: int, model: nn.Module) -> None:
        model.train(index not in (2, 3))  # train, train, eval, eval, train

    step = _side_by_side(_batches(5), _plain, between=modes)
    assert sum(1 for found in step.steps.values() if found) == 2, "one graph per mode"  # type: ignore[attr-defined]


def test_a_submodule_switched_alone_is_another_mode() -> None:
    def freeze_norm(index: int, model: nn.Module) -> None:
        model.train()
        model.norm.train(index % 2 == 0)

    step = _side_by_side(_batches(4), _plain, between=freeze_norm)
    assert sum(1 for found in step.steps.values() if found) == 2  # type: ignore[attr-defined]


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")], ids=["l2", "l1", "inf"])
def test_max_grad_norm_clips_like_clip_grad_norm_before_step(norm_type: float) -> None:
    """torch's default form on each device (per tensor on CPU, foreach on CUDA), in both loops."""

    def clipped(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = _loss(model(batch[0]), batch)
        loss.backward()
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05, norm_type=norm_type)
        assert total > 0.05, "the test must actually clip"
        optimizer.step()
        return loss.detach()

    _side_by_side(_batches(3), clipped, max_grad_norm=0.05, norm_type=norm_type)


def test_clipping_inside_the_loss_function_is_refused_in_one_line() -> None:
    model = _Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def clipping_loss(output: torch.Tensor, batch: Batch) -> torch.Tensor:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        return _loss(output, batch)

    with pytest.raises(CaptureError, match="max_grad_norm=") as error:
        optimize(model, optimizer, _batches(1)[0], clipping_loss, passes="stats")
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("precision,dtype", [("bf16-autocast", torch.bfloat16), ("fp16-autocast", torch.float16)])
def test_autocast_precision_equals_eager_autocast(precision: str, dtype: torch.dtype) -> None:
    def autocast(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype):
            loss = _loss(model(batch[0]), batch)
        loss.backward()
        optimizer.step()
        return loss.detach()

    _side_by_side(_batches(3), autocast, precision=precision)


def test_bf16_parameters_train_bitwise_like_eager() -> None:
    batches = [(x.bfloat16(), y) for x, y in _batches(4)]
    _side_by_side(batches, _plain, dtype=torch.bfloat16)


@pytest.mark.parametrize("options,message", [
    ({"precision": "bf16"}, "precision 'bf16' is not known"),
    ({"max_grad_norm": 0}, "max_grad_norm must be a positive number"),
    ({"norm_type": -1.0}, "norm_type must be positive"),
])  # fmt: skip
def test_bad_training_options_are_refused_in_one_line(options: dict[str, object], message: str) -> None:
    model = _Net()
    with pytest.raises(TrainingOptionError, match=message) as error:
        optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), _batches(1)[0], _loss,
                 passes="stats", **options)  # type: ignore[arg-type]  # fmt: skip
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("k,max_grad_norm", [(3, None), (2, 0.05)], ids=["k3", "k2-clipped"])
def test_gradient_accumulation_equals_the_eager_accumulating_loop(k: int, max_grad_norm: float | None) -> None:
    calls = []

    def accumulating(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch) -> torch.Tensor:
        loss = _loss(model(batch[0]), batch)
        (loss / k).backward()
        calls.append(None)
        if len(calls) % k == 0:
            if max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    # Before the first optimizer step eager has no optimizer state yet; mutwo creates it up front.
    step = _side_by_side(_batches(2 * k + 1), accumulating, accumulation_steps=k, max_grad_norm=max_grad_norm,
                         keep_grads=True, compare_at=lambda i: i >= k - 1)  # fmt: skip
    kinds = sorted(key[-1] for key, found in step.steps.items() if found)  # type: ignore[attr-defined]
    assert kinds == sorted(["first", "last"] + (["middle"] if k > 2 else []))
    # One micro-batch into the third accumulation: .grad holds its gradients, as in eager.
    assert all(p.grad is not None for p in step.model.parameters())  # type: ignore[attr-defined]


def test_accumulated_gradients_are_graph_inputs_the_memory_simulator_sees() -> None:
    model = _Net()
    step = optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), _batches(1)[0], _loss, passes="stats",
                    accumulation_steps=2)  # fmt: skip
    step(_batches(1)[0])
    step(_batches(1)[0])
    last = next(o for key, found in step.steps.items() if key[-1] == "last" for o, _ in found)
    labels = [p.label for p in last.graph.placeholders if p.label.endswith(":accumulated_grad")]
    assert sorted(labels) == sorted(f"{n}:accumulated_grad" for n, _ in model.named_parameters())


@pytest.mark.parametrize("k", [1, 2], ids=["plain", "accumulating"])
def test_fp16_grad_scaler_equals_eager_including_skipped_steps(k: int) -> None:
    """The scale grows every step (growth_interval=1) until the fp16 gradients overflow: those
    steps are skipped and the scale backs off, in both loops."""

    def scaler() -> torch.amp.GradScaler:
        return torch.amp.GradScaler("cpu", init_scale=2.0**14, growth_interval=1)

    eager_scaler, my_scaler = scaler(), scaler()
    calls = []
    scales: list[float] = []

    def scaled(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = _loss(model(batch[0]), batch)
        eager_scaler.scale(loss / k if k > 1 else loss).backward()
        calls.append(None)
        if len(calls) % k == 0:
            eager_scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            eager_scaler.step(optimizer)
            eager_scaler.update()
            optimizer.zero_grad(set_to_none=True)
            scales.append(eager_scaler.get_scale())
            assert my_scaler.get_scale() == scales[-1], "the captured scale update"
            assert torch.equal(my_scaler._growth_tracker, eager_scaler._growth_tracker)
        return loss.detach()

    _side_by_side(_batches(12 * k), scaled, precision="fp16-autocast", grad_scaler=my_scaler, max_grad_norm=1.0,
                  accumulation_steps=k, compare_at=lambda i: i >= k - 1)  # fmt: skip
    backoffs = sum(1 for a, b in zip(scales, scales[1:], strict=False) if b < a)
    assert backoffs >= 1 and scales[-1] > scales[0] / 2, f"the test must skip steps and recover: {scales}"
