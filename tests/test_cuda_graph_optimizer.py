"""A stock optimizer under the CUDA-graph backends (docs/backends.md, "A stock optimizer under CUDA
graphs").

For a step recorded as a CUDA graph, mutwo traces torch.optim's capturable form of the update
where the optimizer has one, feeds its learning rate as a float64 tensor on the device (written
from ``param_groups`` at every call) and keeps its step counts on the device in
``optimizer.state``; the user's optimizer object, param groups, state dict and schedulers behave
as in eager. An optimizer without that form whose only host numbers are its hyperparameters (SGD)
is recorded again when one changes; one whose state stays on the host (Adagrad) is refused.

On a GPU (marked ``cuda``): training is bitwise equal to the same optimizer made capturable with
its learning rate on the device (``graphable_optimizer``'s form) under ``cudagraphs``, within the
compiled tolerance under ``inductor-cudagraphs``; SGD is bitwise equal to eager SGD. On the CPU: the
capture-side choices, the refusals (fake CUDA tensors stand in for the GPU's) and when the runner
records again.
"""

from __future__ import annotations

import copy
import json
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import mutwo
from mutwo.runtime.api import capture_key
from mutwo.runtime.capture.device_state import state_for_cuda_graphs
from mutwo.runtime.capture.iteration import capture
from mutwo.runtime.capture.optim import (
    SCHEDULED_LABEL,
    UnsupportedOptimizerError,
    init_state,
    made_capturable,
    scheduled_entries,
    scheduled_inputs,
)
from mutwo.runtime.execution.cuda_graphs import CudaGraphRunner, graphable_optimizer, refuse_uncapturable
from mutwo.runtime.execution.errors import BackendError
from mutwo.runtime.measurement.equivalence import deterministic_algorithms
from mutwo.runtime.planning.captured import capture_graph
from tests import models
from tests.test_optim import CONFIGS, bitwise_equal, first_difference

REPO = Path(__file__).resolve().parents[1]
STEPS = 5


# -- on the CPU: what capture decides ------------------------------------------------------------
def _group(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return optimizer.param_groups[0]


def test_a_group_with_the_option_is_traced_capturable_for_a_cuda_graph_and_its_rate_fed_on_the_device() -> None:
    params = [nn.Parameter(torch.randn(3))]
    adamw = torch.optim.AdamW(params, lr=1e-3)
    assert scheduled_entries(_group(adamw)) == [("lr", None), ("betas", 0), ("betas", 1)]
    assert made_capturable(_group(adamw), True) and not made_capturable(_group(adamw), False)
    assert scheduled_entries(_group(adamw), graphed=True) == [("lr", None)]  # betas: constants of that form
    (rate,) = scheduled_inputs(_group(adamw), graphed=True)
    assert rate.dtype == torch.float64 and rate.device == params[0].device and rate.item() == 1e-3
    assert _group(adamw)["capturable"] is False and isinstance(_group(adamw)["lr"], float)  # the user's, as given
    # SGD has no capturable form: its rate and momentum stay host numbers (the runner records again on a change).
    sgd = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    assert not made_capturable(_group(sgd), True)
    assert scheduled_entries(_group(sgd), graphed=True) == [("lr", None), ("momentum", None)]
    assert all(t.device.type == "cpu" for t in scheduled_inputs(_group(sgd), graphed=True))
    # A group the user made capturable is traced as the user made it.
    already = torch.optim.Adam(params, lr=1e-3, capturable=True)
    assert not made_capturable(_group(already), True)


def test_for_a_cuda_graph_betas_become_constants_the_capture_key_holds() -> None:
    """In the capturable form betas are constants of the graph: a change (a scheduler cycling them)
    must capture again, where the graph of the non-capturable form reads them at every call."""
    workload = models.mlp()
    optimizer = torch.optim.AdamW(workload.model.parameters(), lr=1e-3)
    before = {graphed: capture_key(workload.model, optimizer, workload.batch, graphed) for graphed in (False, True)}
    _group(optimizer)["lr"] = 5e-4  # a graph input in both
    assert all(capture_key(workload.model, optimizer, workload.batch, g) == before[g] for g in (False, True))
    _group(optimizer)["betas"] = (0.8, 0.999)
    assert capture_key(workload.model, optimizer, workload.batch, False) == before[False]
    assert capture_key(workload.model, optimizer, workload.batch, True) != before[True]


def _meta_parameters() -> list[nn.Parameter]:
    """Parameters on the meta device: off the CPU, as on a GPU, without one."""
    return [nn.Parameter(torch.empty(5, device="meta")), nn.Parameter(torch.empty(2, 3, device="meta"))]


def test_step_counts_move_to_the_parameters_device_in_the_users_state() -> None:
    params = _meta_parameters()
    adam = torch.optim.Adam(params, lr=1e-3)
    init_state(adam, params)
    assert all(adam.state[p]["step"].device.type == "cpu" for p in params)  # torch.optim's non-capturable place
    kept = state_for_cuda_graphs(adam, params)
    assert kept == set(params)
    for p in params:
        step = adam.state[p]["step"]
        assert step.device == p.device and step.dtype == torch.float32  # where and how capturable keeps it
    assert _group(adam)["capturable"] is False
    sgd = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    init_state(sgd, params)
    assert state_for_cuda_graphs(sgd, params) == set()  # its momentum buffers are on the device already


def test_an_optimizer_without_the_option_whose_state_stays_on_the_host_is_refused_in_one_sentence() -> None:
    params = _meta_parameters()
    adagrad = torch.optim.Adagrad(params, lr=1e-2)
    with pytest.raises(UnsupportedOptimizerError) as refused:
        state_for_cuda_graphs(adagrad, params)
    message = str(refused.value)
    assert message.startswith("torch.optim.Adagrad keeps its step on the CPU and has no capturable option")
    assert "eager or inductor backend" in message and "\n" not in message
    assert all(adagrad.state[p]["step"].device.type == "cpu" for p in params)  # nothing moved


def test_a_cpu_step_is_captured_as_before_whatever_the_backend() -> None:
    workload = models.mlp()
    optimizer = torch.optim.AdamW(workload.model.parameters(), lr=1e-3)
    graphed, binding = capture(workload.model, optimizer, workload.batch, workload.loss_fn, graphed=True)
    plain, _ = capture(workload.model, optimizer, workload.batch, workload.loss_fn)
    assert not binding.graphed and not binding.device_state
    assert [s.label for s in graphed.slots] == [s.label for s in plain.slots]


def _on_fake_cuda(inputs: list[torch.Tensor], labels: list[str], keep_on_cpu: Callable[[str], bool]) -> list[Any]:
    """The inputs as a GPU step would have them: fake CUDA tensors, but those ``keep_on_cpu`` names."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        return [t if keep_on_cpu(label) else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda")
                for t, label in zip(inputs, labels, strict=True)]  # fmt: skip


def test_cuda_graphs_take_an_optimizers_scheduled_hyperparameters_on_the_host_and_refuse_other_cpu_inputs() -> None:
    """SGD's learning rate and momentum on the CPU may be recorded (recorded again when they change);
    a non-capturable Adam's step counts on the CPU may not, and the refusal names them in one line."""
    workload = models.mlp()
    sgd = capture_graph(workload.model, torch.optim.SGD(workload.model.parameters(), lr=0.1, momentum=0.9),
                        workload.batch, workload.loss_fn)  # fmt: skip
    labels = [p.label for p in sgd.graph.placeholders]
    assert {"lr:group0", "momentum:group0"} <= set(labels)
    scheduled = _on_fake_cuda(sgd.inputs, labels, lambda label: bool(SCHEDULED_LABEL.fullmatch(label)))
    refuse_uncapturable(sgd.graph, scheduled)  # nothing refused

    workload = models.mlp()
    adam = capture_graph(workload.model, torch.optim.Adam(workload.model.parameters(), lr=1e-3), workload.batch,
                         workload.loss_fn)  # fmt: skip
    labels = [p.label for p in adam.graph.placeholders]
    on_host = _on_fake_cuda(adam.inputs, labels, lambda label: label.endswith(":step") or label == "lr:group0")
    with pytest.raises(BackendError) as refused:
        refuse_uncapturable(adam.graph, on_host)
    message = str(refused.value)
    assert "cannot record a step that reads CPU tensors on the host (6: " in message and ":step" in message
    assert "lr:group0" not in message and "\n" not in message
    with pytest.raises(BackendError, match="need the model, optimizer state and batch on a CUDA device"):
        refuse_uncapturable(adam.graph, adam.inputs)


class _Replay:
    """A stand-in for a recorded graph on the CPU: its replay runs the step on the recording's inputs."""

    def __init__(self, runner: CudaGraphRunner) -> None:
        self.runner = runner

    def replay(self) -> None:
        self.runner.outputs = self.runner.run(*self.runner.static)

    def reset(self) -> None:
        """As ``torch.cuda.CUDAGraph.reset``, which a release calls: nothing to free here."""


class _CpuRunner(CudaGraphRunner):
    """The runner with recording replaced by keeping its inputs: when it records is what is tested."""

    def record(self, flat: Any) -> None:
        self.release()
        self.take_inputs(flat)
        self.graph = _Replay(self)  # type: ignore[assignment]
        self.recordings += 1


def test_the_runner_records_again_when_a_host_value_changes_and_warns_when_it_changes_at_every_step() -> None:
    weight = torch.zeros(3)

    def sgd_like(w: torch.Tensor, lr: torch.Tensor) -> tuple[torch.Tensor]:
        w.sub_(lr.item())  # a kernel launched with a host number: a recording would keep its value
        return (w.sum(),)

    runner = _CpuRunner(sgd_like, [True, False], ["w", "lr:group0"])
    rate = torch.tensor(0.5, dtype=torch.float64)
    for _ in range(3):
        runner(weight, rate.clone())
    assert runner.recordings == 1 and torch.equal(weight, torch.full((3,), -1.5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one change (StepLR): recorded again, nothing said
        runner(weight, torch.tensor(0.25, dtype=torch.float64))
        runner(weight, torch.tensor(0.25, dtype=torch.float64))
    assert runner.recordings == 2 and runner.host_value_recordings == 1
    assert torch.equal(weight, torch.full((3,), -2.0))
    runner(weight, torch.tensor(0.125, dtype=torch.float64))
    with pytest.warns(UserWarning, match=r"lr:group0 changed again; .* pays for a recording at every step"):
        runner(weight, torch.tensor(0.0625, dtype=torch.float64))
    assert runner.recordings == 4 and torch.equal(weight, torch.full((3,), -2.1875))


def test_a_training_loops_runner_runs_its_first_call_unrecorded_and_records_at_the_second() -> None:
    """``defer_recording`` (a training loop's step): the first call is a real step, with no warm-up
    and no recording; the second records; the state is stepped once per call either way."""
    for deferred in (False, True):
        weight = torch.zeros(3)
        runner = _CpuRunner(lambda w: (w.sub_(0.5).sum(),), [True], ["w"])
        runner.defer_recording = deferred
        assert runner.will_record([weight]) is not deferred
        loss = runner(weight)[0]
        assert (runner.recordings, runner.ran) == ((0, True) if deferred else (1, False))
        assert loss.item() == -1.5 and torch.equal(weight, torch.full((3,), -0.5))
        assert runner.will_record([weight]) is deferred
        runner(weight)
        runner(weight)
        assert runner.recordings == 1 and not runner.will_record([weight])
        assert runner.will_record([weight.clone()]), "state replaced (load_state_dict): recorded again"
        assert torch.equal(weight, torch.full((3,), -1.5))


# -- on a GPU ------------------------------------------------------------------------------------
DEVICE = torch.device("cuda")


def _layer_norm_mlp() -> models.Workload:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 64), nn.LayerNorm(64),
                        nn.GELU(), nn.Linear(64, 10))  # fmt: skip
    batch = (torch.randn(16, 32), torch.randint(0, 10, (16,)))
    return models.Workload(models.Classifier(net), batch, models.cross_entropy)


MODELS: dict[str, Callable[[], models.Workload]] = {"layer-norm-mlp": _layer_norm_mlp, "bert": models.bert}
#: Inductor cannot draw SDPA's attention dropout as eager does (refused): BERT with eager attention.
COMPILED_MODELS: dict[str, Callable[[], models.Workload]] = {
    "layer-norm-mlp": _layer_norm_mlp, "bert-eager-attention": lambda: models.bert(attn="eager")}


def _on_cuda(workload: models.Workload) -> models.Workload:
    workload.model.to(DEVICE)
    workload.batch = torch.utils._pytree.tree_map(lambda t: t.to(DEVICE), workload.batch)
    return workload


def _twins(make: Callable[[], models.Workload]) -> tuple[models.Workload, models.Workload]:
    mine = _on_cuda(make())
    return mine, models.Workload(copy.deepcopy(mine.model), mine.batch, mine.loss_fn)


def _capturable(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The eager reference: the same optimizer, capturable, its learning rates float64 tensors on the GPU."""
    graphable_optimizer(optimizer, DEVICE)
    return optimizer


@pytest.fixture
def no_recapture(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """How many times ``optimize_graph`` captured and planned the step."""
    from mutwo.runtime import api

    captures: list[int] = []
    planning = api.optimize_graph
    monkeypatch.setattr(api, "optimize_graph", lambda *a, **k: captures.append(1) or planning(*a, **k))
    yield captures


def _train_adamw(make: Callable[[], models.Workload], backend: str, captures: list[int]) -> dict[str, Any]:
    """Train a stock AdamW with StepLR through mutwo and its capturable twin eagerly, side by side."""
    mine, theirs = _twins(make)
    my_opt = torch.optim.AdamW(mine.model.parameters(), lr=1e-3)
    their_opt = _capturable(torch.optim.AdamW(theirs.model.parameters(), lr=1e-3))
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (my_opt, their_opt)]
    losses = []
    with deterministic_algorithms(), warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        step = mutwo.optimize(mine.model, my_opt, mine.batch, mine.loss_fn, backend=backend)
        for index in range(STEPS):
            torch.manual_seed(index)
            loss = step(mine.batch)
            torch.manual_seed(index)
            losses.append((loss, models.eager_step(theirs, their_opt)))
            for scheduler in schedulers:
                scheduler.step()
            if index == 1:  # recorded by now: at the first call when planning ran the step, else at the second
                first_recordings = _runner(step).recordings
    return {"mine": mine, "theirs": theirs, "my_opt": my_opt, "their_opt": their_opt, "step": step,
            "losses": losses, "warnings": [str(w.message) for w in said], "captures": len(captures),
            "first_recordings": first_recordings}  # fmt: skip


def _runner(step: mutwo.MutwoStep) -> CudaGraphRunner:
    """The CUDA-graph runner of the graph the step's latest call ran."""
    assert step.last is not None and step.last.step is not None and step.last.step.compiled is not None
    runner = step.last.step.compiled.run
    assert isinstance(runner, CudaGraphRunner)
    return runner


def _assert_the_users_optimizer_is_as_in_eager(run: dict[str, Any]) -> None:
    my_opt, their_opt = run["my_opt"], run["their_opt"]
    assert type(my_opt) is torch.optim.AdamW
    for mine, theirs in zip(my_opt.param_groups, their_opt.param_groups, strict=True):
        assert mine["capturable"] is False and type(mine["lr"]) is float and mine["lr"] == theirs["lr"].item()
        assert mine["lr"] == 1e-3 * 0.5 ** (STEPS // 2)  # StepLR went on as in eager
    warned = "_warned_capturable_if_run_uncaptured"  # torch.optim's own flag, as a stock optimizer has it
    assert vars(my_opt).get(warned) == vars(torch.optim.AdamW([nn.Parameter(torch.zeros(1))])).get(warned)
    assert not [w for w in run["warnings"] if "capturable" in w], run["warnings"]
    for state in my_opt.state.values():
        assert state["step"].is_cuda and state["step"].dtype == torch.float32 and state["step"].item() == STEPS
    assert run["captures"] == 1, "a learning rate change captured the step again"
    assert _runner(run["step"]).recordings == run["first_recordings"], "a learning rate change recorded it again"


@pytest.mark.cuda
@pytest.mark.parametrize("make", sorted(MODELS))
def test_cuda_stock_adamw_with_a_scheduler_trains_bitwise_like_its_capturable_twin(
        make: str, no_recapture: list[int]) -> None:  # fmt: skip
    run = _train_adamw(MODELS[make], "cudagraphs", no_recapture)
    for index, (loss, expected) in enumerate(run["losses"]):
        assert bitwise_equal(loss, expected), f"loss at step {index}: {loss.item()} vs {expected.item()}"
    difference = first_difference(run["mine"].model, run["my_opt"], run["theirs"].model, run["their_opt"])
    assert difference is None, difference
    _assert_the_users_optimizer_is_as_in_eager(run)


@pytest.mark.cuda
@pytest.mark.parametrize("make", sorted(COMPILED_MODELS))
def test_cuda_stock_adamw_under_inductor_cudagraphs_trains_within_the_compiled_tolerance(
        make: str, no_recapture: list[int]) -> None:  # fmt: skip
    run = _train_adamw(COMPILED_MODELS[make], "inductor-cudagraphs", no_recapture)
    for loss, expected in run["losses"]:
        torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-5)
    # Adam moves a parameter whose gradient is rounding noise by up to its learning rate a step.
    for (name, p), q in zip(run["mine"].model.named_parameters(), run["theirs"].model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-5 + STEPS * 2 * 1e-3, msg=name)
    _assert_the_users_optimizer_is_as_in_eager(run)


@pytest.mark.cuda
def test_cuda_the_state_dict_loads_into_a_fresh_stock_optimizer_and_a_checkpoint_loads_back(
        no_recapture: list[int]) -> None:  # fmt: skip
    """After training: the state dict (step counts on the GPU, capturable=False, float rates) loads
    into a fresh stock AdamW, whose eager step equals one from the capturable twin's state dict; and
    a checkpoint saved by eager training (step counts on the CPU) loads back into the trained
    optimizer, which moves them to the GPU, records again, and goes on like the twin loading it."""
    run = _train_adamw(_layer_norm_mlp, "cudagraphs", no_recapture)
    mine, theirs, my_opt, their_opt = run["mine"], run["theirs"], run["my_opt"], run["their_opt"]
    saved = copy.deepcopy(my_opt.state_dict())
    assert all(g["capturable"] is False and type(g["lr"]) is float for g in saved["param_groups"])
    twins = copy.deepcopy(their_opt.state_dict())
    for group in twins["param_groups"]:  # the twin's as a stock optimizer's: what differs is the step counts' place
        group["capturable"], group["lr"] = False, float(group["lr"])
    fresh = []
    for workload, state in ((mine, saved), (theirs, twins)):
        model = copy.deepcopy(workload.model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        optimizer.load_state_dict(state)
        with deterministic_algorithms():
            models.eager_step(models.Workload(model, workload.batch, workload.loss_fn), optimizer)
        fresh.append((model, optimizer))
    difference = first_difference(fresh[0][0], fresh[0][1], fresh[1][0], fresh[1][1])
    assert difference is None, difference

    eager = models.Workload(copy.deepcopy(mine.model), mine.batch, mine.loss_fn)
    eager_opt = torch.optim.AdamW(eager.model.parameters(), lr=1e-3)  # stock, trained eagerly: steps on the CPU
    torch.optim.lr_scheduler.StepLR(eager_opt, step_size=2, gamma=0.5)  # its groups' keys as the trained ones'
    with deterministic_algorithms():
        models.eager_step(eager, eager_opt)
    checkpoint = copy.deepcopy({"model": eager.model.state_dict(), "optimizer": eager_opt.state_dict()})
    assert all(s["step"].device.type == "cpu" for s in checkpoint["optimizer"]["state"].values())
    for workload in (mine, theirs):
        workload.model.load_state_dict(checkpoint["model"])
    my_opt.load_state_dict(copy.deepcopy(checkpoint["optimizer"]))
    as_capturable = copy.deepcopy(checkpoint["optimizer"])
    for group in as_capturable["param_groups"]:  # the twin stays capturable: torch moves its counts to the GPU
        group["capturable"] = True
    their_opt.load_state_dict(as_capturable)
    _capturable(their_opt)
    with deterministic_algorithms():
        torch.manual_seed(0)
        loss = run["step"](mine.batch)
        torch.manual_seed(0)
        expected = models.eager_step(theirs, their_opt)
    assert bitwise_equal(loss, expected)
    assert all(s["step"].is_cuda for s in my_opt.state.values())
    difference = first_difference(mine.model, my_opt, theirs.model, their_opt)
    assert difference is None, difference
    assert len(no_recapture) == 1  # the same graph, recorded again: the loaded state is at other addresses
    assert _runner(run["step"]).recordings == run["first_recordings"] + 1


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["cudagraphs", "inductor-cudagraphs"])
def test_cuda_stock_sgd_with_momentum_is_recorded_again_when_its_rate_changes(
        backend: str, no_recapture: list[int]) -> None:  # fmt: skip
    """SGD has no capturable form and computes with its rate on the host: the step is recorded
    again (not captured again) when StepLR changes it, and stays equal to eager SGD, bitwise
    under cudagraphs."""
    mine, theirs = _twins(_layer_norm_mlp)
    my_opt, their_opt = (torch.optim.SGD(w.model.parameters(), lr=0.05, momentum=0.9) for w in (mine, theirs))
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (my_opt, their_opt)]
    with deterministic_algorithms():
        step = mutwo.optimize(mine.model, my_opt, mine.batch, mine.loss_fn, backend=backend)
        for index in range(STEPS):
            loss, expected = step(mine.batch), models.eager_step(theirs, their_opt)
            if index == 1:  # recorded by now: at the first call when planning ran the step, else at the second
                first_recordings = _runner(step).recordings
            if backend == "cudagraphs":
                assert bitwise_equal(loss, expected), f"loss at step {index}"
            else:
                torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-5)
            for scheduler in schedulers:
                scheduler.step()
    if backend == "cudagraphs":
        difference = first_difference(mine.model, my_opt, theirs.model, their_opt)
        assert difference is None, difference
    else:
        for p, q in zip(mine.model.parameters(), theirs.model.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-5)
    runner = _runner(step)
    changes = (STEPS - 1) // 2  # StepLR's after steps 2 and 4
    assert len(no_recapture) == 1 and runner.recordings - first_recordings == changes == runner.host_value_recordings
    assert type(my_opt.param_groups[0]["lr"]) is float


def _set(group: dict[str, Any], key: str, value: Any) -> None:
    """Set a hyperparameter as a scheduler does: a tensor learning rate in place."""
    if isinstance(group[key], torch.Tensor):
        group[key].fill_(value)
    else:
        group[key] = value


def _dots() -> models.Workload:
    from tests.test_optim import _Dots, _loss

    torch.manual_seed(0)
    return models.Workload(_Dots(), (torch.randn(1031), torch.randn(7, 13)), _loss)


@pytest.mark.cuda
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_cuda_every_stock_optimizer_under_cuda_graphs_trains_like_its_capturable_form_or_is_refused(
        config: str, no_recapture: list[int]) -> None:  # fmt: skip
    """Each of tests/test_optim.py's optimizers, stock, under cudagraphs, its rate (and momentum or
    betas[0]) changed half way as OneCycleLR would: bitwise equal to its capturable form with the
    rate on the GPU where torch.optim has one (a change of betas or momentum, constants of that form,
    captures once more), to eager where it has none (SGD: recorded again), or refused (Adagrad)."""
    mine, theirs = _twins(_dots)
    my_opt = CONFIGS[config](mine.model.parameters())
    their_opt = CONFIGS[config](theirs.model.parameters())
    capturable = "capturable" in _group(my_opt)
    if capturable:
        _capturable(their_opt)
    if config.startswith("adagrad"):
        with pytest.raises(UnsupportedOptimizerError, match="^torch.optim.Adagrad keeps its step on the CPU"):
            mutwo.optimize(mine.model, my_opt, mine.batch, mine.loss_fn, backend="cudagraphs", passes="stats")
        return
    base = {key: _group(my_opt)[key] for key in ("lr", "momentum", "betas") if key in _group(my_opt)}
    generator = torch.Generator(DEVICE).manual_seed(1234)
    with deterministic_algorithms():
        step = mutwo.optimize(mine.model, my_opt, mine.batch, mine.loss_fn, backend="cudagraphs", passes="stats")
        for index in range(2 * STEPS):
            if index == STEPS:
                for optimizer in (my_opt, their_opt):
                    _set(_group(optimizer), "lr", base["lr"] * 0.37)
                    if base.get("momentum"):
                        _set(_group(optimizer), "momentum", base["momentum"] * 0.95)
                    if "betas" in base:
                        _set(_group(optimizer), "betas", (base["betas"][0] * 0.95, base["betas"][1]))
            batch = (torch.randn(1031, generator=generator, device=DEVICE),
                     torch.randn(7, 13, generator=generator, device=DEVICE))  # fmt: skip
            loss = step(batch)
            expected = models.eager_step(models.Workload(theirs.model, batch, theirs.loss_fn), their_opt)
            assert bitwise_equal(loss, expected), f"loss at step {index}"
            difference = first_difference(mine.model, my_opt, theirs.model, their_opt)
            assert difference is None, f"{difference} after step {index}"
    constants = capturable and ("betas" in base or base.get("momentum"))
    fresh = config == "sgd-dampening"  # its first step creates the momentum buffer: the next graph reads it
    assert len(no_recapture) == 1 + bool(constants) + fresh
    assert type(_group(my_opt)["lr"]) is float and _group(my_opt).get("capturable") in (False, None)


@pytest.mark.cuda
def test_cuda_a_capturable_group_with_a_float_rate_is_recorded_again_when_the_rate_changes(
        no_recapture: list[int]) -> None:  # fmt: skip
    """A group the user made capturable is traced as the user made it: a float learning rate stays a
    host number, and the step is recorded again when it changes, bitwise equal to eager."""
    mine, theirs = _twins(_dots)
    my_opt, their_opt = (torch.optim.Adam(w.model.parameters(), lr=1e-2, capturable=True) for w in (mine, theirs))
    with deterministic_algorithms():
        step = mutwo.optimize(mine.model, my_opt, mine.batch, mine.loss_fn, backend="cudagraphs", passes="stats")
        for index in range(2 * STEPS):
            if index == STEPS:
                for optimizer in (my_opt, their_opt):
                    _group(optimizer)["lr"] = 1e-2 * 0.37
            loss, expected = step(mine.batch), models.eager_step(theirs, their_opt)
            assert bitwise_equal(loss, expected), f"loss at step {index}"
    difference = first_difference(mine.model, my_opt, theirs.model, their_opt)
    assert difference is None, difference
    assert len(no_recapture) == 1 and _runner(step).host_value_recordings == 1


@pytest.mark.cuda
def test_cuda_an_optimizer_reading_a_gpu_tensor_on_the_host_is_refused_in_one_line() -> None:
    """Adagrad with its step counts put on the GPU by hand: its non-capturable update reads them with
    ``.item()``, which a recording would freeze."""
    mine = _on_cuda(_dots())
    adagrad = torch.optim.Adagrad(mine.model.parameters(), lr=1e-2)
    for state in adagrad.state.values():
        state["step"] = state["step"].to(DEVICE)
    with pytest.raises(BackendError, match=r"cannot record this step: node .* reads a tensor's value on the host"):
        mutwo.optimize(mine.model, adagrad, mine.batch, mine.loss_fn, backend="cudagraphs", passes="stats")


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["cudagraphs", "inductor-cudagraphs"])
def test_cuda_mutwo_opt_takes_a_configs_stock_optimizer_under_cuda_graphs(backend: str, tmp_path: Path) -> None:
    """examples/tiny_mlp.yaml's optimizer is a stock Adam: planned, recorded and checked."""
    from mutwo.tools.mutwo_opt import EXIT_OK, main

    out = tmp_path / "out"
    code = main(["-q", "--device", "cuda", "--backend", backend, "--check", "-o", str(out),
                 str(REPO / "examples" / "tiny_mlp.yaml")])  # fmt: skip
    assert code == EXIT_OK
    assert json.loads((out / "summary.json").read_text())["equivalent"] is True
