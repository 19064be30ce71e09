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
from mutwo.ir.budget import Budget
from mutwo.ir.graph import Graph
from mutwo.ir.pass_base import PassContext
from mutwo.ir.verifier import verify
from mutwo.runtime.capture.iteration import CapturedStep, LossFn, StepBinding, capture
from mutwo.runtime.capture.training import TrainingOptions
from mutwo.runtime.measurement.iterations import device_of
from mutwo.runtime.measurement.profiler import profile_graph
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
                  training: TrainingOptions | None = None, micro: str = "step",
                  accumulated: dict[str, torch.Tensor] | None = None,
                  data_parallel: DataParallel | None = None) -> CapturedGraph:  # fmt: skip
    """Capture one iteration (model, optimizer and batch already on their device) into verified IR;
    ``training``, ``micro`` and ``accumulated`` as for :func:`mutwo.runtime.capture.iteration.capture`; with
    ``data_parallel``, gradients are averaged across its ranks, which must all capture it."""
    captured, binding = capture(model, optimizer, batch, loss_fn, training, micro, accumulated, data_parallel)
    graph = from_fx(captured.graph_module, [(s.kind, s.label) for s in captured.slots], captured.gradient_labels)
    verify(graph)
    if data_parallel is not None:
        distributed.require_same_graph(graph, data_parallel, "captured")
    return CapturedGraph(graph, captured, binding, binding.flat_inputs(batch) + list(captured.constants.values()))


def pass_context(lowered: CapturedGraph, budget: Budget | None, *, out_dir: Path | None = None,
                 log: Callable[[str], None] = lambda message: None,
                 keep_grads: bool = False) -> PassContext:  # fmt: skip
    """The context passes run in: the budget, whether the caller reads the gradients (then
    optimizer-in-backward keeps them), and the runtime's profiler and device memory as services."""
    device = lowered.device
    context = PassContext(out_dir=out_dir, device=str(device), log=log)
    context.services["budget"] = budget
    context.services["keep_grads"] = keep_grads
    context.services["profiler"] = lambda g, runs, warmup, isolate=False, contention=True: profile_graph(
        g, lowered.inputs, runs=runs, warmup=warmup, progress=log, isolate=isolate, contention=contention)
    context.services["transfer"] = lambda: measure_transfers(device)
    if device.type == "cuda":
        context.services["device_memory"] = torch.cuda.get_device_properties(device).total_memory
    dp = lowered.binding.data_parallel
    if dp is not None:  # every rank plans from the same numbers, so every rank makes the same plan
        profiler = context.services["profiler"]
        context.services["profiler"] = lambda g, runs, warmup, isolate=False, contention=True: \
            distributed.agreed_profile(profiler(g, runs, warmup, isolate, contention), dp)  # fmt: skip
        if "device_memory" in context.services:
            context.services["device_memory"] = distributed.smallest(context.services["device_memory"], dp)
    return context
