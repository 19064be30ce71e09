"""Helpers of the swap tests (CPU and CUDA): plan and rewrite a workload's iteration in-process."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mutwo.ir import from_fx
from mutwo.ir.budget import parse_budget
from mutwo.ir.graph import Graph
from mutwo.ir.pass_base import PassContext
from mutwo.ir.pass_manager import PassManager
from mutwo.ir.registry import PassRegistry
from mutwo.ir.timeline import TransferModel
from mutwo.runtime.capture.iteration import capture
from mutwo.runtime.execution.cuda_graphs import graphable_optimizer
from mutwo.runtime.measurement.profiler import profile_graph
from mutwo.runtime.measurement.transfer import measure_transfers
from tests import models


@dataclass
class Rewritten:
    original: Graph
    graph: Graph
    inputs: list[torch.Tensor]
    ctx: PassContext


def lower(workload: models.Workload, graphable: bool = False) -> tuple[Graph, list[torch.Tensor]]:
    """The captured iteration of ``workload`` (Adam) as IR, with the inputs to run it on;
    ``graphable``: an Adam a CUDA graph can record (capturable, its learning rate on the GPU)."""
    optimizer = torch.optim.Adam(workload.model.parameters(), lr=1e-3)
    if graphable:
        graphable_optimizer(optimizer, torch.device("cuda"))
    captured, binding = capture(workload.model, optimizer, workload.batch, workload.loss_fn)
    graph = from_fx(captured.graph_module, [(s.kind, s.label) for s in captured.slots], captured.gradient_labels)
    return graph, binding.flat_inputs(workload.batch) + list(captured.constants.values())


def rewrite(workload: models.Workload, pipeline: str, budget: str, profile: Any = None,
            transfer: TransferModel | None = None, graphable: bool = False) -> Rewritten:  # fmt: skip
    """Run ``pipeline`` over the iteration of ``workload`` with the runtime's services; with
    ``profile`` (another rewrite's, of the same graph), the pipeline plans from it and must not
    profile again (so that two plans' predictions compare without timing noise between them); with
    ``transfer``, select-swap plans for that copy model instead of the one measured here (a GPU's,
    whose copies overlap the compute, on a CPU)."""
    graph, inputs = lower(workload, graphable)
    original = graph.copy()
    device = inputs[0].device
    ctx = PassContext(device=str(device))
    ctx.services["profiler"] = lambda g, runs, warmup: profile_graph(g, inputs, runs=runs, warmup=warmup)
    ctx.services["transfer"] = lambda: measure_transfers(device)
    ctx.services["budget"] = parse_budget(budget)
    available = set()
    if transfer is not None:
        ctx.artifacts["transfer"] = transfer
    if profile is not None:
        ctx.artifacts["profile"], available = profile, {"profile"}
    PassManager(PassRegistry().build_pipeline(pipeline, available)).run(graph, ctx)
    return Rewritten(original, graph, inputs, ctx)
