"""Capturing a step for its backend, and choosing the backend when it is ``auto``.

A step that a CUDA graph will record is captured for it (``capture_graph(..., graphed=True)``: a
stock optimizer's capturable form, its step counts on the device), so ``auto`` must know whether it
will record before it captures. On CUDA it captures for a recording, which refuses an optimizer a
recording cannot run (its state on the host, Adagrad's); then reads the captured step's facts
(:func:`~mutwo.runtime.execution.auto_backend.step_facts`) and chooses
(:func:`~mutwo.runtime.execution.auto_backend.choose_backend`). A step the chosen backend does not
record is captured again as that backend captures it, so that every graph of the training step is
captured alike.
"""

from __future__ import annotations

from typing import Any

import torch

from mutwo.runtime.capture.device_state import put_state_back, state_entries
from mutwo.runtime.capture.iteration import LossFn
from mutwo.runtime.capture.optim import UnsupportedOptimizerError
from mutwo.runtime.capture.training import TrainingOptions
from mutwo.runtime.execution.auto_backend import AUTO, Choice, choose_backend, step_facts
from mutwo.runtime.execution.backends import records_cuda_graphs
from mutwo.runtime.parallel.distributed import DataParallel, backend_refusal, require_same_choice
from mutwo.runtime.planning.captured import CapturedGraph, capture_graph


def capture_for_backend(backend: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Any,
                        loss_fn: LossFn, training: TrainingOptions | None = None, micro: str | None = None,
                        accumulated: dict[str, torch.Tensor] | None = None,
                        data_parallel: DataParallel | None = None) -> tuple[CapturedGraph, Choice | None]:  # fmt: skip
    """The step captured as :func:`capture_graph` does (its arguments) for ``backend``; for ``auto``,
    also the backend chosen (None for any other). Call it with ``auto`` on CUDA only: elsewhere
    :func:`~mutwo.runtime.execution.auto_backend.early_choice` decides before capturing. A
    data-parallel step whose collectives a CUDA graph cannot record (gloo's) is captured as the
    backends that do not record capture it, the reason kept for the log line."""

    def captured(graphed: bool) -> CapturedGraph:
        return capture_graph(model, optimizer, batch, loss_fn, training, micro, accumulated, data_parallel, graphed)

    if backend != AUTO:
        return captured(records_cuda_graphs(backend)), None
    unrecordable = None
    if data_parallel is not None:  # every rank decides alike: the group's backend and NCCL are the same
        unrecordable = backend_refusal("inductor-cudagraphs", data_parallel)
    before = state_entries(optimizer)
    if unrecordable is not None:
        lowered = captured(graphed=False)
    else:
        try:
            lowered = captured(graphed=True)
        except UnsupportedOptimizerError as refusal:  # an optimizer unsupported any way is refused again below
            put_state_back(optimizer, before)
            unrecordable, lowered = str(refusal), captured(graphed=False)
    choice = choose_backend(step_facts(lowered.graph, lowered.inputs, unrecordable))
    if data_parallel is not None:  # a rank that captured again alone would leave the others' collectives unmatched
        require_same_choice(choice.backend, data_parallel, "the backend")
    if records_cuda_graphs(choice.backend) != lowered.binding.graphed:
        # The capture for a recording put the step counts on the device; the backend chosen runs
        # the optimizer as eager does, with them where the user had them (else one sync each).
        put_state_back(optimizer, before)
        lowered = captured(records_cuda_graphs(choice.backend))
    return lowered, choice

