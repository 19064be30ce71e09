"""Data-parallel iterations (runtime/capture/collectives.py, runtime/parallel/distributed.py).

Two ranks on CPU with gloo, each in its own process, train from identical state against eager
``DistributedDataParallel`` for 3 iterations: the loss, every averaged gradient and, at the end,
every parameter, buffer and optimizer state tensor must be bitwise equal, with a recompute plan
applied on both ranks (the same plan). With two ranks a sum across ranks is one addition, the same
in any order, so DDP's first iteration (one bucket, before it rebuilds them) and mutwo's buckets
give the same bits. The cases (``CASES``): a CNN with batch norm given as a DDP model with small
buckets, an MLP with a detected process group and DDP's default buckets, and a tiny BERT (tied
weights, dropout) as a DDP model. The same worker runs on two GPUs with NCCL (the ``cuda`` test,
CNN and MLP), compared within the CUDA tolerances of ``runtime/measurement/equivalence.py``. The IR
facts (kinds, aliasing of waits, the ``collective-wait`` invariant) are checked in this process, over
a group of one rank.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime
import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from mutwo.ir.graph import Graph
from mutwo.ir.liveness import compute_liveness
from mutwo.ir.node import Node, NodeKind, Phase
from mutwo.ir.pass_base import PassContext
from mutwo.ir.verifier import VerificationError, verify
from mutwo.passes.dce import DeadCodeEliminationPass
from mutwo.runtime.api import optimize
from mutwo.runtime.execution.cuda_graphs import release_all
from mutwo.runtime.measurement.equivalence import CUDA_ATOL, CUDA_RTOL, deterministic_algorithms
from mutwo.runtime.parallel import distributed
from mutwo.runtime.parallel.distributed import DataParallel, DataParallelError
from mutwo.runtime.planning import peak_calibration
from mutwo.runtime.planning.captured import capture_graph
from mutwo.tools.workloads import to_device
from tests import models

REPO = Path(__file__).resolve().parent.parent
#: Small enough that the tiny models' gradients fill several buckets.
BUCKET_CAP_MB = 0.002
LR_FACTORS = (1.0, 0.5, 0.5)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _collectives(graph: Graph, op: str) -> list[Node]:
    return [n for n in graph if n.is_collective and n.op_name.startswith(f"_c10d_functional.{op}.")]


# -- two ranks against eager DistributedDataParallel ---------------------------------------------------
def _assert_same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if a.device.type == "cpu":
        assert torch.equal(a, b), f"{what} differs (max |diff| {(a.double() - b.double()).abs().max():.3g})"
    else:
        torch.testing.assert_close(a, b, rtol=CUDA_RTOL, atol=CUDA_ATOL, msg=f"{what} differs")


def _assert_same_state(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for key in a:
        if isinstance(a[key], dict):
            _assert_same_state(a[key], b[key], f"{what} {key}")
        elif isinstance(a[key], torch.Tensor):
            _assert_same(a[key], b[key], f"{what} {key}")
        else:
            assert a[key] == b[key], f"{what} {key}"


def in_lockstep(step: Callable[[Any], torch.Tensor], optimizer: torch.optim.Optimizer, eager: torch.nn.Module,
                eager_optimizer: torch.optim.Optimizer, loss_fn: Callable[[Any, Any], torch.Tensor],
                batch: Any) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:  # fmt: skip
    """Train ``eager`` eagerly and mutwo's ``step`` side by side for ``len(LR_FACTORS)`` iterations,
    the learning rate changed between them as a scheduler would and the same seed before each (the
    same dropout masks); yield each iteration's index, mutwo's loss and eager's."""
    base_lr = optimizer.param_groups[0]["lr"]
    for iteration, factor in enumerate(LR_FACTORS):
        for group in (*optimizer.param_groups, *eager_optimizer.param_groups):
            group["lr"] = base_lr * factor
        torch.manual_seed(100 + iteration)
        eager_optimizer.zero_grad(set_to_none=True)
        expected = loss_fn(models.call_model(eager, batch), batch)
        expected.backward()
        eager_optimizer.step()
        torch.manual_seed(100 + iteration)
        yield iteration, step(batch), expected.detach()


#: name -> (the workload, its optimizer, whether mutwo is given the DDP model (with small buckets)
#: or detects the process group (DDP's default buckets)).
CASES: dict[str, tuple[Callable[[], models.Workload], str, bool]] = {
    "cnn": (lambda: models.cnn(seed=0, batch_size=8), "adam", True),  # batch norm: buffers broadcast
    "mlp": (lambda: models.mlp(seed=0, batch_size=1024), "sgd", False),  # activations over the optimizer step
    "bert": (lambda: models.bert(seed=0, batch_size=4), "adamw", True),  # tied weights, dropout, int buffers
}


def _against_ddp(rank: int, world: int, device: torch.device, case: str) -> None:
    """Train a copy under eager DDP and a copy under mutwo from the same state, and compare everything."""
    build, optimizer_name, wrapped = CASES[case]
    workload = build()
    make_optimizer = models.OPTIMIZERS[optimizer_name]
    batch = to_device(distributed.shard_batch(workload.batch, rank, world), device)
    base = workload.model.to(device)
    eager = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=BUCKET_CAP_MB if wrapped else None)
    eager_optimizer = make_optimizer(eager.parameters())
    model = copy.deepcopy(base)
    optimizer = make_optimizer(model.parameters())
    given = DistributedDataParallel(model, bucket_cap_mb=BUCKET_CAP_MB) if wrapped else model
    step = optimize(given, optimizer, batch, workload.loss_fn, budget="min", check=True, keep_grads=True,
                    backend="eager")  # the compiled backends: test_distributed_compiled.py
    plan = step.last.plan if step.last is not None else None
    assert plan is not None and plan.entries, (f"{case}: the budget should make select recompute something; the peak "
                                               f"is in the {plan and plan.predicted_peak_phase} phase, holding "
                                               f"{plan and plan.predicted_breakdown}")  # fmt: skip
    plans: list[str | None] = [None] * world
    dist.all_gather_object(plans, json.dumps(step.last.plan.to_json(), sort_keys=True))
    assert plans[0] == plans[rank], "the ranks planned differently"
    for iteration, loss, expected in in_lockstep(step, optimizer, eager, eager_optimizer, workload.loss_fn, batch):
        _assert_same(loss, expected, f"rank {rank} iteration {iteration}: the loss")
        for (name, mine), theirs in zip(model.named_parameters(), eager.module.parameters(), strict=True):
            _assert_same(mine.grad, theirs.grad, f"rank {rank} iteration {iteration}: the gradient of {name}")
    _assert_same_state(model.state_dict(), eager.module.state_dict(), f"rank {rank}: the model state")
    _assert_same_state(optimizer.state_dict()["state"], eager_optimizer.state_dict()["state"],
                       f"rank {rank}: the optimizer state")  # fmt: skip
    if wrapped:  # DDP has rebuilt its buckets in the order gradients became ready: mutwo's are the same
        names = {id(p): n for n, p in eager.module.named_parameters()}
        rebuilt = [[names[id(p)] for p in b.parameters()] for b in eager.reducer._get_zeros_like_grad_buckets()]
        assert step.last.binding.gradient_buckets == rebuilt
        assert len(rebuilt) > 1


@contextlib.contextmanager
def rank_group(rank: int, world: int, port: int, device_type: str,
               timeout_seconds: float | None = None) -> Iterator[torch.device]:  # fmt: skip
    """One rank of a spawned test run: its process group (NCCL on CUDA, with deterministic kernels;
    gloo on the CPU) for the duration, and the device it trains on. ``timeout_seconds``: how long a
    collective waits for the other ranks (torch's default, 30 minutes, if None), for a test whose
    failure would leave the ranks in different collectives.

    When the body succeeds, the rank's process ends here (``os._exit(0)``), so nothing may follow the
    ``with`` block in a worker: with the ranks' work done and checked, a thread that gloo or torch's
    profiler leaves joinable aborted the interpreter's own exit now and then (SIGABRT, "terminate
    called without an active exception", in two CI runs of sessions 32 and 33, once after a barrier
    before destroying the group was added), which failed a test whose every check had passed. A body
    that raises goes on as always: the exception reaches ``mp.spawn``."""
    cuda = device_type == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    timeout = {} if timeout_seconds is None else {"timeout": datetime.timedelta(seconds=timeout_seconds)}
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, **timeout)  # fmt: skip
    try:
        with deterministic_algorithms() if cuda else contextlib.nullcontext():
            yield torch.device("cuda", rank) if cuda else torch.device("cpu")
    except BaseException:
        _leave_group(cuda)
        raise
    _leave_group(cuda)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _leave_group(cuda: bool) -> None:
    """Destroy this rank's process group, once the others are done with it."""
    if cuda:  # a live recording of NCCL collectives hangs the group's destruction
        release_all()
    else:  # a rank leaving while the other's gloo work is in flight aborts it
        with contextlib.suppress(RuntimeError):  # a rank that failed half-way: the others do not wait long
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=60), wait_all_ranks=True)
    dist.destroy_process_group()


def _two_rank_worker(rank: int, world: int, port: int, device_type: str, cases: tuple[str, ...]) -> None:
    with rank_group(rank, world, port, device_type) as device:
        for case in cases:
            _against_ddp(rank, world, device, case)


@pytest.mark.slow
def test_two_ranks_on_cpu_train_bitwise_like_eager_ddp() -> None:
    mp.spawn(_two_rank_worker, args=(2, _free_port(), "cpu", tuple(CASES)), nprocs=2)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus_with_nccl_train_like_eager_ddp() -> None:
    # BERT's attention backward has no deterministic kernel to compare with on every GPU
    mp.spawn(_two_rank_worker, args=(2, _free_port(), "cuda", ("cnn", "mlp")), nprocs=2)


#: How much more rank 1 measures than it held in the calibration test: enough that the rounds
#: each rank would make from its own measurement differ.
RANK_ONE_SKEW = 1.05


def _calibrated_together(rank: int, world: int, port: int) -> None:
    """Calibrate a data-parallel MLP (3 rounds at most) while rank 1 reports 5% more than it
    measured; every rank must see the largest measurement, keep the same round and graph, and
    train bitwise like eager DDP."""
    raw: list[int] = []
    measure = peak_calibration.measured_peak

    def skewed(run: Callable[..., Any], inputs: list[torch.Tensor]) -> tuple[int, int | None]:
        held, allocated = measure(run, inputs)
        held = int(held * (RANK_ONE_SKEW if rank == 1 else 1.0))
        raw.append(held)
        return held, allocated

    peak_calibration.measured_peak = skewed  # this spawned process's own module
    # Every re-plan is compiled, even one predicted slower than a round that fitted: the test is of
    # the rounds the ranks agree on, not of when they stop (the next test is).
    peak_calibration.MIN_REPLAN_GAIN = float("-inf")
    with rank_group(rank, world, port, "cpu") as device:
        workload = models.mlp(seed=0, batch_size=1024)
        batch = to_device(distributed.shard_batch(workload.batch, rank, world), device)
        eager = DistributedDataParallel(copy.deepcopy(workload.model))
        eager_optimizer = torch.optim.SGD(eager.parameters(), lr=0.1)
        model = copy.deepcopy(workload.model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        step = optimize(model, optimizer, batch, workload.loss_fn, budget=0.95, calibrate_peak=2, keep_grads=True)
        calibration = step.last.calibration
        assert calibration is not None and len(calibration.rounds) > 1, "the skew should make calibration re-plan"
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, (calibration.describe(), raw))
        (rank_zero, raw_zero), (rank_one, raw_one) = everyone
        assert rank_zero == rank_one, "the ranks calibrated differently"
        # A round that plans a graph measured before is not measured again: the distinct peaks.
        measured = {r["measured_peak_bytes"] for r in rank_zero["rounds"]}
        assert measured == {max(a, b) for a, b in zip(raw_zero, raw_one, strict=True)}
        assert measured == set(raw_one) and raw_one != raw_zero, "rank 1's larger measurement moves both"
        for iteration, loss, expected in in_lockstep(step, optimizer, eager, eager_optimizer, workload.loss_fn, batch):
            _assert_same(loss, expected, f"rank {rank} iteration {iteration}: the loss")
        _assert_same_state(model.state_dict(), eager.module.state_dict(), f"rank {rank}: the model state")


def test_two_ranks_calibrate_from_the_largest_measurement_and_keep_one_plan() -> None:
    mp.spawn(_calibrated_together, args=(2, _free_port()), nprocs=2)


def _stopping_together(rank: int, world: int, port: int) -> None:
    """Calibrate a data-parallel MLP whose first step fits well under the window (its measured peak
    scaled by 0.8), while rank 1 predicts every re-plan twice as fast as rank 0 does (rank 0: no
    faster than the first plan). Alone, rank 1 would compile the re-plan and rank 0 stop, leaving
    them in different collectives; the slowest prediction decides for both, so both stop."""
    measure, plan_of = peak_calibration.measured_peak, peak_calibration.pipeline_plan
    peak_calibration.measured_peak = lambda run, inputs: (int(measure(run, inputs)[0] * 0.8), None)
    first_budget: list[int] = []

    def skewed_plan(artifacts: dict[str, Any]) -> Any:
        plan = plan_of(artifacts)
        first_budget.append(plan.budget_bytes)
        seconds = 0.5 if rank == 1 and plan.budget_bytes > first_budget[0] else 1.0
        return dataclasses.replace(plan, base_seconds=seconds, added_seconds=0.0)

    peak_calibration.pipeline_plan = skewed_plan
    with rank_group(rank, world, port, "cpu", timeout_seconds=120) as device:
        workload = models.mlp(seed=0, batch_size=1024)
        batch = to_device(distributed.shard_batch(workload.batch, rank, world), device)
        model = copy.deepcopy(workload.model)
        step = optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, workload.loss_fn, budget=0.95,
                        calibrate_peak=2, keep_grads=True)  # fmt: skip
        calibration = step.last.calibration
        assert calibration is not None and len(calibration.rounds) == 1 and "no faster" in calibration.stopped
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, calibration.describe())
        assert everyone[0] == everyone[1], "the ranks calibrated differently"


def test_two_ranks_stop_calibrating_together_when_one_predicts_a_faster_re_plan() -> None:
    mp.spawn(_stopping_together, args=(2, _free_port()), nprocs=2)


def _disagreeing(rank: int, world: int, port: int) -> None:
    with rank_group(rank, world, port, "cpu") as device:
        dp = DataParallel.for_group()
        assert dp.device == device
        with pytest.raises(distributed.RanksDisagreeError, match="rank 1 chose the backend inductor where rank 0"):
            distributed.require_same_choice("inductor-cudagraphs" if rank == 0 else "inductor", dp, "the backend")
        with pytest.raises(distributed.RanksDisagreeError, match="the re-planned graph of rank 1 differs"):
            distributed.require_same_graph(_tiny_graph() if rank == 0 else None, dp, "re-planned")


def _tiny_graph() -> Graph:
    workload = models.mlp(batch_size=4)
    optimizer = torch.optim.SGD(workload.model.parameters(), lr=0.1)
    return capture_graph(workload.model, optimizer, workload.batch, workload.loss_fn).graph


def test_ranks_that_choose_or_plan_differently_all_fail_in_one_line() -> None:
    # Every rank raises, none waits in a collective the others skipped (a rank without a plan too).
    mp.spawn(_disagreeing, args=(2, _free_port()), nprocs=2)


def test_mutwo_opt_under_torchrun_writes_from_rank_zero_and_calibrates(tmp_path: Path) -> None:
    out = tmp_path / "out"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(_free_port()), "-m", "mutwo.tools.mutwo_opt", "--check", "--device", "cpu", "--bucket-cap-mb",
               "0.01", "--calibrate-peak", "1", "-o", str(out), "examples/tiny_mlp.yaml"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("mutwo-opt: captured") == 1, "only rank 0 logs"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["equivalent"] is True and summary["recomputed"] >= 1
    parallel = summary["data_parallel"]
    assert parallel["world_size"] == 2 and parallel["global_batch_size"] == 2 * summary["batch_size"]
    assert len(parallel["buckets"]) == 2 and parallel["bucket_limits_bytes"] == [int(0.01 * 2**20)]
    assert summary["calibration"]["rounds"], "the ranks calibrate together (their agreement: the test above)"


# -- the IR of a data-parallel iteration, on one rank ---------------------------------------------------
def test_collectives_are_communication_nodes_that_overlap_the_backward(one_rank: None) -> None:
    workload = models.cnn(batch_size=4)
    optimizer = torch.optim.SGD(workload.model.parameters(), lr=0.1)
    lowered = capture_graph(workload.model, optimizer, workload.batch, workload.loss_fn,
                            data_parallel=DataParallel.for_group(bucket_cap_mb=BUCKET_CAP_MB))  # fmt: skip
    graph = lowered.graph
    issues, waits = _collectives(graph, "all_reduce_"), _collectives(graph, "wait_tensor")
    bucket_waits = [w for w in waits if w.phase is Phase.BACKWARD]
    assert len(issues) == len(bucket_waits) == len(lowered.binding.gradient_buckets) > 1
    assert len(_collectives(graph, "broadcast_")) == 2  # the buffers: float statistics and int64 counters
    assert all(n.kind is NodeKind.COMMUNICATION for n in graph if n.is_collective)
    # A wait returns the buffer it waited for: no new storage, so the simulator counts it once.
    assert all(w.owned_bytes == 0 and w.tensor.storage == w.args[0].tensor.storage for w in waits)
    # Buckets are issued while the backward still computes, and waited for at its end.
    position = {n.id: i for i, n in enumerate(graph)}
    first_wait = min(position[w.id] for w in bucket_waits)
    computing = [n for n in graph if n.phase is Phase.BACKWARD and n.kind is not NodeKind.COMMUNICATION
                 and position[issues[0].id] < position[n.id] < first_wait and not n.is_alias]  # fmt: skip
    assert computing, "the first bucket should be issued before the backward's last computation"
    # The buckets hold every gradient: their storages are communication, as many bytes as the gradients.
    grad_bytes = sum(p.numel() * p.element_size() for p in workload.model.parameters())
    liveness = compute_liveness(graph)
    bucket_bytes = sum(liveness.storages[i.tensor.storage].bytes for i in issues)
    assert bucket_bytes == grad_bytes
    assert all(liveness.storages[i.tensor.storage].kind is NodeKind.COMMUNICATION for i in issues)
    DeadCodeEliminationPass().run(graph, PassContext())
    assert len(_collectives(graph, "all_reduce_")) == len(issues), "dce must keep every collective"


def test_reading_a_bucket_before_its_wait_breaks_an_invariant(one_rank: None) -> None:
    workload = models.mlp(batch_size=4)
    optimizer = torch.optim.SGD(workload.model.parameters(), lr=0.1)
    graph = capture_graph(workload.model, optimizer, workload.batch, workload.loss_fn,
                          data_parallel=DataParallel.for_group()).graph  # fmt: skip
    issue = _collectives(graph, "all_reduce_")[0]
    graph.create_node("call_function", torch.ops.aten.clone.default, (issue,), name="early_read", after=issue,
                      phase=Phase.BACKWARD, tensors=(issue.tensor,))  # fmt: skip
    with pytest.raises(VerificationError, match="collective-wait"):
        verify(graph)


# -- bad input: one readable line -------------------------------------------------------------------------
def test_data_parallel_without_a_process_group_is_refused() -> None:
    workload = models.mlp()
    optimizer = torch.optim.SGD(workload.model.parameters(), lr=0.1)
    with pytest.raises(DataParallelError, match="init_process_group"):
        optimize(workload.model, optimizer, workload.batch, workload.loss_fn, data_parallel=True)


def test_ddp_with_a_communication_hook_or_a_second_bucket_size_is_refused(one_rank: None) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    workload = models.mlp()
    ddp = DistributedDataParallel(workload.model)
    with pytest.raises(DataParallelError, match="bucket_cap_mb"):
        optimize(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), workload.batch, workload.loss_fn, bucket_cap_mb=5)
    ddp.register_comm_hook(None, allreduce_hook)
    with pytest.raises(DataParallelError, match="communication hook"):
        optimize(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), workload.batch, workload.loss_fn)


def test_a_budget_in_bytes_under_the_unplanned_step_profiles_a_data_parallel_step_in_memory(one_rank: None) -> None:
    # Out of core does not run collectives yet: the budget caps the plan, not the profile (it
    # refused every byte budget under the unplanned step before, measured on two H100s).
    workload = models.mlp(seed=0, batch_size=1024)
    planned = copy.deepcopy(workload.model)
    first = optimize(planned, torch.optim.SGD(planned.parameters(), lr=0.1), workload.batch, workload.loss_fn,
                     budget=0.95)  # fmt: skip
    assert first.last is not None
    below = int(0.95 * first.last.plan.unoptimized_peak)
    model = copy.deepcopy(workload.model)
    step = optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), workload.batch, workload.loss_fn,
                    budget=f"{below}B", data_parallel=True)  # fmt: skip
    assert step.last is not None and step.last.plan.entries and step.last.plan.budget_bytes == below
    assert step.last.context.artifacts["profile"].meta["memory"].startswith("in memory")


def test_a_rank_out_of_memory_in_calibration_names_itself_the_round_and_the_fixes(
        one_rank: None, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A data-parallel rank cannot skip a calibration round that ran out of memory, as one device
    does: it raises at once (the other ranks wait in the step's collectives) an error saying which
    rank, the round's budget, the stage and what to change, still a ``torch.OutOfMemoryError``."""

    def out_of_memory(run: Any, inputs: Any) -> tuple[int, int | None]:
        raise torch.OutOfMemoryError("CUDA out of memory (made up by the test)")

    monkeypatch.setattr(peak_calibration, "measured_peak", out_of_memory)
    workload = models.mlp(seed=0, batch_size=256)
    with pytest.raises(peak_calibration.CalibrationOutOfMemory) as raised:
        optimize(workload.model, torch.optim.SGD(workload.model.parameters(), lr=0.1), workload.batch,
                 workload.loss_fn, budget=0.9, data_parallel=True, calibrate_peak=1)  # fmt: skip
    message = str(raised.value)
    assert message.startswith("rank 0 ran out of device memory measuring the plan for ") and "MiB" in message
    assert "during peak calibration" in message and "lower budget, or a higher memory limit" in message
    assert isinstance(raised.value, torch.OutOfMemoryError)
    assert isinstance(raised.value.__cause__, torch.OutOfMemoryError)


def test_a_batch_that_does_not_split_evenly_is_refused() -> None:
    with pytest.raises(DataParallelError, match="cannot be split evenly over 2 ranks"):
        distributed.shard_batch((torch.zeros(5, 3), torch.zeros(5)), 0, 2)
    shard = distributed.shard_batch({"x": torch.arange(8).reshape(4, 2), "scale": torch.tensor(2.0)}, 1, 2)
    assert shard["x"].tolist() == [[4, 5], [6, 7]] and shard["scale"].item() == 2.0


def test_fsdp1_tensor_parallel_and_single_process_parallel_models_are_refused(one_rank: None) -> None:
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    workload = models.mlp()
    with warnings.catch_warnings():  # FSDP1 warns that it is deprecated
        warnings.simplefilter("ignore")
        fsdp1 = FullyShardedDataParallel(copy.deepcopy(workload.model), device_id=torch.device("cpu"))
    replicated = copy.deepcopy(workload.model)
    name, module = next((n, m) for n, m in replicated.named_modules() if isinstance(m, torch.nn.Linear))
    module.weight = torch.nn.Parameter(distribute_tensor(module.weight.detach(), mesh, [Replicate()]))
    for model, message in ((fsdp1, "FullyShardedDataParallel \\(FSDP1\\)"),
                           (replicated, f"parameter {name}.weight is a DTensor outside fully_shard"),
                           (torch.nn.DataParallel(workload.model), "nn.DataParallel")):  # fmt: skip
        with pytest.raises(DataParallelError, match=message):
            optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), workload.batch, workload.loss_fn)


def test_a_step_inside_no_sync_is_refused(one_rank: None) -> None:
    workload = models.mlp()
    ddp = DistributedDataParallel(workload.model)
    step = optimize(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), workload.batch, workload.loss_fn)
    before = [p.detach().clone() for p in ddp.parameters()]
    with ddp.no_sync(), pytest.raises(DataParallelError, match="no_sync"):
        step(workload.batch)
    assert all(torch.equal(a, b) for a, b in zip(before, ddp.parameters(), strict=True)), "nothing half-done"
    step(workload.batch)
    assert not all(torch.equal(a, b) for a, b in zip(before, ddp.parameters(), strict=True))
