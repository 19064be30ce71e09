"""mutwo in a user's own training loop (runtime.api.optimize): 50 iterations with a learning-rate
scheduler bitwise equal to eager torch.optim on CPU, a checkpoint continued in a fresh process,
and batches of another shape."""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from mutwo.runtime.api import optimize
from mutwo.runtime.planning.fit import fit_batch
from tests import models

REPO = Path(__file__).resolve().parent.parent
ITERATIONS = 50
SETUPS = {
    "cnn": (lambda: models.cnn(batch_size=16), "min"),
    "bert": (lambda: models.bert(batch_size=4, seq_len=16), "min"),
}


def _make(name: str):
    make, _ = SETUPS[name]
    workload = make()
    optimizer = torch.optim.AdamW(workload.model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)
    return workload, optimizer, scheduler


def _equal_states(a: dict, b: dict) -> bool:
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else (_equal_states(x, y) if isinstance(x, dict)
               else x == y) for x, y in zip(a.values(), b.values(), strict=True))  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SETUPS))
def test_fifty_iterations_with_a_scheduler_are_bitwise_equal_to_eager(name: str) -> None:
    (mine, my_opt, my_sched), (eager, eager_opt, eager_sched) = _make(name), _make(name)
    step = optimize(mine.model, my_opt, mine.batch, mine.loss_fn, budget=SETUPS[name][1])
    assert step.last is not None and step.last.plan.entries, "the budget should make select recompute something"
    for iteration in range(ITERATIONS):
        torch.manual_seed(1000 + iteration)
        loss = step(mine.batch)
        my_sched.step()
        torch.manual_seed(1000 + iteration)
        expected = models.eager_step(eager, eager_opt)
        eager_sched.step()
        assert torch.equal(loss, expected), f"loss differs at iteration {iteration}"
    assert my_opt.param_groups[0]["lr"] == eager_opt.param_groups[0]["lr"] < 1e-2
    assert _equal_states(mine.model.state_dict(), eager.model.state_dict())
    assert _equal_states(my_opt.state_dict()["state"], eager_opt.state_dict()["state"])


class _DropoutClassifier(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.5),
                                          torch.nn.Linear(32, 4))  # fmt: skip

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _cross_entropy(output: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(output, batch[1])


def test_planning_leaves_the_random_stream_to_training() -> None:
    """Seeded once, as users seed: profiling, the check and the capture again for the last
    micro-batch of gradient accumulation run the graph and reseed, and still every dropout mask
    is the one eager training draws."""
    torch.manual_seed(0)
    mine = _DropoutClassifier()
    eager = copy.deepcopy(mine)
    batches = [(torch.randn(8, 16), torch.randint(0, 4, (8,))) for _ in range(4)]
    my_opt, eager_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (mine, eager))
    torch.manual_seed(1)
    step = optimize(mine, my_opt, batches[0], _cross_entropy, check=True, accumulation_steps=2)
    losses = [step(batch) for batch in batches]
    torch.manual_seed(1)
    expected = []
    for index, batch in enumerate(batches):
        loss = _cross_entropy(eager(*batch), batch)
        (loss / 2).backward()
        expected.append(loss.detach())
        if index % 2 == 1:
            eager_opt.step()
            eager_opt.zero_grad()
    assert step.last is not None and "profile" in step.last.context.artifacts, "the plan should profile"
    assert torch.equal(torch.stack(losses), torch.stack(expected))
    assert _equal_states(mine.state_dict(), eager.state_dict())


def test_fitting_a_batch_leaves_the_random_stream_where_it_was() -> None:
    torch.manual_seed(3)
    model = _DropoutClassifier()
    state = torch.get_rng_state()
    fit_batch(model, torch.optim.SGD(model.parameters(), lr=0.1),
              lambda n: (torch.randn(n, 16), torch.randint(0, 4, (n,))), _cross_entropy, "64KiB", start=8)  # fmt: skip
    assert torch.equal(torch.get_rng_state(), state)


def test_freezing_and_unfreezing_layers_captures_again_and_trains_like_eager(
        capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """The fine-tuning recipe: the first layer frozen, unfrozen at step 2, frozen again at step 4.
    The graph computes and applies the gradients of the parameters that require grad only, so each
    change captures again, says so, and every step stays bitwise equal to eager."""
    mine = models.mlp()
    eager = models.Workload(copy.deepcopy(mine.model), mine.batch, mine.loss_fn)
    my_opt, eager_opt = (torch.optim.Adam(w.model.parameters(), lr=1e-2) for w in (mine, eager))
    first_layer = [name for name, _ in mine.model.named_parameters()][:2]

    def freeze(workload: models.Workload, frozen: bool) -> None:
        for name, parameter in workload.model.named_parameters():
            if name in first_layer:
                parameter.requires_grad_(not frozen)

    for workload in (mine, eager):
        freeze(workload, True)
    step = optimize(mine.model, my_opt, mine.batch, mine.loss_fn, budget="min", verbose=True)
    torch.manual_seed(1)
    losses = []
    for index in range(6):
        freeze(mine, index not in (2, 3))
        losses.append(step(mine.batch))
    torch.manual_seed(1)
    expected = []
    for index in range(6):
        freeze(eager, index not in (2, 3))
        expected.append(models.eager_step(eager, eager_opt))
    assert torch.equal(torch.stack(losses), torch.stack(expected))
    assert _equal_states(mine.model.state_dict(), eager.model.state_dict())
    assert _equal_states(my_opt.state_dict()["state"], eager_opt.state_dict()["state"])
    said = [line for line in capsys.readouterr().err.splitlines() if "capturing and optimizing" in line]
    assert said == [f"mutwo: requires_grad changed for 2 parameters ({', '.join(first_layer)}): capturing and "
                    "optimizing the iteration again for it"], said  # fmt: skip


def test_a_param_group_added_captures_again_and_says_so_without_a_warning(
        capsys: pytest.CaptureFixture[str], recwarn: pytest.WarningsRecorder) -> None:  # fmt: skip
    workload = models.mlp()
    parameters = list(workload.model.parameters())
    optimizer = torch.optim.SGD(parameters[2:], lr=0.1)
    for parameter in parameters[:2]:
        parameter.requires_grad_(False)
    step = optimize(workload.model, optimizer, workload.batch, workload.loss_fn, passes="stats", verbose=True)
    step(workload.batch)
    for parameter in parameters[:2]:
        parameter.requires_grad_(True)
    optimizer.add_param_group({"params": parameters[:2], "lr": 0.01})
    step(workload.batch)
    assert ("mutwo: requires_grad changed for 2 parameters (net.0.weight, net.0.bias); the optimizer has 2 param "
            "groups, not 1 (add_param_group): capturing") in capsys.readouterr().err  # fmt: skip
    assert not [w for w in recwarn if "mutwo" in str(w.message)], "only a hyperparameter read at capture warns"


CONTINUE = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {repo!r})
    from mutwo.runtime.api import optimize
    from tests.test_api import _make
    workload, optimizer, scheduler = _make("cnn")
    state = torch.load({checkpoint!r})
    workload.model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    step = optimize(workload.model, optimizer, workload.batch, workload.loss_fn, budget="min")
    for iteration in range({start}, {stop}):
        torch.manual_seed(1000 + iteration)
        step(workload.batch)
        scheduler.step()
    torch.save({{"model": workload.model.state_dict(), "optimizer": optimizer.state_dict()}}, {result!r})
""")


def test_a_checkpoint_saved_half_way_continues_identically_in_a_fresh_process(tmp_path: Path) -> None:
    workload, optimizer, scheduler = _make("cnn")
    step = optimize(workload.model, optimizer, workload.batch, workload.loss_fn, budget="min")
    half = ITERATIONS // 2
    for iteration in range(ITERATIONS):
        if iteration == half:
            checkpoint = tmp_path / "half.pt"
            torch.save({"model": workload.model.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict()}, checkpoint)  # fmt: skip
        torch.manual_seed(1000 + iteration)
        step(workload.batch)
        scheduler.step()
    result = tmp_path / "continued.pt"
    script = CONTINUE.format(repo=str(REPO), checkpoint=str(checkpoint), start=half, stop=ITERATIONS,
                             result=str(result))  # fmt: skip
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    continued = torch.load(result)
    assert _equal_states(continued["model"], workload.model.state_dict())
    assert _equal_states(continued["optimizer"]["state"], optimizer.state_dict()["state"])


def test_a_smaller_last_batch_is_captured_again_and_said(capsys: pytest.CaptureFixture[str]) -> None:
    (mine, my_opt, _), (eager, eager_opt, _) = _make("cnn"), _make("cnn")
    step = optimize(mine.model, my_opt, mine.batch, mine.loss_fn, budget="min", verbose=True)
    capsys.readouterr()
    small = (mine.batch[0][:5], mine.batch[1][:5])
    torch.manual_seed(0)
    loss = step(small)
    assert "a batch of another shape" in capsys.readouterr().err
    eager.batch = (eager.batch[0][:5], eager.batch[1][:5])
    torch.manual_seed(0)
    assert torch.equal(loss, models.eager_step(eager, eager_opt))
    assert len(step.steps) == 2


def test_keep_grads_sets_parameter_gradients_like_backward() -> None:
    (mine, my_opt, _), (eager, eager_opt, _) = _make("cnn"), _make("cnn")
    step = optimize(mine.model, my_opt, mine.batch, mine.loss_fn, keep_grads=True)
    torch.manual_seed(0)
    step(mine.batch)
    torch.manual_seed(0)
    models.eager_step(eager, eager_opt)
    for (name, p), q in zip(mine.model.named_parameters(), eager.model.parameters(), strict=True):
        assert p.grad is not None and torch.equal(p.grad, q.grad), name


def test_check_runs_the_equivalence_check_before_first_use() -> None:
    workload, optimizer, _ = _make("cnn")
    step = optimize(workload.model, optimizer, workload.batch, workload.loss_fn, budget="min", check=True)
    assert step.last is not None and step.last.report is not None and step.last.report.equivalent
