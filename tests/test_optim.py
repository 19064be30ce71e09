"""The captured optimizer update is torch.optim's own ``step()``: bitwise equal to eager on CPU.

Each run trains two parameters of odd sizes (so vectorised CPU kernels also run their scalar
tail) through ``mutwo.optimize`` and through eager ``loss.backward(); optimizer.step()`` side by
side, from identical state, with a fresh random batch every step, and compares the loss, the
parameters and every optimizer state tensor bitwise after every step. The learning rate, and
momentum or the first of betas where the optimizer has them, change between steps as a scheduler
would change them (OneCycleLR cycles both), and end up different from where they started.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from mutwo.ir import NodeKind
from mutwo.runtime import api
from mutwo.runtime.api import optimize
from mutwo.runtime.capture.optim import UnsupportedOptimizerError

STEPS = 12
optim = torch.optim
MakeOptimizer = Callable[..., torch.optim.Optimizer]

CONFIGS: dict[str, MakeOptimizer] = {
    "sgd": lambda p, **kw: optim.SGD(p, lr=0.01, **kw),
    "sgd-momentum-nesterov-wd": lambda p, **kw: optim.SGD(p, lr=0.01, momentum=0.9, nesterov=True, weight_decay=1e-2,
                                                          **kw),  # fmt: skip
    "sgd-dampening": lambda p, **kw: optim.SGD(p, lr=0.01, momentum=0.9, dampening=0.1, **kw),
    "sgd-maximize": lambda p, **kw: optim.SGD(p, lr=0.01, momentum=0.5, maximize=True, **kw),
    "adam-amsgrad-wd": lambda p, **kw: optim.Adam(p, lr=1e-2, amsgrad=True, weight_decay=1e-2, **kw),
    "adamw": lambda p, **kw: optim.AdamW(p, lr=1e-2, weight_decay=0.05, **kw),
    "rmsprop-centered-momentum": lambda p, **kw: optim.RMSprop(p, lr=1e-2, momentum=0.9, centered=True, **kw),
    "adagrad-lr-decay": lambda p, **kw: optim.Adagrad(p, lr=1e-2, lr_decay=1e-2, weight_decay=1e-3, **kw),
    "adamax": lambda p, **kw: optim.Adamax(p, lr=1e-2, weight_decay=1e-3, **kw),
    "nadam-decoupled": lambda p, **kw: optim.NAdam(p, lr=1e-2, weight_decay=1e-2, decoupled_weight_decay=True, **kw),
    "radam": lambda p, **kw: optim.RAdam(p, lr=1e-2, **kw),
    "adadelta": lambda p, **kw: optim.Adadelta(p, lr=0.5, **kw),
    "rprop": lambda p, **kw: optim.Rprop(p, lr=1e-2, **kw),
    "asgd": lambda p, **kw: optim.ASGD(p, lr=1e-2, t0=4, **kw),
}


class _Dots(nn.Module):
    """``loss = (a * g).sum() + (b * h).sum()``: the gradients are the batch itself."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(1031))
        self.b = nn.Parameter(torch.randn(7, 13))

    def forward(self, g: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return (self.a * g).sum() + (self.b * h).sum()


def _loss(output: torch.Tensor, _batch: object) -> torch.Tensor:
    return output


def _batch(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(1031, generator=generator), torch.randn(7, 13, generator=generator)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns (so -0.0 vs 0.0 and NaN payloads count), same dtype and shape."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.detach().contiguous(), b.detach().contiguous()
    if a.dtype.is_floating_point:
        int_type = {8: torch.int64, 4: torch.int32, 2: torch.int16}[a.element_size()]
        return torch.equal(a.view(int_type), b.view(int_type))
    return torch.equal(a, b)


def first_difference(mine: nn.Module, my_opt: torch.optim.Optimizer, eager: nn.Module,
                     eager_opt: torch.optim.Optimizer) -> str | None:  # fmt: skip
    """The first parameter or optimizer state tensor that differs in its bits, or None."""
    for (name, p), q in zip(mine.named_parameters(), eager.parameters(), strict=True):
        if not bitwise_equal(p, q):
            return f"parameter {name} (max |diff| {(p.double() - q.double()).abs().max().item():.3g})"
        mine_state, eager_state = my_opt.state[p], eager_opt.state[q]
        if set(mine_state) != set(eager_state):
            return f"state keys of {name}: {sorted(mine_state)} vs {sorted(eager_state)}"
        for key, value in eager_state.items():
            if isinstance(value, torch.Tensor) and not bitwise_equal(mine_state[key], value):
                return f"state {key!r} of {name}"
    return None


def _lr_for(step: int) -> float:
    return 1.0 if step < STEPS // 2 else 0.37  # a scheduler's change, half way


def _momentum_for(step: int) -> float:
    return 1.0 if step < STEPS // 2 else 0.95  # OneCycleLR's change of momentum or betas[0], half way


def _schedule(optimizer: torch.optim.Optimizer, base: list[dict[str, object]], step: int) -> None:
    """Set each group's hyperparameters as schedulers would at ``step``, from their ``base`` values."""
    for group, start in zip(optimizer.param_groups, base, strict=True):
        group["lr"] = start["lr"] * _lr_for(step)
        if start.get("momentum"):
            group["momentum"] = start["momentum"] * _momentum_for(step)
        if "betas" in start:
            beta1, beta2 = start["betas"]
            group["betas"] = (beta1 * _momentum_for(step), beta2)


def train_side_by_side(make: MakeOptimizer, steps: int = STEPS, **kw: object) -> str | None:
    torch.manual_seed(0)
    mine = _Dots()
    eager = copy.deepcopy(mine)
    my_opt, eager_opt = make(mine.parameters(), **kw), make(eager.parameters(), **kw)
    base = [{key: g[key] for key in ("lr", "momentum", "betas") if key in g} for g in my_opt.param_groups]
    generator = torch.Generator().manual_seed(1234)
    step = optimize(mine, my_opt, _batch(torch.Generator().manual_seed(0)), _loss, passes="stats")
    for index in range(steps):
        for opt in (my_opt, eager_opt):
            _schedule(opt, base, index)
        batch = _batch(generator)
        loss = step(batch)
        eager_opt.zero_grad(set_to_none=True)
        expected = eager(*batch)
        expected.backward()
        eager_opt.step()
        if not bitwise_equal(loss, expected):
            return f"loss at step {index}"
        difference = first_difference(mine, my_opt, eager, eager_opt)
        if difference is not None:
            return f"{difference} after step {index}"
    return None


@pytest.mark.parametrize("foreach", [False, True], ids=["single-tensor", "foreach"])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_every_step_is_bitwise_equal_to_eager(config: str, foreach: bool) -> None:
    difference = train_side_by_side(CONFIGS[config], foreach=foreach)
    assert difference is None, f"{config}: {difference}"


def test_radam_captures_again_when_its_rectification_switches_on() -> None:
    """RAdam branches on its step count (rho_t > 5 from step 6 with beta2=0.999): the step is
    captured for steps 1-5, then again once the branch goes the other way, and stays bitwise."""
    messages: list[str] = []
    torch.manual_seed(0)
    model = _Dots()
    optimizer = optim.RAdam(model.parameters(), lr=1e-2)
    step = optimize(model, optimizer, _batch(torch.Generator().manual_seed(0)), _loss, passes="stats")
    step.log = messages.append
    generator = torch.Generator().manual_seed(3)
    for _ in range(8):
        step(_batch(generator))
    graphs = next(iter(step.steps.values()))
    assert len(graphs) == 2 and all(s.captured.guards for _, s in graphs)
    assert any("goes the other way" in m for m in messages), messages


def test_sgd_dampening_creates_its_buffer_in_the_first_step_then_captures_again() -> None:
    torch.manual_seed(0)
    model = _Dots()
    optimizer = optim.SGD(model.parameters(), lr=0.01, momentum=0.9, dampening=0.5)
    step = optimize(model, optimizer, _batch(torch.Generator().manual_seed(0)), _loss, passes="stats")
    assert not optimizer.state[model.a], "the buffer does not exist before the first step, as in eager"
    step(_batch(torch.Generator().manual_seed(1)))
    assert set(optimizer.state[model.a]) == {"momentum_buffer"}
    step(_batch(torch.Generator().manual_seed(2)))
    assert sum(len(v) for v in step.steps.values()) == 1, "the first graph is dropped once the state exists"


def test_learning_rates_and_step_counts_are_graph_inputs_not_constants() -> None:
    torch.manual_seed(0)
    model = _Dots()
    optimizer = optim.Adam(model.parameters(), lr=1.2345e-3)  # a number no other constant of Adam's update has
    step = optimize(model, optimizer, _batch(torch.Generator().manual_seed(0)), _loss, passes="stats")
    graph = step.last.graph
    lr = [p for p in graph.placeholders if p.label == "lr:group0"]
    steps = [p for p in graph.placeholders if p.label.endswith(":step")]
    assert len(lr) == 1 and len(steps) == 2
    assert lr[0].users, "the learning rate is read by the update"
    assert all(p.kind is NodeKind.OPTIMIZER_STATE and p.users for p in steps)
    text = step.last.captured.graph_module.code
    assert "0.0012345" not in text, "the learning rate must not be baked into the graph"


@pytest.mark.parametrize("foreach", [False, True])
def test_the_optimizer_step_leaves_no_dead_op_to_run_every_step(foreach: bool) -> None:
    """A recorded host call's result structure comes from the call on stand-in numbers, which must
    not be traced: Adam's ``sqrt / bias_correction2_sqrt`` left a dead parameter-sized division
    per parameter, run every step."""
    torch.manual_seed(0)
    model = _Dots()
    optimizer = optim.Adam(model.parameters(), lr=1e-3, foreach=foreach)
    step = optimize(model, optimizer, _batch(torch.Generator().manual_seed(0)), _loss, passes="stats")
    code = step.last.captured.graph_module.graph
    dead = [n.name for n in code.nodes if n.op == "call_function" and not n.users and not n.is_impure()]
    assert not dead, f"ops whose results nothing reads: {dead}"


@pytest.mark.parametrize("config", ["adamw", "rmsprop-centered-momentum", "sgd-dampening"])
def test_state_dict_round_trips_both_ways(config: str) -> None:
    """mutwo's state continues eagerly, and eager state continues through mutwo, bitwise."""
    make = CONFIGS[config]
    torch.manual_seed(0)
    reference = _Dots()
    ref_opt = make(reference.parameters())
    generator = torch.Generator().manual_seed(7)
    batches = [_batch(generator) for _ in range(9)]

    def eager_steps(model: nn.Module, optimizer: torch.optim.Optimizer, chunk: list) -> None:
        for batch in chunk:
            optimizer.zero_grad(set_to_none=True)
            model(*batch).backward()
            optimizer.step()

    eager_steps(reference, ref_opt, batches)
    torch.manual_seed(0)
    first = _Dots()
    first_opt = make(first.parameters())
    step = optimize(first, first_opt, batches[0], _loss, passes="stats")
    for batch in batches[:3]:
        step(batch)
    # mutwo -> eager
    second = copy.deepcopy(first)
    second_opt = make(second.parameters())
    second_opt.load_state_dict(first_opt.state_dict())
    eager_steps(second, second_opt, batches[3:6])
    # eager -> mutwo
    third = copy.deepcopy(second)
    third_opt = make(third.parameters())
    third_opt.load_state_dict(second_opt.state_dict())
    step = optimize(third, third_opt, batches[6], _loss, passes="stats")
    for batch in batches[6:]:
        step(batch)
    assert first_difference(third, third_opt, reference, ref_opt) is None


def _scheduled_side_by_side(make: MakeOptimizer, schedule: Callable[[torch.optim.Optimizer], object], steps: int,
                            after_step: Callable[[torch.optim.Optimizer], None] = lambda optimizer: None) -> tuple[
        torch.optim.Optimizer, torch.optim.Optimizer, str | None]:  # fmt: skip
    """Train through mutwo and eagerly side by side for ``steps``, each optimizer with its own
    scheduler made by ``schedule`` and stepped after every step; ``after_step`` sees mutwo's
    optimizer after each. Returns both optimizers and the first difference (None: bitwise equal)."""
    torch.manual_seed(0)
    mine = _Dots()
    eager = copy.deepcopy(mine)
    my_opt, eager_opt = make(mine.parameters()), make(eager.parameters())
    schedulers = [schedule(o) for o in (my_opt, eager_opt)]
    step = optimize(mine, my_opt, _batch(torch.Generator().manual_seed(0)), _loss, passes="stats")
    generator = torch.Generator().manual_seed(5)
    for _ in range(steps):
        batch = _batch(generator)
        step(batch)
        schedulers[0].step()
        eager_opt.zero_grad()
        eager(*batch).backward()
        eager_opt.step()
        schedulers[1].step()
        after_step(my_opt)
    return my_opt, eager_opt, first_difference(mine, my_opt, eager, eager_opt)


def test_a_scheduler_drives_the_captured_step() -> None:
    my_opt, eager_opt, difference = _scheduled_side_by_side(
        lambda p: optim.NAdam(p, lr=1e-2), lambda o: optim.lr_scheduler.CosineAnnealingLR(o, T_max=4), 5)
    assert my_opt.param_groups[0]["lr"] == eager_opt.param_groups[0]["lr"] != 1e-2
    assert difference is None


@pytest.mark.parametrize("make", [lambda p: optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
                                  lambda p: optim.AdamW(p, lr=1e-2)], ids=["sgd-nesterov", "adamw"])  # fmt: skip
def test_one_cycle_changes_momentum_every_step_without_a_capture_again(make: MakeOptimizer,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """OneCycleLR cycles momentum (SGD) or betas[0] (AdamW) at every step: they are graph inputs
    like the learning rate, so the step is captured once and stays bitwise equal to eager."""
    captures = []
    planning = api.optimize_graph
    monkeypatch.setattr(api, "optimize_graph", lambda *a, **k: captures.append(1) or planning(*a, **k))
    seen = set()

    def note_momentum(optimizer: torch.optim.Optimizer) -> None:
        group = optimizer.param_groups[0]
        seen.add(group.get("momentum", group.get("betas", (None,))[0]))

    _, _, difference = _scheduled_side_by_side(
        make, lambda o: optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=8), 7, note_momentum)
    assert len(seen) >= 5, f"the scheduler should change the momentum at nearly every step: {sorted(seen)}"
    assert len(captures) == 1, f"captured {len(captures)} times"
    assert difference is None


def test_a_hyperparameter_read_at_capture_warns_when_it_changes() -> None:
    """Weight decay is a constant of the graph: changing it captures again, and says which one."""
    torch.manual_seed(0)
    model = _Dots()
    optimizer = optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    generator = torch.Generator().manual_seed(5)
    step = optimize(model, optimizer, _batch(generator), _loss, passes="stats")
    step(_batch(generator))
    optimizer.param_groups[0]["weight_decay"] = 0.05
    with pytest.warns(UserWarning, match="the optimizer's weight_decay changed, which the captured step reads as a "
                                         "constant: capturing and optimizing the iteration again"):  # fmt: skip
        step(_batch(generator))


# -- what is refused ---------------------------------------------------------------------------


def _refusal(optimizer: torch.optim.Optimizer, model: nn.Module) -> str:
    with pytest.raises(UnsupportedOptimizerError) as info:
        optimize(model, optimizer, _batch(torch.Generator().manual_seed(0)), _loss, passes="stats")
    assert not optimizer.state, "nothing may be initialised for a refused optimizer"
    return str(info.value)


def test_lbfgs_is_refused_because_it_needs_a_closure() -> None:
    model = _Dots()
    message = _refusal(optim.LBFGS(model.parameters()), model)
    assert "LBFGS" in message and "closure" in message


def test_sparse_adam_is_refused() -> None:
    model = _Dots()
    assert "SparseAdam" in _refusal(optim.SparseAdam(list(model.parameters())), model)


@pytest.mark.parametrize("flag", ["fused", "differentiable"])
def test_fused_and_differentiable_are_refused_naming_the_fix(flag: str) -> None:
    model = _Dots()
    message = _refusal(optim.Adam(model.parameters(), lr=0.01, **{flag: True}), model)
    assert f"{flag}=True" in message and f"{flag}=False" in message


def test_step_hooks_are_refused_rather_than_silently_skipped() -> None:
    model = _Dots()
    optimizer = optim.SGD(model.parameters(), lr=0.01)
    optimizer.register_step_post_hook(lambda *args: None)
    assert "hooks" in _refusal(optimizer, model)


def test_a_tensor_learning_rate_is_refused_naming_the_fix() -> None:
    model = _Dots()
    message = _refusal(optim.Adam(model.parameters(), lr=torch.tensor(1e-3)), model)
    assert "Python float" in message



def test_a_branch_on_an_unchanged_hyperparameter_is_decided_and_guarded_once() -> None:
    """SGD asks ``momentum != 0`` of every parameter, and momentum is a graph input (schedulers
    change it): one guard for all of them, not one per parameter, each of which scanned the whole
    graph traced so far (ResNet-152 b2's capture took 39 s on the CPU, 10 s since)."""
    torch.manual_seed(0)
    model = _Dots()
    optimizer = optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    step = optimize(model, optimizer, _batch(torch.Generator().manual_seed(0)), _loss, passes="stats")
    guards = step.last.captured.guards
    assert [g.describe() for g in guards] == [guards[0].describe()] and guards[0].outcome is True


def test_a_branch_is_decided_again_once_its_number_is_written() -> None:
    """A condition asked again over the same tensor is answered again once a traced op wrote that
    tensor, here through a view, which leaves the tensor's own node as it was."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from mutwo.runtime.capture.guards import TraceDecider
    from mutwo.runtime.capture.host_scalars import HostScalarMode

    flag, x = torch.tensor(0.0), torch.tensor(3.0)
    decide = TraceDecider([flag, x])

    def traced(flag: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        with HostScalarMode(decide):
            first, again = bool(flag.item() != 0), bool(flag.item() != 0)
            flag.view(1).add_(1)
            after = bool(flag.item() != 0)
        return x * (1 + first + 2 * again + 4 * after)

    make_fx(traced, tracing_mode="fake", _allow_non_fake_inputs=True)(flag.clone(), x)
    assert [g.outcome for g in decide.recorded] == [False, True]
