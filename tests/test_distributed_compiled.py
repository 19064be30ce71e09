"""Data-parallel steps under the compiled backends (runtime/execution/compiled_collectives.py,
``backend_refusal`` in runtime/parallel/distributed.py).

Two ranks on CPU with gloo, each in its own process, train from identical state against eager
``DistributedDataParallel`` for 3 iterations under the ``inductor`` backend: a CNN with batch norm
(its buffers broadcast before every forward; SGD with momentum; a recompute plan at budget "min")
and issue 40's TinyLM (attention and dropout, whose masks the compiled step draws as eager does;
AdamW), both given as DDP models with small buckets, so that several all-reduces overlap the
backward. The loss and every averaged gradient at every iteration, then every parameter, buffer
and optimizer state tensor, must agree within :class:`~mutwo.runtime.measurement.equivalence.Tolerance`
(fused kernels round differently; an Adam-updated parameter may move by up to ``lr_factor`` times
the learning rate more, as there). Unlike ``--check``, the iterations follow one another from the
state the last one left, as training does; over 3 tiny steps the rounding stays within the
tolerance. The code Inductor generated is read too: it issues every all-reduce, keeps backward
kernels between the first one and its wait (the overlap eager has), and runs the same kernels and
collectives in the same order on both ranks.

Each model trains in its own pair of processes, both pairs at once: a compile keeps about one of
the machine's 2 cores busy (about two minutes in all with Inductor's cache cold, under one warm).
The same worker runs the CNN on two GPUs with NCCL under every compiled backend (the ``cuda``
test), the CUDA-graph ones recording the collectives in the graph.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch._inductor.utils import run_and_get_code
from torch.nn.parallel import DistributedDataParallel

from mutwo.ir.to_fx import to_fx
from mutwo.runtime.api import optimize
from mutwo.runtime.execution.backends import BackendError
from mutwo.runtime.execution.compiled_collectives import OUT_OF_PLACE, functional_collectives
from mutwo.runtime.execution.cuda_graphs import CudaGraphRunner
from mutwo.runtime.measurement.equivalence import CUDA_ATOL, CUDA_RTOL, Tolerance
from mutwo.runtime.parallel import distributed
from mutwo.runtime.parallel.distributed import DataParallel
from mutwo.runtime.planning.captured import capture_graph
from mutwo.tools import mutwo_opt
from mutwo.tools.cli import EXIT_USAGE
from mutwo.tools.workloads import to_device
from tests import models
from tests.test_distributed import BUCKET_CAP_MB, REPO, _free_port, in_lockstep, rank_group
from tests.tinylm import tinylm

TOLERANCE = Tolerance()
C10D = torch.ops._c10d_functional


@dataclass(frozen=True)
class Case:
    """A model, its batch (the global one) and loss, the optimizer, and the budget planned at."""

    build: Callable[[], tuple[torch.nn.Module, Any, Any]]
    optimizer: str
    budget: str | None


def _cnn() -> tuple[torch.nn.Module, Any, Any]:
    workload = models.cnn(seed=0, batch_size=8)
    return workload.model, workload.batch, workload.loss_fn


CASES: dict[str, Case] = {
    "cnn": Case(_cnn, "sgd", "min"),  # batch norm: buffers broadcast; a recompute plan
    "tinylm": Case(lambda: tinylm(4), "adamw", None),  # attention, dropout, an Adam-updated parameter of noise
}


def _assert_close(mine: torch.Tensor, theirs: torch.Tensor, what: str, within: tuple[float, float]) -> None:
    """Within ``(rtol, atol)`` for floating tensors, equal for the others (step counts)."""
    if not mine.is_floating_point():
        assert torch.equal(mine, theirs), what
        return
    torch.testing.assert_close(mine, theirs, rtol=within[0], atol=within[1],
                               msg=lambda default: f"{what} differs: {default}")  # fmt: skip


def _calls(code: str) -> list[str]:
    """The wrapper's calls, in order, from its ``call`` function (kernels, extern kernels, collectives)."""
    body = code[code.index("def call("):]
    return [line.strip() for line in body.splitlines() if re.match(r"\s+[\w.]+\(", line)]


def _schedule(calls: list[str]) -> str:
    """What every rank must run alike: each kernel's name and each collective whole, in order (the
    rest of a line may name the rank's own device or stream)."""
    return "\n".join(line if "_c10d_functional" in line else line.split("(")[0] for line in calls)


def _assert_overlapping_all_reduces(calls: list[str], buckets: int) -> None:
    """The compiled step issues one all-reduce per bucket, and backward kernels run between the
    first one and the first wait for an all-reduced bucket."""
    issues = [i for i, line in enumerate(calls) if "_c10d_functional.all_reduce_.default(" in line]
    assert len(issues) == buckets, f"{len(issues)} all-reduces in the compiled step for {buckets} buckets"
    reduced = {re.search(r"\((\w+)", calls[i]).group(1) for i in issues}  # type: ignore[union-attr]
    waits = [i for i, line in enumerate(calls) if "_c10d_functional.wait_tensor.default(" in line
             and re.search(r"\((\w+)", line).group(1) in reduced]  # type: ignore[union-attr]  # fmt: skip
    assert len(waits) == buckets and min(waits) > issues[0]
    overlapped = [line for line in calls[issues[0] + 1:min(waits)] if "backward" in line]
    assert overlapped, "no backward kernel runs while the first bucket is all-reduced"


def _against_ddp(rank: int, world: int, device: torch.device, case: str, backend: str) -> None:
    """Train a copy under eager DDP and a copy under mutwo's ``backend`` from the same state, and compare."""
    build, optimizer_name, budget = CASES[case].build, CASES[case].optimizer, CASES[case].budget
    base, batch, loss_fn = build()
    make_optimizer = models.OPTIMIZERS[optimizer_name]
    batch = to_device(distributed.shard_batch(batch, rank, world), device)
    base = base.to(device)
    eager = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=BUCKET_CAP_MB)
    eager_optimizer = make_optimizer(eager.parameters())
    model = copy.deepcopy(base)
    optimizer = make_optimizer(model.parameters())
    given = DistributedDataParallel(model, bucket_cap_mb=BUCKET_CAP_MB)
    step, codes = run_and_get_code(lambda: optimize(given, optimizer, batch, loss_fn, budget=budget, backend=backend,
                                                    check=True, keep_grads=True))  # fmt: skip
    compiled = step.last.step.compiled
    assert compiled is not None and compiled.backend == backend
    buckets = len(step.last.binding.gradient_buckets)
    assert buckets > 1
    if backend.startswith("inductor"):
        calls = _calls(codes[-1])
        _assert_overlapping_all_reduces(calls, buckets)
        schedules: list[Any] = [None] * world
        dist.all_gather_object(schedules, _schedule(calls))
        assert schedules[rank] == schedules[0], "the ranks compiled different kernels or collectives"
    if budget is not None:
        assert step.last.plan is not None and step.last.plan.entries, "the budget should make select recompute"
    # Fused kernels round differently (Inductor); a recorded eager graph runs with capturable
    # optimizer arithmetic (on the device), eager DDP with the stock one: CUDA's tolerances.
    within = (TOLERANCE.rtol, TOLERANCE.atol) if backend.startswith("inductor") else (CUDA_RTOL, CUDA_ATOL)
    adaptive = optimizer_name.startswith("adam")
    base_lr = optimizer.param_groups[0]["lr"]
    for iteration, loss, expected in in_lockstep(step, optimizer, eager, eager_optimizer, loss_fn, batch):
        where = f"{case} under {backend}, rank {rank}, iteration {iteration}"
        _assert_close(loss, expected, f"{where}: the loss", within)
        for (name, mine), theirs in zip(model.named_parameters(), eager.module.parameters(), strict=True):
            _assert_close(mine.grad, theirs.grad, f"{where}: the gradient of {name}", within)
    slack = TOLERANCE.lr_factor * base_lr if adaptive else 0.0
    for (name, mine), theirs in zip(model.named_parameters(), eager.module.parameters(), strict=True):
        _assert_close(mine.detach(), theirs.detach(), f"{case}, rank {rank}: parameter {name}",
                      (within[0], within[1] + slack))  # fmt: skip
    for (name, mine), theirs in zip(model.named_buffers(), eager.module.buffers(), strict=True):
        _assert_close(mine, theirs, f"{case}, rank {rank}: buffer {name}", within)
    ours, theirs_state = optimizer.state_dict()["state"], eager_optimizer.state_dict()["state"]
    assert ours.keys() == theirs_state.keys()
    for index, state in ours.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                _assert_close(value, theirs_state[index][key], f"{case}, rank {rank}: {key} of parameter {index}",
                              within)  # fmt: skip
    if isinstance(compiled.run, CudaGraphRunner):
        assert compiled.run.recordings >= 1, "the step should have been recorded as a CUDA graph"


def _two_rank_worker(rank: int, world: int, port: int, device_type: str, runs: tuple[tuple[str, str], ...]) -> None:
    with rank_group(rank, world, port, device_type) as device:
        for case, backend in runs:
            _against_ddp(rank, world, device, case, backend)


@pytest.mark.slow
def test_two_ranks_on_cpu_train_under_inductor_like_eager_ddp() -> None:
    # Two process groups at once, one per model: a compile keeps about one core busy, and the
    # machine has two.
    spawned = [mp.spawn(_two_rank_worker, args=(2, _free_port(), "cpu", ((case, "inductor"),)), nprocs=2, join=False)
               for case in ("cnn", "tinylm")]  # fmt: skip
    try:
        for context in spawned:
            while not context.join():
                pass
    finally:  # one pair failed: the other's ranks need not train on
        for process in (p for context in spawned for p in context.processes if p.is_alive()):
            process.terminate()


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus_with_nccl_train_under_every_compiled_backend_like_eager_ddp() -> None:
    # TinyLM's attention backward has no deterministic kernel to compare with on every GPU
    runs = tuple(("cnn", backend) for backend in ("inductor", "cudagraphs", "inductor-cudagraphs"))
    mp.spawn(_two_rank_worker, args=(2, _free_port(), "cuda", runs), nprocs=2)


# -- the rewrite Inductor compiles, on one rank ------------------------------------------------------------
def test_collectives_compile_out_of_place_unless_a_buffer_is_read_by_its_old_name(one_rank: None) -> None:
    workload = models.cnn(batch_size=4)
    optimizer = torch.optim.SGD(workload.model.parameters(), lr=0.1)
    graph = capture_graph(workload.model, optimizer, workload.batch, workload.loss_fn,
                          data_parallel=DataParallel.for_group(bucket_cap_mb=BUCKET_CAP_MB)).graph  # fmt: skip
    module = to_fx(graph)
    functional_collectives(module, graph)
    targets = [node.target for node in module.graph.nodes]
    assert not any(target in OUT_OF_PLACE for target in targets), "an in-place collective is left"
    issued = [t for t in targets if t in (C10D.all_reduce.default, C10D.broadcast.default)]
    in_place = [n.target for n in graph if n.is_collective and not n.is_wait]
    assert issued == [OUT_OF_PLACE[t] for t in in_place], "the collectives keep the graph's order"
    # A node after the wait that reads the bucket by the name it had before its all-reduce: eager
    # reads the averaged values, the out-of-place form would read the unaveraged ones.
    issue = next(n for n in graph if n.op_name.startswith("_c10d_functional.all_reduce_"))
    wait = next(n for n in graph if n.is_wait and n.args[0] is issue)
    bucket = issue.args[0]
    graph.create_node("call_function", torch.ops.aten.clone.default, (bucket,), name="late_read", after=wait,
                      phase=wait.phase, tensors=(bucket.tensor,))  # fmt: skip
    with pytest.raises(BackendError, match=r"late_read.*reads the buffer .*all_reduce_.* communicates through"):
        functional_collectives(to_fx(graph), graph)


# -- refused in one line, before anything is captured ------------------------------------------------------
def test_cuda_graphs_refuse_a_gloo_step_naming_the_backend_that_runs_it(one_rank: None) -> None:
    dp = DataParallel.for_group()
    for backend in ("eager", "inductor"):
        assert distributed.backend_refusal(backend, dp) is None
    refusal = distributed.backend_refusal("inductor-cudagraphs", dp)
    assert refusal is not None and "gloo" in refusal and refusal.endswith(
        "use backend='inductor', the fastest backend that runs it")
    workload = models.mlp()
    optimizer = torch.optim.SGD(workload.model.parameters(), lr=0.1)
    with pytest.raises(BackendError, match="runs on gloo, whose collectives run on the host"):
        optimize(workload.model, optimizer, workload.batch, workload.loss_fn, data_parallel=True, backend="cudagraphs")


def test_cuda_graphs_need_a_capturable_nccl_and_a_wait_that_does_not_block(monkeypatch: pytest.MonkeyPatch) -> None:
    dp = DataParallel(group=object(), bucket_limits=(1,))
    monkeypatch.setattr(dist, "get_backend", lambda group: "nccl")
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 9, 5))
    assert "from NCCL 2.9.6 on, and this is NCCL 2.9.5" in distributed.backend_refusal("cudagraphs", dp)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 21, 5))
    assert distributed.backend_refusal("cudagraphs", dp) is None
    monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "1")
    refusal = distributed.backend_refusal("inductor-cudagraphs", dp, "--backend inductor")
    assert refusal is not None and "TORCH_NCCL_BLOCKING_WAIT=1" in refusal and "--backend inductor" in refusal


def test_mutwo_opt_under_torchrun_refuses_a_measured_choice(monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(_free_port())}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    argv = ["--device", "cpu", "--backend", "inductor", "-p", "profile,swap", "--measure-choice",
            str(REPO / "examples" / "tiny_mlp.yaml")]  # fmt: skip
    assert mutwo_opt.main(argv) == EXIT_USAGE
    assert "mutwo-opt: error: --measure-choice plans from what each rank measures on its own" in capsys.readouterr().err
    assert not dist.is_initialized(), "mutwo-opt leaves the process group it joined"


def test_a_measured_choice_is_refused_for_a_data_parallel_step(one_rank: None) -> None:
    workload = models.mlp()
    optimizer = torch.optim.SGD(workload.model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="^measure_choice plans from what each rank measures on its own"):
        optimize(workload.model, optimizer, workload.batch, workload.loss_fn, data_parallel=True,
                 backend="inductor", measure_choice=True)  # fmt: skip


def test_a_step_with_collectives_compiles_without_loop_reordering(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.11's Inductor failed an assertion reordering loops in ResNet-152's data-parallel
    step on two GPUs (``compiled_collectives.ORDER_KEPT``); a step that communicates compiles with
    that pass off, one that does not keeps the user's setting."""
    import torch._inductor.compile_fx as inductor_compile
    from torch._inductor import config

    from mutwo.runtime.execution.backends import compile_inductor

    seen: list[bool] = []

    def spy(module: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Callable[..., Any]:
        seen.append(config.loop_ordering_after_fusion)
        return module

    monkeypatch.setattr(inductor_compile, "compile_fx", spy)
    module = torch.fx.symbolic_trace(lambda x: x + 1)
    with config.patch(loop_ordering_after_fusion=True):
        compile_inductor(module, [torch.ones(2)], communicates=True)
        compile_inductor(module, [torch.ones(2)], communicates=False)
    assert seen == [False, True]
