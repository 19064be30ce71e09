"""Data-parallel training on torch.distributed: which process group averages the gradients and
how they are bucketed (as ``DistributedDataParallel`` buckets them), joining the process group
``torchrun`` describes, each rank's shard of a batch, and making every rank run the same plan.

Every rank captures, plans and runs the same graph: the collectives in it (see
:mod:`mutwo.runtime.capture.collectives`) must be issued in the same order everywhere. Each rank
profiles its own graph, then all ranks plan from one profile — each node's slowest time and
largest workspace over the ranks — and the smallest device memory, so ``select`` makes the same
choices everywhere; :func:`require_same_graph` then checks, after capture and after the passes,
that the ranks really hold the same graph, and fails on every rank if they do not.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from mutwo.ir.graph import Graph
from mutwo.ir.printer import print_graph
from mutwo.runtime.capture.collectives import broadcast_coalesced
from mutwo.runtime.capture.fully_sharded import FullySharded, FullyShardedError, fully_sharded_layout, is_fully_sharded
from mutwo.runtime.measurement.equivalence import EquivalenceReport, Mismatch
from mutwo.runtime.measurement.profiler import Profile

#: DDP's default bucket size (``bucket_cap_mb``) and its smaller first bucket.
DEFAULT_BUCKET_CAP_MB = 25
MIB = 1024 * 1024


class DataParallelError(ValueError):
    """Data-parallel training cannot be set up as asked; the message says why and what to do."""


class RanksDisagreeError(RuntimeError):
    """The ranks hold different graphs or plans, so their collectives would not match."""


@dataclass(frozen=True)
class DataParallel:
    """How a data-parallel iteration averages its gradients.

    ``bucket_limits``: the byte limit of the first bucket, of the second, ... (the last repeats),
    as DDP rebuilds its buckets; ``sync_buffers``: broadcast rank 0's buffers before every
    forward, like DDP's ``broadcast_buffers``; ``ignored``: parameter and buffer names DDP was told
    to leave alone (``_ddp_params_and_buffers_to_ignore``).
    """

    group: Any  #: the torch.distributed ProcessGroup
    bucket_limits: tuple[int, ...]
    sync_buffers: bool = True
    ignored: frozenset[str] = frozenset()
    wrapper: nn.parallel.DistributedDataParallel | None = field(default=None, compare=False)  #: the DDP given
    #: a ``fully_shard`` model's sharding: parameters all-gathered and gradients reduce-scattered
    #: per group (:mod:`mutwo.runtime.capture.fully_sharded`) instead of all-reduced in buckets
    sharded: FullySharded | None = field(default=None, compare=False)

    def require_sync(self) -> None:
        """Refuse a step inside the DDP wrapper's ``no_sync()``: mutwo's step always averages the
        gradients and applies the optimizer, so it cannot accumulate gradients without syncing."""
        if self.wrapper is not None and not self.wrapper.require_backward_grad_sync:
            raise DataParallelError("a mutwo step ran inside DistributedDataParallel.no_sync(): each step averages "
                                    "the gradients and steps the optimizer, so gradient accumulation is not "
                                    "supported; call the step outside no_sync (use a larger batch, or recompute "
                                    "to fit one)")  # fmt: skip

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def group_name(self) -> str:
        return self.group.group_name

    @property
    def device(self) -> torch.device:
        """Where this group's collectives take their tensors: the current GPU for NCCL, else the CPU."""
        if dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    @classmethod
    def for_group(cls, group: Any = None, *, bucket_cap_mb: float | None = None,
                  sync_buffers: bool = True) -> DataParallel:  # fmt: skip
        """DDP's defaults over ``group`` (default: the whole world): a 1 MiB first bucket, then
        25 MiB ones; an explicit ``bucket_cap_mb`` is every bucket's limit, as in DDP."""
        if not (dist.is_available() and dist.is_initialized()):
            raise DataParallelError("data-parallel training needs a process group: call torch.distributed."
                                    "init_process_group() first, or launch with torchrun")  # fmt: skip
        if bucket_cap_mb is not None and not bucket_cap_mb > 0:
            raise DataParallelError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
        if bucket_cap_mb is None:
            limits = (dist._DEFAULT_FIRST_BUCKET_BYTES, DEFAULT_BUCKET_CAP_MB * MIB)
        else:
            limits = (int(bucket_cap_mb * MIB),)
        return cls(group if group is not None else dist.group.WORLD, limits, sync_buffers)

    @classmethod
    def from_fully_shard(cls, model: nn.Module) -> DataParallel:
        """The sharding of a ``fully_shard`` model; FSDP2 broadcasts no buffers, so neither does the step."""
        try:
            sharded = fully_sharded_layout(model)
        except FullyShardedError as error:
            raise DataParallelError(str(error)) from None
        return cls(sharded.mesh.get_group(), (), sync_buffers=False, sharded=sharded)

    @classmethod
    def from_ddp(cls, ddp: nn.parallel.DistributedDataParallel) -> DataParallel:
        """The settings of a ``DistributedDataParallel`` wrapper, refused where mutwo would compute
        something else than it (communication hooks, its mixed precision, delayed all-reduces)."""
        if getattr(ddp, "_comm_hooks", None):
            raise DataParallelError("the DistributedDataParallel model has a communication hook, which mutwo cannot "
                                    "trace; remove register_comm_hook or pass the unwrapped model")  # fmt: skip
        if getattr(ddp, "mixed_precision", None) is not None:
            raise DataParallelError("DistributedDataParallel's mixed_precision is not supported; build it without "
                                    "mixed_precision")  # fmt: skip
        if getattr(ddp, "_delay_all_reduce_params", None):
            raise DataParallelError("DistributedDataParallel's delay_all_reduce_named_params is not supported; "
                                    "build it without them")  # fmt: skip
        config = getattr(ddp, "_bucket_config", None)  # torch >= 2.14
        if config is not None:
            limits = config.per_bucket_bytes_caps or (config.first_bucket_bytes_cap, config.bucket_bytes_cap)
        else:
            first = dist._DEFAULT_FIRST_BUCKET_BYTES if ddp.bucket_bytes_cap_default else ddp.bucket_bytes_cap
            limits = (first, ddp.bucket_bytes_cap)
        sync = getattr(ddp, "forward_sync_buffers", getattr(ddp, "broadcast_buffers", True))
        return cls(ddp.process_group, tuple(limits), bool(sync), frozenset(ddp.parameters_to_ignore), ddp)


def data_parallel_for(model: nn.Module, enabled: bool | None = None, bucket_cap_mb: float | None = None) -> tuple[
        nn.Module, DataParallel | None]:  # fmt: skip
    """The module to capture and how to average its gradients.

    A ``DistributedDataParallel`` model is unwrapped and its settings are kept; a ``fully_shard``
    (FSDP2) model is captured with its all-gathers and reduce-scatters. Otherwise, with
    ``enabled=None``, gradients are averaged when a process group of more than one rank is
    initialised; ``True`` requires one, ``False`` never averages. FSDP1, other DTensor parameters
    and ``nn.DataParallel`` are refused.
    """
    refuse_other_parallelism(model)
    if isinstance(model, nn.parallel.DistributedDataParallel):
        if bucket_cap_mb is not None:
            raise DataParallelError("the model is a DistributedDataParallel: give bucket_cap_mb to it, not to mutwo")
        return model.module, (DataParallel.from_ddp(model) if enabled is not False else None)
    if dist.is_available() and is_fully_sharded(model):
        if enabled is False:
            raise DataParallelError("the model is sharded with fully_shard, so its step must gather and reduce "
                                    "across ranks; drop data_parallel=False")  # fmt: skip
        if bucket_cap_mb is not None:
            raise DataParallelError("bucket_cap_mb sets DistributedDataParallel's buckets; a fully_shard model "
                                    "communicates per fully_shard module, so drop it")  # fmt: skip
        return model, DataParallel.from_fully_shard(model)
    if enabled is None:
        enabled = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    return model, (DataParallel.for_group(bucket_cap_mb=bucket_cap_mb) if enabled else None)


def refuse_other_parallelism(model: nn.Module) -> None:
    """Raise :class:`DataParallelError` for a model that another form of parallelism wraps or
    shards than the two mutwo captures: DDP (every rank holds every parameter) and FSDP2."""
    if isinstance(model, nn.DataParallel):
        raise DataParallelError(
            "nn.DataParallel (one process driving several GPUs) is not supported; launch one "
            "process per GPU with torchrun and wrap the model in DistributedDataParallel"
        )
    if not dist.is_available():
        return
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

    wrapped = isinstance(model, nn.parallel.DistributedDataParallel)
    inner = model.module if wrapped else model
    for name, module in inner.named_modules():
        if isinstance(module, FullyShardedDataParallel):
            where = f" at {name}" if name else ""
            raise DataParallelError(f"the model{where} is wrapped in FullyShardedDataParallel (FSDP1), which mutwo "
                                    "cannot capture; shard it with FSDP2's fully_shard, or use "
                                    "DistributedDataParallel with a memory budget")  # fmt: skip
    if is_fully_sharded(inner):
        if wrapped:
            raise DataParallelError("the model is both DistributedDataParallel and sharded with fully_shard; "
                                    "give mutwo one of the two")  # fmt: skip
        return
    sharded = next((name for name, p in inner.named_parameters() if isinstance(p, DTensor)), None)
    if sharded is not None:
        raise DataParallelError(
            f"parameter {sharded} is a DTensor outside fully_shard (tensor parallel), which mutwo cannot "
            "capture; shard the model with fully_shard, or give it plain tensors wrapped in DistributedDataParallel"
        )


#: The first NCCL whose collectives a CUDA graph may record (torch's ProcessGroupNCCL refuses a
#: capture with an older one: "Capturing NCCL collectives is only allowed with NCCL >= 2.9.6").
NCCL_CAPTURABLE = (2, 9, 6)
#: What makes a collective's wait block the host until the collective ends, which a CUDA graph's
#: recording cannot do (ProcessGroupNCCL's ``WorkNCCL::wait`` polls the collective's end event).
BLOCKING_WAIT_VARIABLES = ("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT")


def backend_refusal(backend: str, dp: DataParallel, inductor: str = "backend='inductor'") -> str | None:
    """Why ``backend`` cannot run a data-parallel step over ``dp``, in one sentence that names the
    fastest backend that can (as ``inductor`` says it); None when it can.

    ``eager`` and ``inductor`` run every data-parallel step: Inductor compiles the collectives in
    the graph (:mod:`mutwo.runtime.execution.compiled_collectives`). ``cudagraphs`` and
    ``inductor-cudagraphs`` record them in the CUDA graph with the rest of the step, which torch
    allows for NCCL's collectives from NCCL 2.9.6 on while a wait does not block the host; gloo's
    collectives run on the host, where a recording cannot go."""
    if not backend.endswith("cudagraphs"):
        return None
    fastest = f"use {inductor}, the fastest backend that runs it"
    name = dist.get_backend(dp.group)
    if name != "nccl":
        return (f"the {backend} backend cannot record this data-parallel step: its process group runs on {name}, "
                f"whose collectives run on the host, and a CUDA graph records NCCL's only; {fastest}")  # fmt: skip
    version = torch.cuda.nccl.version()
    if version < NCCL_CAPTURABLE:
        return (f"the {backend} backend cannot record this data-parallel step: torch records NCCL collectives in a "
                f"CUDA graph from NCCL {'.'.join(map(str, NCCL_CAPTURABLE))} on, and this is NCCL "
                f"{'.'.join(map(str, version))}; {fastest}")  # fmt: skip
    blocking = next((v for v in BLOCKING_WAIT_VARIABLES if os.environ.get(v, "0") == "1"), None)
    if blocking is not None:
        return (f"the {backend} backend cannot record this data-parallel step: {blocking}=1 makes every collective's "
                f"wait block the host until the collective ends, which a CUDA graph's recording cannot do; unset "
                f"it, or {fastest}")  # fmt: skip
    return None


def planning_refusal(measure_choice: bool, option: str) -> str | None:
    """Why a data-parallel step cannot run a measured choice (``option``: how the caller names it);
    None when it is not asked for. The choice compares two plans' measured times, and the ranks
    would each keep the faster on their own measurement: plans whose collectives need not match.
    (Peak calibration runs: each round's measurement is agreed over the ranks first,
    :func:`largest_measured`.)"""
    if not measure_choice:
        return None
    return (f"{option} plans from what each rank measures on its own, so the ranks of a data-parallel step "
            "could keep different plans and their collectives would not match; drop it")


def largest_measured(held: int, allocated: int | None, dp: DataParallel) -> tuple[int, int | None]:
    """The largest ``held`` and ``allocated`` bytes over the ranks (``allocated`` None on every rank
    or on none: the CPU measures no allocated peak beside its held one). Peak calibration moves
    every rank's budget by these, so that the ranks keep one plan, the one whose fullest rank
    holds at most the budget: each rank's budget is what that rank holds."""
    values = torch.tensor([held, -1 if allocated is None else allocated], dtype=torch.int64, device=dp.device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=dp.group)
    largest_held, largest_allocated = (int(v) for v in values.tolist())
    return largest_held, None if largest_allocated < 0 else largest_allocated


def broadcast_model(model: nn.Module, dp: DataParallel) -> None:
    """Give every rank rank 0's parameters and buffers, as DDP does when it wraps a model."""
    tensors = [p.detach() for name, p in model.named_parameters() if name not in dp.ignored]
    tensors += [b for name, b in model.named_buffers() if name not in dp.ignored]
    with torch.no_grad():
        broadcast_coalesced(tensors, dp.group_name)


# -- launching under torchrun ---------------------------------------------------------------------
def launched_by_torchrun() -> bool:
    """Whether this process is one rank of a torchrun (or any ``env://``) launch."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def join_from_environment(device: torch.device) -> torch.device:
    """Join the process group torchrun describes — NCCL with one GPU per local rank, gloo on
    CPU — and return the device this rank trains on."""
    if device.type == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if local_rank >= torch.cuda.device_count():
            raise DataParallelError(f"this is local rank {local_rank} but only {torch.cuda.device_count()} GPU(s) "
                                    "are visible; start at most one process per GPU (--nproc-per-node)")  # fmt: skip
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    if not dist.is_initialized():
        try:
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        except (ValueError, RuntimeError) as error:
            first = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise DataParallelError(f"joining the torchrun process group failed: {first}") from None
    return device


def shard_batch(batch: Any, rank: int, world_size: int) -> Any:
    """Rank ``rank``'s shard of a global batch: every tensor whose first dimension is the global
    batch size is cut into ``world_size`` equal parts along it; other leaves are shared."""
    tensors = [leaf for leaf in pytree.tree_leaves(batch) if isinstance(leaf, torch.Tensor) and leaf.dim()]
    size = max((t.shape[0] for t in tensors), default=0)
    if size == 0 or size % world_size:
        raise DataParallelError(f"the global batch of {size} samples cannot be split evenly over {world_size} ranks")
    shard = size // world_size
    return pytree.tree_map(lambda leaf: leaf[rank * shard:(rank + 1) * shard].clone()
                           if isinstance(leaf, torch.Tensor) and leaf.dim() and leaf.shape[0] == size else leaf,
                           batch)  # fmt: skip


# -- every rank, the same graph and the same plan -------------------------------------------------
def graph_digest(graph: Graph) -> str:
    """A hash of the whole text IR: equal exactly when two ranks hold the same graph. Each rank's
    GPU index is left out (rank 1's ``cuda:1`` is rank 0's ``cuda:0``)."""
    return hashlib.sha256(re.sub(r"cuda:\d+", "cuda", print_graph(graph)).encode()).hexdigest()[:16]


def require_same_graph(graph: Graph | None, dp: DataParallel, what: str) -> None:
    """Raise :class:`RanksDisagreeError` on every rank unless every rank holds the same ``graph``
    (None: a rank that has no graph, e.g. no plan reached its budget, which the others must agree on)."""
    digests: list[Any] = [None] * dp.world_size
    dist.all_gather_object(digests, graph_digest(graph) if graph is not None else "no graph", group=dp.group)
    different = [rank for rank, digest in enumerate(digests) if digest != digests[0]]
    if different:
        raise RanksDisagreeError(f"the {what} graph of rank {different[0]} differs from rank 0's (digest "
                                 f"{digests[different[0]]} vs {digests[0]}); every rank must capture the same model "
                                 "with batches of the same shape and run the same passes")  # fmt: skip


def require_same_choice(choice: str, dp: DataParallel, what: str) -> None:
    """Raise :class:`RanksDisagreeError` on every rank unless every rank made the same ``choice``
    (``what`` names it), which each made from what it saw alone (its environment, its device)."""
    choices: list[Any] = [None] * dp.world_size
    dist.all_gather_object(choices, choice, group=dp.group)
    different = [rank for rank, made in enumerate(choices) if made != choices[0]]
    if different:
        raise RanksDisagreeError(f"rank {different[0]} chose {what} {choices[different[0]]} where rank 0 chose "
                                 f"{choices[0]}; give every rank the same environment and settings")  # fmt: skip


def agreed_profile(profile: Profile, dp: DataParallel) -> Profile:
    """The profile every rank plans with: each node's slowest time, slowest replay (batch norms
    replayed from their statistics) and largest workspace over the ranks, the slowest whole
    iteration and the largest slowdown of its copies (``meta["copy_contention"]``)."""
    ids = sorted(profile.nodes)
    # A node without a replay time has one on no rank (the same graph): -1 marks it.
    rows = [[profile.nodes[i].seconds, float(profile.nodes[i].workspace),
             -1.0 if profile.nodes[i].replay_seconds is None else profile.nodes[i].replay_seconds] for i in ids]
    # The last row: the iteration, and how much copies slow it (-1: not measured, the same on every rank).
    contention = profile.meta.get("copy_contention")
    rows.append([profile.iteration.seconds if profile.iteration else 0.0,
                 -1.0 if contention is None else float(contention["slowdown"]), -1.0])  # fmt: skip
    values = torch.tensor(rows, dtype=torch.float64, device=dp.device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=dp.group)
    merged = values.cpu().tolist()
    nodes = {i: dataclasses.replace(profile.nodes[i], seconds=row[0], workspace=int(row[1]),
                                    replay_seconds=None if row[2] < 0 else row[2])
             for i, row in zip(ids, merged, strict=False)}  # fmt: skip
    iteration = dataclasses.replace(profile.iteration, seconds=merged[-1][0]) if profile.iteration else None
    meta = {**profile.meta, "reduced_over_ranks": dp.world_size}
    if contention is not None:  # select-swap prices copies with the largest slowdown of any rank
        meta["copy_contention"] = {**contention, "slowdown": merged[-1][1]}
    return dataclasses.replace(profile, nodes=nodes, iteration=iteration, meta=meta)


def on_any_rank(flag: bool, dp: DataParallel) -> bool:
    """Whether ``flag`` holds on some rank: what every rank then does alike."""
    tensor = torch.tensor([int(flag)], dtype=torch.int64, device=dp.device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=dp.group)
    return bool(tensor.item())


def largest(value: float, dp: DataParallel) -> float:
    """The largest ``value`` over the ranks (a plan's predicted time, which each rank's own
    measurements may move: every rank then decides alike from it)."""
    tensor = torch.tensor([value], dtype=torch.float64, device=dp.device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=dp.group)
    return float(tensor.item())


def smallest(value: int, dp: DataParallel) -> int:
    """The smallest ``value`` over the ranks (the device memory every rank's plan must fit)."""
    tensor = torch.tensor([value], dtype=torch.int64, device=dp.device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=dp.group)
    return int(tensor.item())


def equivalent_everywhere(report: EquivalenceReport, dp: DataParallel) -> EquivalenceReport:
    """``report`` with the first difference any other rank found added, so that every rank
    reaches the same verdict."""
    firsts: list[Any] = [None] * dp.world_size
    dist.all_gather_object(firsts, report.mismatches[:1], group=dp.group)
    merged = dataclasses.replace(report, mismatches=list(report.mismatches))
    for rank, mismatches in enumerate(firsts):
        if rank != dp.rank and mismatches:
            first: Mismatch = mismatches[0]
            merged.mismatches.append(dataclasses.replace(first, label=f"{first.label} on rank {rank}"))
    return merged
