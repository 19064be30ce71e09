"""A captured iteration made ready for the passes: lowered to verified IR with the inputs to run it
on (:class:`CapturedGraph`), and the context the passes run in (:func:`pass_context`), whose
services put the runtime's profiler, copy measurement and device memory within the passes' reach.

The API, mutwo-opt, calibration, the measured choice and the batch-size search all start here, so
none of them needs to import the others for it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mutwo.ir import from_fx
from mutwo.ir.budget import Budget, readable_bytes, sizes
from mutwo.ir.graph import Graph
from mutwo.ir.memory import simulate
from mutwo.ir.pass_base import PassContext, PassFailure
from mutwo.ir.verifier import verify
from mutwo.runtime.capture.iteration import CapturedStep, LossFn, StepBinding, capture
from mutwo.runtime.capture.training import TrainingOptions
from mutwo.runtime.measurement.device_memory import device_capacity, free_planning_leftovers
from mutwo.runtime.measurement.iterations import device_bytes, device_of
from mutwo.runtime.measurement.out_of_core import OutOfCoreError, ProfilingLimit, profiling_limit
from mutwo.runtime.measurement.profiler import Profile, profile_graph
from mutwo.runtime.measurement.transfer import measure_transfers
from mutwo.runtime.parallel import distributed
from mutwo.runtime.parallel.distributed import DataParallel


@dataclass
class CapturedGraph:
    """A captured iteration lowered to the IR and verified, with the inputs to run it on."""

    graph: Graph
    captured: CapturedStep
    binding: StepBinding
    inputs: list[torch.Tensor]

    @property
    def device(self) -> torch.device:
        return device_of(self.inputs)


def capture_graph(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Any, loss_fn: LossFn,
                  training: TrainingOptions | None = None, micro: str | None = None,
                  accumulated: dict[str, torch.Tensor] | None = None,
                  data_parallel: DataParallel | None = None, graphed: bool = False) -> CapturedGraph:  # fmt: skip
    """Capture one iteration (model, optimizer and batch already on their device) into verified IR;
    ``training``, ``micro``, ``accumulated`` and ``graphed`` (the step will be recorded as a CUDA
    graph) as for :func:`mutwo.runtime.capture.iteration.capture`; with ``data_parallel``, gradients
    are averaged across its ranks, which must all capture it.

    ``micro`` defaults to the whole step, or with gradient accumulation to the last micro-batch:
    it holds the accumulated gradients from its forward on and steps the optimizer, so its peak is
    the highest of the micro-batches'. The middle and last micro-batches without ``accumulated``
    read zeros (:func:`accumulated_stand_ins`)."""
    k = training.accumulation_steps if training is not None else 1
    micro = micro or ("step" if k == 1 else "last")
    if micro in ("middle", "last") and accumulated is None:
        first, _ = capture(model, optimizer, batch, loss_fn, training, "first", None, data_parallel, graphed)
        accumulated = accumulated_stand_ins(first)
    captured, binding = capture(model, optimizer, batch, loss_fn, training, micro, accumulated, data_parallel,
                                graphed)  # fmt: skip
    graph = from_fx(captured.graph_module, [(s.kind, s.label) for s in captured.slots], captured.gradient_labels)
    verify(graph)
    if data_parallel is not None:
        distributed.require_same_graph(graph, data_parallel, "captured")
    return CapturedGraph(graph, captured, binding, binding.flat_inputs(batch) + list(captured.constants.values()))


def accumulated_stand_ins(first: CapturedStep) -> dict[str, torch.Tensor]:
    """Zeros standing in for the gradients accumulated before a middle or last micro-batch, by
    parameter name: shaped, strided and typed as the gradients the first micro-batch's graph
    ``first`` returns, in its order, so that those graphs can be captured, planned and compiled
    before the first has run (what the step compiles for is what it will be called with)."""
    returned = first.graph_module.graph.output_node().args[0][1:]  # (loss, *gradients)
    stand_ins = {}
    for label, node in zip(first.gradient_labels, returned, strict=True):
        value = node.meta["val"]
        stand_ins[label] = torch.empty_strided(tuple(value.shape), tuple(value.stride()), dtype=value.dtype,
                                               device=value.device).zero_()  # fmt: skip
    return stand_ins


#: The service of a pass context that keeps and finds profiles across starts
#: (:class:`~mutwo.runtime.planning.profile_cache.ProfileStore`: ``key``, ``load`` and ``keep``),
#: where the plan cache is used and missed.
PROFILE_STORE = "profile_store"


def pass_context(lowered: CapturedGraph, budget: Budget | None, *, out_dir: Path | None = None,
                 log: Callable[[str], None] = lambda message: None, keep_grads: bool = False,
                 memory_limit: int | None = None) -> PassContext:  # fmt: skip
    """The context passes run in: the budget, whether the caller reads the gradients (then
    optimizer-in-backward keeps them), and the runtime's profiler and device memory as services.
    ``memory_limit``: the most the process may hold on the device (already applied on CUDA, see
    :func:`~mutwo.runtime.measurement.device_memory.apply_memory_limit`); the profiler runs out of
    core when the unoptimized step would not fit under it or under a budget in bytes."""
    device = lowered.device
    context = PassContext(out_dir=out_dir, device=str(device), log=log)
    context.services["budget"] = budget
    context.services["keep_grads"] = keep_grads
    if memory_limit is not None:  # select plans within it whatever the budget says
        context.services["memory_limit"] = memory_limit

    def run_profile(g: Graph, runs: int, warmup: int, isolate: bool = False, contention: bool = True,
                    out_of_core: bool | None = None) -> Profile:  # fmt: skip
        data_parallel = lowered.binding.data_parallel is not None
        # A data-parallel step is not profiled out of core (below), so its budget caps the plan
        # and not the profile: only a memory limit or the device's memory makes it out of core.
        choice = profiling_choice(g, lowered.inputs, None if data_parallel else budget, memory_limit,
                                  out_of_core)  # a limit under them refused  # fmt: skip
        refuse_budget_under_inputs(budget, lowered.inputs)
        # Its all-reduces run beside the backward until their waits: sending a bucket home while one
        # is in flight would copy a buffer the collective still writes. Every rank refuses if one
        # must (its device or limit may differ): a rank left profiling would wait in a collective.
        if data_parallel and distributed.on_any_rank(choice.device_limit is not None, lowered.binding.data_parallel):
            why = choice.reason if choice.device_limit is not None else "another rank must profile out of core"
            raise OutOfCoreError(f"profile: {why}, which data-parallel steps do not support yet; give each rank a "
                                 "larger memory limit, or more ranks")  # fmt: skip
        log(f"profile: {choice.reason}" + ("; a data-parallel step's budget does not cap its profile, which runs "
                                           "out of core only under a memory limit" if data_parallel and budget
                                           is not None and budget.bytes is not None else ""))  # fmt: skip
        # A profile another start measured of this graph, with these options (the plan cache's, on a miss)
        store = context.services.get(PROFILE_STORE)
        if store is not None:
            key = store.key(g, choice.device_limit, {"runs": runs, "warmup": warmup, "isolate": isolate,
                                                     "contention": contention})  # fmt: skip
            kept = store.load(key)
            if kept is not None:
                kept.meta["memory"] = choice.reason
                kept.meta["reused"] = True  # its out-of-core figures are the measuring start's
                return kept
        try:
            profile = profile_graph(g, lowered.inputs, runs=runs, warmup=warmup, progress=log, isolate=isolate,
                                    contention=contention, device_limit=choice.device_limit)  # fmt: skip
        except torch.OutOfMemoryError as error:
            if choice.device_limit is not None:
                raise
            free_planning_leftovers(device)
            raise OutOfCoreError(
                f"profiling in memory ran out of device memory ({choice.reason}; the model, its optimizer state and "
                f"the batch hold {readable_bytes(device_bytes(lowered.inputs, device))}): profile out of core with "
                "profile{out_of_core=true}, or give the memory limit the card really has (memory_limit=, "
                "--memory-limit)") from error
        profile.meta["memory"] = choice.reason
        if store is not None:
            store.keep(key, profile)
        return profile

    context.services["profiler"] = run_profile
    context.services["transfer"] = lambda: measure_transfers(device)
    # select's default budget: what the process may hold (on the CPU only a memory limit says that).
    capacity = min((c for c in (device_capacity(device), memory_limit) if c is not None), default=None)
    if capacity is not None:
        context.services["device_memory"] = capacity
    dp = lowered.binding.data_parallel
    if dp is not None:  # every rank plans from the same numbers, so every rank makes the same plan
        profiler = context.services["profiler"]
        context.services["profiler"] = lambda g, runs, warmup, isolate=False, contention=True, out_of_core=None: \
            distributed.agreed_profile(profiler(g, runs, warmup, isolate, contention, out_of_core), dp)  # fmt: skip
        if "device_memory" in context.services:
            context.services["device_memory"] = distributed.smallest(context.services["device_memory"], dp)
    return context


def refuse_budget_under_inputs(budget: Budget | None, inputs: list[torch.Tensor]) -> None:
    """Refuse, before anything is profiled, a budget in bytes that the step's inputs alone exceed:
    the parameters, buffers, optimizer state and batch stay on the device through the whole step
    and no plan frees them, so every plan peaks above it (select's own refusal, which names the
    lowest peak a plan reaches, needs the profile, which runs the whole step)."""
    if budget is None or budget.bytes is None:
        return
    device = device_of(inputs)
    held = device_bytes(inputs, device)
    if budget.bytes < held:
        asked, floor = sizes(budget.bytes, held)
        raise PassFailure(f"budget {budget} ({asked}) is unreachable: the parameters, buffers, optimizer state and "
                          f"batch of the step hold {floor} on {device} before it runs, and no plan frees them "
                          "(refused before profiling)",
                          advice=f"give a budget above {floor}, or 'min' for the lowest peak recomputation "
                          "reaches")  # fmt: skip


def profiling_choice(graph: Graph, inputs: list[torch.Tensor], budget: Budget | None, memory_limit: int | None,
                     forced: bool | None) -> ProfilingLimit:  # fmt: skip
    """In memory or out of core (:func:`~mutwo.runtime.measurement.out_of_core.profiling_limit`):
    the cap is the lowest of the budget in bytes, the memory limit and what the device allows
    (a budget given as a fraction names a share of a step the user can size, so it caps nothing
    here); what the process holds already is read from the allocator on CUDA."""
    device = device_of(inputs)
    held = torch.cuda.memory_allocated(device) if device.type == "cuda" else device_bytes(inputs, device)
    budget_bytes = budget.bytes if budget is not None and budget.bytes is not None else None
    if budget_bytes is not None and budget_bytes <= held:
        # Out of reach whatever the profile: select refuses it with the lowest peak it can reach,
        # which says more than a refusal here would.
        budget_bytes = None
    cap = min((c for c in (budget_bytes, memory_limit, device_capacity(device)) if c is not None), default=None)
    # The unoptimized peak decides only where there is a cap and the pass forces neither way.
    peak = simulate(graph).peak_bytes if cap is not None and forced is None else 0
    return profiling_limit(peak, held, cap, forced)
