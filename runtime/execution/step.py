"""Running an IR graph as a training step on a real model and optimizer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from mutwo.ir.graph import Graph
from mutwo.ir.node import NodeKind
from mutwo.ir.to_fx import to_fx
from mutwo.runtime.capture.guards import GuardCheck
from mutwo.runtime.capture.iteration import CapturedStep, StaleCaptureError, StepBinding
from mutwo.runtime.execution.backends import CompiledStep, check_backend, compile_step
from mutwo.runtime.execution.failure import FailureGuard


class BatchMismatchError(ValueError):
    """A batch does not have the structure, shapes or dtypes the step was captured with."""


@dataclass
class StepOutput:
    """What one iteration returns: the loss and the gradients the graph still returns, by parameter
    (all of them as captured; none after optimizer-in-backward, unless it was asked to keep them)."""

    loss: torch.Tensor
    gradients: dict[str, torch.Tensor]


class GraphStep:
    """A captured (and possibly rewritten) iteration, bound to the live model and optimizer.

    Calling it runs one whole iteration on a batch: parameters, buffers and optimizer state are
    updated in place, as ``optimizer.step()`` would; the learning rate is read from
    ``optimizer.param_groups`` at every call, so schedulers work. ``backend`` (see
    :mod:`mutwo.runtime.execution.backends`) runs the graph; a compiled one is built by :meth:`compile`, or
    on the first call.
    """

    def __init__(self, graph: Graph, captured: CapturedStep, binding: StepBinding, backend: str = "eager") -> None:
        self.backend = check_backend(backend)
        self.compiled: CompiledStep | None = None
        self.graph = graph
        self.captured = captured
        self.binding = binding
        self.graph_module: fx.GraphModule = to_fx(graph)
        #: what the graph writes of the live state, and what a failed run left written
        #: (:mod:`mutwo.runtime.execution.failure`); the eager backend's module tells how far it ran
        self.failure_guard = FailureGuard(graph, self.backend, binding.fresh_labels())
        if self.backend == "eager":
            self.failure_guard.mark(self.graph_module)
        self._batch_metas = [p.tensor for p in graph.placeholders if p.kind is NodeKind.INPUT
                             and p.label.startswith("batch")]  # fmt: skip
        self.guard_check = GuardCheck(captured.graph_module, captured.guards)
        self.stale: str | None = None  #: why this step may no longer run, once it may not
        # The graph returns (loss, *gradients); a pass may have stopped returning some gradients
        # (optimizer-in-backward frees them after their update): the output says which remain.
        self.gradient_labels = [node.label for node in graph.output.args[0][1:]]

    def flat_inputs(self, batch: Any) -> list[torch.Tensor]:
        """The inputs for ``batch``; raises :class:`StaleCaptureError` when the step must be captured again."""
        if self.stale is not None:
            raise StaleCaptureError(self.stale)
        self.check_batch(batch)
        flat = self.binding.flat_inputs(batch) + list(self.captured.constants.values())
        failing = self.guard_check.failing(flat)
        if failing is not None:
            raise StaleCaptureError(f"the optimizer's branch on {failing.describe()} goes the other way now; "
                                    "capture the step again")  # fmt: skip
        return flat

    def check_batch(self, batch: Any) -> None:
        """Raise :class:`BatchMismatchError` unless ``batch`` matches the captured one."""
        leaves, spec = pytree.tree_flatten(batch)
        if spec != self.captured.batch_spec:
            raise BatchMismatchError(f"the batch has structure {spec}, the step was captured with "
                                     f"{self.captured.batch_spec}")  # fmt: skip
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        for index, (tensor, meta) in enumerate(zip(tensors, self._batch_metas, strict=True)):
            if meta is not None and (tuple(tensor.shape) != meta.shape or tensor.dtype != meta.dtype):
                raise BatchMismatchError(
                    f"batch tensor {index} has shape {tuple(tensor.shape)} and dtype {tensor.dtype}; the step was "
                    f"captured with shape {meta.shape} and dtype {meta.dtype}: capture again for this shape"
                )

    def __call__(self, batch: Any) -> StepOutput:
        return self.run(self.flat_inputs(batch))

    def run(self, flat: list[torch.Tensor], *, restore_all: bool = False) -> StepOutput:
        """One iteration on the inputs :meth:`flat_inputs` gave. When it fails, the state it wrote
        is put back as far as :attr:`failure_guard` can (all of it with ``restore_all``, which copies it
        to host memory first), ``failure_guard.failure`` says what may be left written, and the exception
        goes on unchanged."""
        output = self.failure_guard.run(lambda: self.run_flat(flat), flat, restore_all=restore_all)
        if self.binding.fresh:
            # The optimizer created its state in this run (SGD's first momentum buffer): from now on
            # the step reads it, which another capture expresses.
            self.binding.install_fresh()
            self.stale = "the optimizer created its state in the previous run; capture the step again"
        return output

    def compile(self, flat: list[torch.Tensor]) -> CompiledStep:
        """The graph made runnable by the backend, for inputs like ``flat`` (compiled once)."""
        if self.compiled is None:
            self.compiled = compile_step(self.graph_module, flat, self.backend, self.graph)
        return self.compiled

    def run_flat(self, flat: list[torch.Tensor]) -> StepOutput:
        """Run on explicit inputs (in slot order); the backward is in the graph, so no autograd."""
        run = self.compile(flat).run
        with torch.no_grad():
            loss, *grads = run(*flat)
        return StepOutput(loss, dict(zip(self.gradient_labels, grads, strict=True)))
