"""mutwo.runtime.optim reproduces eager torch.optim bitwise on CPU over long runs, and refuses what it cannot trace.

Each run trains a single parameter of an odd size (1031 elements, so vectorised CPU kernels also
run their scalar tail) for 300 steps with a fresh random gradient every step, once with eager
``torch.optim`` and once with :func:`runtime.optim.update` (or the captured graph), and compares
the parameter and every optimizer state tensor bitwise after every step. The learning rate is
changed half-way, as a scheduler would.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from mutwo.ir import from_fx
from mutwo.runtime import optim as functional_optim
from mutwo.runtime.capture import capture, learning_rate
from mutwo.runtime.optim import UnsupportedOptimizerError
from mutwo.runtime.step import GraphStep

SIZE = 1031
STEPS = 300
LR_CHANGE_AT = 150
LR_FACTOR = 0.37

MakeOptimizer = Callable[[list[torch.Tensor]], torch.optim.Optimizer]

CONFIGS: dict[str, MakeOptimizer] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.01),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9),
    "sgd-nesterov-wd": lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9, nesterov=True, weight_decay=1e-2),
    "sgd-maximize": lambda params: torch.optim.SGD(params, lr=0.01, maximize=True),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3),
    "adam-wd": lambda params: torch.optim.Adam(params, lr=1e-3, weight_decay=1e-2),
    "adam-amsgrad": lambda params: torch.optim.Adam(params, lr=1e-3, amsgrad=True),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.05),
}

EXPECTED_STATE = {
    "sgd": set(),
    "sgd-momentum": {"momentum_buffer"},
    "sgd-nesterov-wd": {"momentum_buffer"},
    "sgd-maximize": set(),
    "adam": {"step", "exp_avg", "exp_avg_sq"},
    "adam-wd": {"step", "exp_avg", "exp_avg_sq"},
    "adam-amsgrad": {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"},
    "adamw": {"step", "exp_avg", "exp_avg_sq"},
}


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns (so -0.0 vs 0.0 and NaN payloads count), same dtype and shape."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.detach().contiguous(), b.detach().contiguous()
    if a.dtype.is_floating_point:
        int_type = {8: torch.int64, 4: torch.int32, 2: torch.int16}[a.element_size()]
        return torch.equal(a.view(int_type), b.view(int_type))
    return torch.equal(a, b)


def _first_difference(step: int, eager: torch.optim.Optimizer, eager_param: torch.Tensor,
                      mine: torch.optim.Optimizer, my_param: torch.Tensor) -> str | None:  # fmt: skip
    if not _bitwise_equal(eager_param, my_param):
        diff = (eager_param.detach().double() - my_param.detach().double()).abs().max().item()
        return f"parameter differs after step {step} (max |diff| {diff:.3g})"
    eager_state, my_state = eager.state[eager_param], mine.state[my_param]
    if set(eager_state) != set(my_state):
        return f"state keys differ after step {step}: {sorted(eager_state)} vs {sorted(my_state)}"
    for name, value in eager_state.items():
        if not _bitwise_equal(value, my_state[name]):
            return f"state {name!r} differs after step {step}"
    return None


def _set_lr(optimizer: torch.optim.Optimizer, factor: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] *= factor


def _lr_tensor(group: dict) -> torch.Tensor:
    """The learning rate as runtime.capture feeds it."""
    return learning_rate(group)


def _run_against_eager(make: MakeOptimizer, zero_every: int = 0) -> tuple[str | None, torch.optim.Optimizer]:
    """Train one odd-sized parameter eagerly and through runtime.optim.update side by side.

    Returns the first bitwise difference (or None) and the runtime's optimizer. With
    ``zero_every``, every ``zero_every``-th gradient entry is exactly zero (dead ReLU units).
    """
    torch.manual_seed(0)
    eager_param = nn.Parameter(torch.randn(SIZE))
    my_param = nn.Parameter(eager_param.detach().clone())
    eager, mine = make([eager_param]), make([my_param])
    spec = functional_optim.describe(mine)
    functional_optim.init_state(mine, spec)
    initial = eager_param.detach().clone()
    generator = torch.Generator().manual_seed(1234)
    for step in range(STEPS):
        if step == LR_CHANGE_AT:
            _set_lr(eager, LR_FACTOR)
            _set_lr(mine, LR_FACTOR)
        grad = torch.randn(SIZE, generator=generator)
        if zero_every:
            grad[::zero_every] = 0.0
        eager_param.grad = grad.clone()
        eager.step()
        group = mine.param_groups[0]
        with torch.no_grad():
            if functional_optim.uses_foreach(group, [my_param]):
                functional_optim.update_foreach(spec, group, [my_param], [grad.clone()], [mine.state[my_param]],
                                                _lr_tensor(group))  # fmt: skip
            else:
                functional_optim.update(spec, group, my_param, grad.clone(), mine.state[my_param], _lr_tensor(group))
        difference = _first_difference(step, eager, eager_param, mine, my_param)
        if difference is not None:
            return difference, mine
    assert not torch.equal(eager_param.detach(), initial), "the run must really train"
    return None, mine


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_update_matches_eager_bitwise_every_step(config: str) -> None:
    initial_lr = CONFIGS[config]([nn.Parameter(torch.zeros(1))]).param_groups[0]["lr"]
    difference, mine = _run_against_eager(CONFIGS[config])
    assert difference is None, f"{config}: {difference}"
    assert set(next(iter(mine.state.values()), {})) == EXPECTED_STATE[config]
    assert mine.param_groups[0]["lr"] == initial_lr * LR_FACTOR, "the learning rate changed mid-way"


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_foreach_update_matches_eager_foreach_bitwise_every_step(config: str) -> None:
    """With foreach=True (torch.optim's CUDA default, asked for here on CPU) both sides take the
    multi-tensor form, and runtime.optim.update_foreach follows it bit for bit."""

    def make(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        optimizer = CONFIGS[config](params)
        optimizer.param_groups[0]["foreach"] = True
        return optimizer

    difference, mine = _run_against_eager(make)
    assert difference is None, f"{config}: {difference}"
    assert functional_optim.uses_foreach(mine.param_groups[0], [])


@pytest.mark.parametrize("config", ["sgd-momentum", "sgd-nesterov-wd", "adam", "adamw"])
def test_update_matches_eager_with_exact_zero_gradients(config: str) -> None:
    difference, _ = _run_against_eager(CONFIGS[config], zero_every=3)
    assert difference is None, f"{config}: {difference}"


def test_sgd_momentum_maximize_with_exact_zero_gradients_is_bitwise() -> None:
    difference, _ = _run_against_eager(
        lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9, maximize=True), zero_every=3
    )
    assert difference is None, difference


def test_adam_decoupled_weight_decay_matches_eager_or_is_refused() -> None:
    def make(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.Adam(params, lr=1e-3, weight_decay=1e-2, decoupled_weight_decay=True)

    try:
        difference, _ = _run_against_eager(make)
    except UnsupportedOptimizerError:
        return  # refusing is fine
    assert difference is None, difference


def test_adam_float32_tensor_learning_rate_matches_eager_or_is_refused() -> None:
    try:
        difference, _ = _run_against_eager(lambda params: torch.optim.Adam(params, lr=torch.tensor(1e-3)))
    except UnsupportedOptimizerError:
        return
    assert difference is None, difference


def test_update_uses_the_learning_rate_tensor() -> None:
    """The learning rate is read from the tensor given, not from the param group."""
    torch.manual_seed(0)
    param = torch.randn(SIZE)
    optimizer = torch.optim.SGD([nn.Parameter(param.clone())], lr=0.01)
    spec = functional_optim.describe(optimizer)
    group = optimizer.param_groups[0]
    grad = torch.randn(SIZE)
    small, large = param.clone(), param.clone()
    functional_optim.update(spec, group, small, grad, {}, torch.tensor(0.01, dtype=torch.float64))
    functional_optim.update(spec, group, large, grad, {}, torch.tensor(0.5, dtype=torch.float64))
    assert torch.equal(small, param.add(grad, alpha=-0.01))  # torch.optim's own arithmetic
    assert torch.equal(large, param.add(grad, alpha=-0.5))
    assert not torch.equal(small, large)


class _Dot(nn.Module):
    """``loss = (weight * g).sum()``: the gradient of ``weight`` is exactly the batch ``g``."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(SIZE))

    def forward(self, g: torch.Tensor) -> torch.Tensor:
        return (self.weight * g).sum()


@pytest.mark.parametrize("config", ["sgd-nesterov-wd", "adam-amsgrad", "adamw"])
def test_captured_step_matches_eager_bitwise_every_step(config: str) -> None:
    """The same long run through capture -> IR -> GraphStep, with the learning rate a graph input."""
    torch.manual_seed(0)
    eager_model = _Dot()
    torch.manual_seed(0)
    my_model = _Dot()
    eager, mine = CONFIGS[config](list(eager_model.parameters())), CONFIGS[config](list(my_model.parameters()))
    generator = torch.Generator().manual_seed(99)
    batch = torch.randn(SIZE, generator=generator)
    captured, binding = capture(my_model, mine, batch, lambda output, _batch: output)
    graph = from_fx(captured.graph_module, [(s.kind, s.label) for s in captured.slots], captured.gradient_labels)
    step_fn = GraphStep(graph, captured, binding)
    for step in range(STEPS):
        if step == LR_CHANGE_AT:
            _set_lr(eager, LR_FACTOR)
            _set_lr(mine, LR_FACTOR)
        batch = torch.randn(SIZE, generator=generator)
        out = step_fn(batch)
        eager.zero_grad(set_to_none=True)
        eager_loss = eager_model(batch)
        eager_loss.backward()
        eager.step()
        assert torch.equal(out.loss, eager_loss.detach()), f"loss differs at step {step}"
        assert torch.equal(out.gradients["weight"], batch), f"gradient is not the batch at step {step}"
        difference = _first_difference(step, eager, eager_model.weight, mine, my_model.weight)
        assert difference is None, f"{config}: {difference}"


# -- what is refused ---------------------------------------------------------------------------


def _param() -> nn.Parameter:
    return nn.Parameter(torch.randn(4))


def test_unsupported_optimizer_class_is_refused_with_the_supported_list() -> None:
    optimizer = torch.optim.RMSprop([_param()], lr=0.01)
    with pytest.raises(UnsupportedOptimizerError) as info:
        functional_optim.describe(optimizer)
    message = str(info.value)
    assert "RMSprop" in message
    for supported in ("torch.optim.SGD", "torch.optim.Adam", "torch.optim.AdamW"):
        assert supported in message


def test_capture_refuses_unsupported_optimizer_before_tracing() -> None:
    model = _Dot()
    optimizer = torch.optim.RMSprop(model.parameters(), lr=0.01)
    with pytest.raises(UnsupportedOptimizerError, match="RMSprop"):
        capture(model, optimizer, torch.randn(SIZE), lambda output, _batch: output)
    assert not optimizer.state, "nothing may be initialised for a refused optimizer"


@pytest.mark.parametrize("flag", ["fused", "differentiable"])
@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW"])
def test_fused_and_differentiable_are_refused_naming_the_fix(name: str, flag: str) -> None:
    optimizer = getattr(torch.optim, name)([_param()], lr=0.01, **{flag: True})
    with pytest.raises(UnsupportedOptimizerError) as info:
        functional_optim.describe(optimizer)
    message = str(info.value)
    assert f"{flag}=True" in message and name in message
    assert f"{flag}=False" in message, "the message must say how to fix it"


def test_sgd_dampening_without_momentum_buffers_is_refused() -> None:
    optimizer = torch.optim.SGD([_param()], lr=0.01, momentum=0.9, dampening=0.1)
    with pytest.raises(UnsupportedOptimizerError) as info:
        functional_optim.describe(optimizer)
    message = str(info.value)
    assert "dampening" in message
    assert "dampening=0" in message or "eager optimizer step" in message


def test_sgd_dampening_with_momentum_buffers_matches_eager() -> None:
    """The fix the message names works: after one eager step, updates follow torch.optim bitwise."""
    torch.manual_seed(0)
    eager_param = nn.Parameter(torch.randn(SIZE))
    my_param = nn.Parameter(eager_param.detach().clone())
    eager = torch.optim.SGD([eager_param], lr=0.01, momentum=0.9, dampening=0.1)
    mine = torch.optim.SGD([my_param], lr=0.01, momentum=0.9, dampening=0.1)
    generator = torch.Generator().manual_seed(5)
    first = torch.randn(SIZE, generator=generator)
    for param, optimizer in ((eager_param, eager), (my_param, mine)):
        param.grad = first.clone()
        optimizer.step()
        param.grad = None
    spec = functional_optim.describe(mine)  # no longer refused
    for step in range(STEPS):
        grad = torch.randn(SIZE, generator=generator)
        eager_param.grad = grad.clone()
        eager.step()
        with torch.no_grad():
            functional_optim.update(spec, mine.param_groups[0], my_param, grad.clone(), mine.state[my_param],
                                    torch.tensor(mine.param_groups[0]["lr"], dtype=torch.float64))  # fmt: skip
        difference = _first_difference(step, eager, eager_param, mine, my_param)
        assert difference is None, difference


def test_sgd_dampening_without_momentum_is_accepted() -> None:
    """Dampening only matters with momentum: plain SGD with a dampening value is supported."""
    optimizer = torch.optim.SGD([_param()], lr=0.01, dampening=0.5)
    assert functional_optim.describe(optimizer).state_names == ()
