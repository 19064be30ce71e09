"""FSDP2 steps (runtime/capture/fully_sharded.py, gather_schedule.py): a model sharded with ``fully_shard`` is captured
with its all-gathers and reduce-scatters in the graph.

Two ranks on CPU with gloo, each in its own process, train from identical state against eager
``fully_shard`` for 3 iterations: the loss, every gradient (a DTensor of the local rows, as eager
FSDP2 leaves it) and, at the end, every parameter, buffer and optimizer state tensor must be
bitwise equal, with a recompute plan applied on both ranks. The cases have a dimension that does not
split evenly over two ranks (5 rows), batch norm, dropout, tied weights, and modules kept gathered
(``reshard_after_forward=False``) that the planner gathers again for the backward. The graph's
facts (one all-gather and one reduce-scatter per group, the re-gather FSDP2's
``reshard_after_forward`` asks for, the planner's) and the refusals are checked in this process,
over a group of one rank.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from types import ModuleType

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch._inductor.utils import run_and_get_code

from mutwo.ir.node import Phase
from mutwo.ir.recompute import ALL_GATHER
from mutwo.runtime.api import optimize
from mutwo.runtime.capture.tracing import CaptureError
from mutwo.runtime.measurement.equivalence import Tolerance
from mutwo.runtime.parallel import distributed
from mutwo.runtime.parallel.distributed import DataParallel, DataParallelError
from mutwo.runtime.planning.captured import capture_graph
from mutwo.tools.workloads import to_device
from tests import models
from tests.test_distributed import _assert_same, _free_port, in_lockstep, rank_group
from tests.test_distributed_compiled import _calls, _schedule

TOLERANCE = Tolerance()


def _local(value: object) -> object:
    from torch.distributed.tensor import DTensor

    return value.to_local() if isinstance(value, DTensor) else value


def _assert_same_state(a: dict, b: dict, what: str,
                       compare: Callable[[torch.Tensor, torch.Tensor, str], None] = _assert_same) -> None:  # fmt: skip
    """Every tensor of ``a`` and ``b`` the same type (DTensors as eager FSDP2 keeps them) and values."""
    assert a.keys() == b.keys(), what
    for key in a:
        mine, theirs = _local(a[key]), _local(b[key])
        if isinstance(mine, dict):
            _assert_same_state(mine, theirs, f"{what} {key}", compare)
        elif isinstance(mine, torch.Tensor):
            assert type(a[key]) is type(b[key]), f"{what} {key}: {type(a[key]).__name__} vs {type(b[key]).__name__}"
            compare(mine, theirs, f"{what} {key}")
        else:
            assert mine == theirs, f"{what} {key}"


def _shard(model: nn.Module, layers: Callable[[nn.Module], list[nn.Module]], **options: object) -> nn.Module:
    """fully_shard each of ``layers(model)``, then the model itself, as FSDP2's users do."""
    from torch.distributed.fsdp import fully_shard

    for layer in layers(model):
        fully_shard(layer, **options)
    fully_shard(model, **options)
    return model


def _linears(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


def _bert_layers(model: nn.Module) -> list[nn.Module]:
    return list(model.bert.encoder.layer)


#: name -> (the workload, its optimizer, the modules sharded before the root, fully_shard's options).
CASES: dict[str, tuple[Callable[[], models.Workload], str, Callable[[nn.Module], list[nn.Module]], dict]] = {
    # dropout; the last layer's 5 rows split 3 and 2; the first layer stays gathered for the backward
    "mlp": (lambda: models.mlp(seed=0, batch_size=1024), "sgd", _linears, {}),
    "mlp-kept": (lambda: models.mlp(seed=0, batch_size=128), "adamw", _linears, {"reshard_after_forward": False}),
    "cnn": (lambda: models.cnn(seed=0, batch_size=8), "adam", lambda m: [m.net[0], m.net[4]], {}),  # batch norm
    "bert": (lambda: models.bert(seed=0, batch_size=16), "adamw", _bert_layers, {}),  # tied weights, dropout
}


def _against_fsdp2(rank: int, world: int, device: torch.device, case: str, backend: str = "eager") -> None:
    """Train a copy under eager fully_shard and a copy under mutwo's ``backend`` from the same
    state, and compare everything: bitwise under the eager backend on the CPU, within the compiled
    step's tolerance otherwise (as tests/test_distributed_compiled.py compares with DDP)."""
    build, optimizer_name, layers, options = CASES[case]
    workload = build()
    make_optimizer = models.OPTIMIZERS[optimizer_name]
    batch = to_device(distributed.shard_batch(workload.batch, rank, world), device)
    base = workload.model.to(device)
    eager = _shard(copy.deepcopy(base), layers, **options)
    eager_optimizer = make_optimizer(eager.parameters())
    model = _shard(copy.deepcopy(base), layers, **options)
    optimizer = make_optimizer(model.parameters())
    step, codes = run_and_get_code(lambda: optimize(model, optimizer, batch, workload.loss_fn, budget="min",
                                                    backend=backend, check=True, keep_grads=True))  # fmt: skip
    assert step.last is not None and step.last.plan is not None and step.last.plan.entries, (
        f"{case}: the budget should make select recompute something")  # fmt: skip
    if options.get("reshard_after_forward") is False:  # the planner chose to gather a kept weight again
        regathered = [n for n in _op_nodes(step.last.graph, "all_gather_into_tensor") if n.phase is Phase.BACKWARD]
        assert regathered, f"{case}: no weight gathered again"
    if backend.startswith("inductor"):  # every rank compiled the same kernels and collectives
        schedules: list[object] = [None] * world
        dist.all_gather_object(schedules, _schedule(_calls(codes[-1])))
        assert schedules[rank] == schedules[0], "the ranks compiled different kernels or collectives"
        assert "reduce_scatter_tensor" in schedules[0] and "all_gather_into_tensor" in schedules[0]
    # CUDA (deterministic kernels), and a CUDA graph's capturable optimizer: the compiled tolerance
    compare = _assert_same if backend == "eager" and device.type == "cpu" else _close
    base_lr = optimizer.param_groups[0]["lr"]
    for iteration, loss, expected in in_lockstep(step, optimizer, eager, eager_optimizer, workload.loss_fn, batch):
        compare(loss, expected, f"rank {rank} iteration {iteration}: the loss")
        for (name, mine), theirs in zip(model.named_parameters(), eager.parameters(), strict=True):
            assert type(mine.grad) is type(theirs.grad), f"{name}: the gradient is not a DTensor"
            compare(mine.grad.to_local(), theirs.grad.to_local(),
                    f"rank {rank} iteration {iteration}: the gradient of {name}")  # fmt: skip
    # An Adam-updated parameter may move by up to lr_factor times the learning rate more when compiled.
    slack = TOLERANCE.lr_factor * base_lr if compare is _close and optimizer_name.startswith("adam") else 0.0
    compare_parameters = compare if compare is _assert_same else lambda a, b, what: _close(a, b, what, slack)
    _assert_same_state(model.state_dict(), eager.state_dict(), f"rank {rank}: the model state",
                       compare_parameters)  # fmt: skip
    _assert_same_state(optimizer.state_dict()["state"], eager_optimizer.state_dict()["state"],
                       f"rank {rank}: the optimizer state", compare)  # fmt: skip


def _close(mine: torch.Tensor, theirs: torch.Tensor, what: str, slack: float = 0.0) -> None:
    """Within the compiled step's tolerance (:class:`Tolerance`) for floating tensors, equal for the others."""
    if not mine.is_floating_point():
        assert torch.equal(mine, theirs), what
        return
    # check_device=False: under a CUDA graph a stock Adam's step counts live on the device, in
    # optimizer.state itself, where torch.optim keeps a capturable group's (runtime/capture/optim.py)
    torch.testing.assert_close(mine, theirs, rtol=TOLERANCE.rtol, atol=TOLERANCE.atol + slack, check_device=False,
                               msg=lambda default: f"{what} differs: {default}")  # fmt: skip


def _two_rank_worker(rank: int, world: int, port: int, device_type: str, runs: tuple[tuple[str, str], ...]) -> None:
    with rank_group(rank, world, port, device_type) as device:
        for case, backend in runs:
            _against_fsdp2(rank, world, device, case, backend)


@pytest.mark.slow
def test_two_ranks_on_cpu_train_bitwise_like_eager_fully_shard() -> None:
    mp.spawn(_two_rank_worker, args=(2, _free_port(), "cpu", tuple((case, "eager") for case in CASES)), nprocs=2)


@pytest.mark.slow
def test_two_ranks_on_cpu_train_under_inductor_like_eager_fully_shard() -> None:
    # dropout, an uneven layer, AdamW: the compiled step's collectives and random numbers
    mp.spawn(_two_rank_worker, args=(2, _free_port(), "cpu", (("mlp-kept", "inductor"),)), nprocs=2)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus_with_nccl_train_under_every_backend_like_eager_fully_shard() -> None:
    # NCCL's all-gather and reduce-scatter, recorded in a CUDA graph by the CUDA-graph backends
    runs = tuple((case, backend) for case in ("mlp-kept", "cnn")
                 for backend in ("eager", "inductor", "cudagraphs", "inductor-cudagraphs"))  # fmt: skip
    mp.spawn(_two_rank_worker, args=(2, _free_port(), "cuda", runs), nprocs=2)


# -- the graph, on one rank -----------------------------------------------------------------------------
def _op_nodes(graph: object, op: str) -> list:
    return [n for n in graph if n.is_collective and n.op_name.startswith(f"_c10d_functional.{op}.")]


@pytest.mark.parametrize("reshard", [True, False])
def test_each_group_is_gathered_before_its_first_use_and_again_for_the_backward(one_rank: None,
                                                                                 reshard: bool) -> None:  # fmt: skip
    workload = models.mlp(batch_size=4)
    model = _shard(workload.model, _linears, reshard_after_forward=reshard)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    dp = DataParallel.from_fully_shard(model)
    assert [g.module for g in dp.sharded.groups] == ["net.0", "net.3", "net.5"]  # the root owns no parameter
    graph = capture_graph(model, optimizer, workload.batch, workload.loss_fn, data_parallel=dp).graph
    gathers = _op_nodes(graph, "all_gather_into_tensor")
    forward = [g for g in gathers if g.phase is Phase.FORWARD]
    assert len(forward) == 3 and len(_op_nodes(graph, "reduce_scatter_tensor")) == 3
    # Resharded after the forward, a group whose weights the backward reads is gathered again for
    # it: the last two layers' (their input's gradient reads the weight), not the first's.
    assert len(gathers) - len(forward) == (2 if reshard else 0)
    position = {n.id: i for i, n in enumerate(graph)}
    mms = [n for n in graph if n.phase is Phase.FORWARD and n.op_name.startswith("aten.addmm")]
    for gather, mm in zip(forward, mms, strict=True):  # each layer's gather comes after the last layer's matmul
        assert position[gather.id] < position[mm.id]
    assert position[forward[1].id] > position[mms[0].id], "the second group is gathered after the first layer ran"


def test_the_planner_gathers_a_kept_group_again_where_the_budget_needs_it(
        one_rank: None, evenly_timed: Callable[[ModuleType], None]) -> None:  # fmt: skip
    from mutwo.runtime.planning import captured

    evenly_timed(captured)  # every node at 1 ms: the plan follows from the graph, not this machine's load
    workload = models.mlp(batch_size=64)
    model = _shard(workload.model, _linears, reshard_after_forward=False)  # kept: the planner decides
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = optimize(model, optimizer, workload.batch, workload.loss_fn, budget="min", check=True)
    plan, graph = step.last.plan, step.last.graph
    regathered = [e for e in plan.entries if e["op"] == ALL_GATHER]
    assert regathered, f"at min, select should gather a weight again; it chose {[e['op'] for e in plan.entries]}"
    backward = [n for n in _op_nodes(graph, "all_gather_into_tensor") if n.phase is Phase.BACKWARD]
    assert backward and all(n.name.startswith("all_gather_into_tensor") for n in backward)
    unplanned = _shard(models.mlp(batch_size=64).model, _linears, reshard_after_forward=False)
    kept = optimize(unplanned, torch.optim.AdamW(unplanned.parameters(), lr=1e-2), workload.batch, workload.loss_fn)
    assert not [n for n in _op_nodes(kept.last.graph, "all_gather_into_tensor") if n.phase is Phase.BACKWARD]


def test_fully_shard_options_mutwo_would_compute_differently_are_refused(one_rank: None) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    workload = models.mlp()
    mixed = _shard(copy.deepcopy(workload.model), _linears, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    with pytest.raises(DataParallelError, match="mixed precision policy on net.0 is not supported"):
        optimize(mixed, torch.optim.SGD(mixed.parameters(), lr=0.1), workload.batch, workload.loss_fn)
    sharded = _shard(copy.deepcopy(workload.model), _linears)
    with pytest.raises(CaptureError, match="max_grad_norm is not supported with fully_shard"):
        optimize(sharded, torch.optim.SGD(sharded.parameters(), lr=0.1), workload.batch, workload.loss_fn,
                 max_grad_norm=1.0)  # fmt: skip
    with pytest.raises(CaptureError, match="Adafactor is not an element-wise"):
        optimize(sharded, torch.optim.Adafactor(sharded.parameters()), workload.batch, workload.loss_fn)
    with pytest.raises(DataParallelError, match="drop data_parallel=False"):
        optimize(sharded, torch.optim.SGD(sharded.parameters(), lr=0.1), workload.batch, workload.loss_fn,
                 data_parallel=False)  # fmt: skip
    from torch.distributed.fsdp import fully_shard

    partial = copy.deepcopy(workload.model)
    fully_shard(partial.net[0])
    with pytest.raises(DataParallelError, match="apply fully_shard\\(model\\) last"):
        optimize(partial, torch.optim.SGD(partial.parameters(), lr=0.1), workload.batch, workload.loss_fn)
    assert dist.is_initialized()


def test_cpu_offload_is_refused() -> None:
    from types import SimpleNamespace

    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    from mutwo.runtime.capture.fully_sharded import FullyShardedError, _refuse_policies

    def module(offload: OffloadPolicy) -> SimpleNamespace:  # CPUOffloadPolicy needs a GPU to be applied
        group = SimpleNamespace(mp_policy=None, offload_policy=offload)
        return SimpleNamespace(_get_fsdp_state=lambda: SimpleNamespace(_fsdp_param_group=group))

    _refuse_policies(module(OffloadPolicy()), "layers.0")  # fully_shard's default: nothing offloaded
    with pytest.raises(FullyShardedError, match="CPUOffloadPolicy on layers.0 is not supported"):
        _refuse_policies(module(CPUOffloadPolicy()), "layers.0")


def test_optimizer_state_of_the_whole_parameter_is_refused(one_rank: None) -> None:
    from mutwo.runtime.capture.fully_sharded import FullyShardedError

    workload = models.mlp()
    model = _shard(workload.model, _linears)
    sharded = DataParallel.from_fully_shard(model).sharded
    weight = dict(model.named_parameters())["net.0.weight"]
    assert sharded.padded("net.0.weight", weight).shape == weight.shape  # one rank: the whole parameter
    with pytest.raises(FullyShardedError, match="a state tensor of net.0.weight is a plain tensor of shape"):
        sharded.padded("net.0.weight", torch.zeros(8, 16))
