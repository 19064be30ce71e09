"""A training step that fails part way: what it may have written of the model's and the
optimizer's state, putting back what can be put back, and saying so when the rest cannot.

Users catch ``torch.OutOfMemoryError`` around a step and skip the batch. A captured step writes
the state in place as it runs: batch-norm statistics in the forward, parameters and optimizer
state in the optimizer phase or, once optimizer-in-backward has scheduled them there, inside the
backward. :class:`FailureGuard` reads from the graph which state inputs a step writes (each node's
``mutated_operands``, through views to the placeholder whose storage they share) and sorts them:

* **saved**: buffers and one-element tensors (batch-norm statistics and counts, step counts, a
  grad scaler's scale and growth tracker). Cheap to copy and often written early (the forward
  writes batch-norm statistics, a step count is counted before the parameters it steps): copied
  aside on their device before every call, one ``_foreach_copy_`` per device and dtype, and
  copied back when the call fails.
* **model**: the parameters and the optimizer's per-parameter state; **accumulated**: the
  gradients summed over the earlier micro-batches of gradient accumulation. Copying those every
  step would double their memory or add their size in host traffic to every step, so by default
  they are not copied: the guard knows instead whether a failed call could have written them.
  The eager backend runs the graph's nodes one by one in the graph's order, and a marker placed
  before the first node that writes each group records that it was reached: a failure before it
  left the group as it was. (Markers before the first node of the backward and of the optimizer
  step tell an out-of-memory error's note which phase the step had reached:
  :meth:`FailureGuard.where_failed`.) A compiled step (Inductor's kernels, a CUDA graph's replay)
  does not tell how far it ran, so a failure there counts as having written every group its graph
  writes.

With ``restore_all`` (``optimize(..., on_failure="restore")``) the model and accumulated groups
are copied too, into host memory (page-locked for a CUDA tensor), and every failure is undone,
whatever the backend.

Why markers and not tensor version counters: some writes do not bump them (a training batch
norm's running statistics, ``_amp_update_scale_``'s growth tracker), and Inductor's kernels and
CUDA graph replays bump none. The optimizer state created inside a step (SGD's first momentum
buffer, ``StepBinding.fresh``) becomes the optimizer's only after a call succeeds, so it is not
guarded. Random number generators are not put back: a failed step has drawn from them, as a
failed eager step would have.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import fx

from mutwo.ir.graph import Graph
from mutwo.ir.node import Node, NodeKind, Phase
from mutwo.ir.to_fx import NODE_ID_META
from mutwo.runtime.capture.iteration import ACCUMULATED_GRAD
from mutwo.runtime.execution.backends import STATE_KINDS

T = TypeVar("T")


class Group(str, enum.Enum):
    """How the guard keeps a written state input (see the module docstring)."""

    SAVED = "saved"
    MODEL = "model"
    ACCUMULATED = "accumulated"


#: Why the state may be part written when putting back the saved copies failed.
UNRESTORED = "and putting back what it had written failed too"


class InconsistentStateError(RuntimeError):
    """An earlier step failed after it may have updated some parameters or optimizer state and
    not others; the message says how to go on."""


@dataclass(frozen=True)
class Failure:
    """What a failed call left written once the saved state was put back: for the parameters and
    optimizer state (``model``) and for the accumulated gradients (``accumulated``), a phrase
    saying when the call failed that leaves them possibly part written, or None when they are as
    before the call."""

    model: str | None = None
    accumulated: str | None = None

    def refusal(self, error: BaseException) -> str | None:
        """The sentence every later call raises (:class:`InconsistentStateError`), or None when
        the parameters and optimizer state are as before the call."""
        if self.model is None:
            return None
        return (f"an earlier step failed ({_first_line(error)}) {self.model}, so some parameters or optimizer state "
                "may be updated and others not: load the model's and optimizer's state_dict from a checkpoint and "
                "call mutwo.optimize again")  # fmt: skip

    def note(self, dropped_micro_batches: int) -> str | None:
        """What to add to the failure's own exception: None when the call left nothing written.
        ``dropped_micro_batches``: how many micro-batches' accumulated gradients were dropped."""
        if self.model is not None:
            return (f"mutwo: the step failed {self.model}, so some parameters or optimizer state may be updated and "
                    "others not; this training step will refuse to run again: load the model's and optimizer's "
                    "state_dict from a checkpoint and call mutwo.optimize again (optimize(..., on_failure='restore') "
                    "undoes every failed step, for a copy of that state in host memory before each step)")  # fmt: skip
        if self.accumulated is not None:
            batches = f"{dropped_micro_batches} micro-batch{'es' if dropped_micro_batches != 1 else ''}"
            return (f"mutwo: the micro-batch failed {self.accumulated}, so the gradients of the {batches} before it "
                    "may be part added to: they are dropped, and the next call starts a new accumulation cycle; "
                    "parameters, buffers and optimizer state are as before this call")  # fmt: skip
        return None


def _first_line(error: BaseException) -> str:
    first = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


class FailureGuard:
    """What one graph writes of the state it is called with, and what a failed call left
    (:attr:`failure`); see the module docstring. ``unguarded``: labels of state inputs to leave
    alone (the optimizer state created inside the step)."""

    def __init__(self, graph: Graph, backend: str, unguarded: Collection[str] = ()) -> None:
        self.backend = backend
        slot_of = {node: index for index, node in enumerate(graph.placeholders)}
        written: dict[Group, dict[int, None]] = {group: {} for group in Group}  # ordered sets of slots
        #: the first node that writes each group other than SAVED, of those the graph writes
        self.first_writes: dict[Group, Node] = {}
        for node in graph:
            for owner in written_placeholders(graph, node):
                if owner.kind not in STATE_KINDS or owner.label in unguarded:
                    continue
                group = _group(owner)
                written[group][slot_of[owner]] = None
                if group is not Group.SAVED:
                    self.first_writes.setdefault(group, node)
        #: the slots of the inputs the graph writes, by group
        self.slots: dict[Group, list[int]] = {group: list(slots) for group, slots in written.items()}
        first_update = self.first_writes.get(Group.MODEL)
        self._updates_begin = "" if first_update is None else _where(graph, first_update)
        #: the first node of the backward and of the optimizer step, where a marker says that a
        #: call got that far (:meth:`where_failed`)
        self.phase_starts: dict[Phase, Node] = {}
        for node in graph:
            if node.op == "call_function" and node.phase is not Phase.FORWARD:
                self.phase_starts.setdefault(node.phase, node)
        first_optimizer = self.phase_starts.get(Phase.OPTIMIZER)
        self._optimizer_in_backward = first_optimizer is not None and _before_backward_ends(graph, first_optimizer)
        self.marked = False  #: whether :meth:`mark` placed markers in the module that runs
        self._reached: set[str] = set()
        self._copies: dict[Group, _Copies] = {}
        self.failure: Failure | None = None  #: what the latest call left, when it failed

    def mark(self, module: fx.GraphModule) -> None:
        """Place a marker before the first write of each group in ``module``, and before the first
        node of the backward and of the optimizer step: the graph lowered by
        :func:`mutwo.ir.to_fx.to_fx` and run node by node, in order, by the eager backend."""
        by_id = {node.meta.get(NODE_ID_META): node for node in module.graph.nodes}
        markers = [*((first, group.value) for group, first in self.first_writes.items()),
                   *((first, phase.value) for phase, first in self.phase_starts.items())]  # fmt: skip
        for first, reached in markers:
            with module.graph.inserting_before(by_id[first.id]):
                module.graph.call_function(self.reach, (reached,))
        module.recompile()
        self.marked = True

    def reach(self, group: str) -> None:
        """What a marker calls: the step is about to write ``group`` for the first time this call,
        or to begin the backward or the optimizer step (a :class:`Phase`'s value)."""
        self._reached.add(group)

    def where_failed(self) -> str:
        """Where in the step the latest call failed, in words: the phase it had reached where the
        eager backend's markers tell, else ``during the step``."""
        if not self.marked:
            return "during the step"
        if Phase.OPTIMIZER.value in self._reached:
            return ("in the backward, once optimizer-in-backward's updates had begun" if self._optimizer_in_backward
                    else "in the optimizer step")  # fmt: skip
        return "in the backward" if Phase.BACKWARD.value in self._reached else "in the forward"

    def run(self, call: Callable[[], T], flat: Sequence[torch.Tensor], *, restore_all: bool = False) -> T:
        """``call()``, which runs the graph on ``flat``. When it raises, the saved state (all the
        written state with ``restore_all``) is put back, :attr:`failure` says what may be left
        written, and the exception goes on unchanged."""
        self.failure = None
        self._reached.clear()
        groups = list(Group) if restore_all else [Group.SAVED]
        for group in groups:
            self._copies_of(group, flat).save(flat)
        try:
            return call()
        except BaseException:
            # Until the copies are back, nothing is as before: if putting them back fails too (a
            # broken device), the caller still learns that the state may be part written.
            self.failure = Failure(UNRESTORED, UNRESTORED)
            for group in groups:
                self._copies[group].restore(flat)
            self.failure = Failure() if restore_all else Failure(self._left(Group.MODEL), self._left(Group.ACCUMULATED))
            raise

    def _copies_of(self, group: Group, flat: Sequence[torch.Tensor]) -> _Copies:
        # Made at the first call that needs them: a graph is captured for fixed shapes, dtypes and devices.
        if group not in self._copies:
            self._copies[group] = _Copies([(slot, flat[slot]) for slot in self.slots[group]],
                                          on_host=group is not Group.SAVED)  # fmt: skip
        return self._copies[group]

    def _left(self, group: Group) -> str | None:
        """When the failed call failed, if that may have left ``group`` part written."""
        first = self.first_writes.get(group)
        if first is None or (self.marked and group.value not in self._reached):
            return None
        if not self.marked:
            return f"inside the {self.backend} backend's compiled iteration, which does not tell how far it ran"
        if group is Group.MODEL:
            return f"after its updates had begun {self._updates_begin}"
        return "after it had begun adding its gradients to those accumulated"


def written_placeholders(graph: Graph, node: Node) -> Iterator[Node]:
    """The placeholders whose storage ``node`` writes in place, directly or through a view."""
    for written in node.mutated_operands:
        for meta in written.tensors:
            if meta is not None and graph.has_node(meta.storage.creator):
                owner = graph.storage_owner(meta.storage)
                if owner.op == "placeholder":
                    yield owner


def _where(graph: Graph, node: Node) -> str:
    """Where ``node`` runs, in words. Optimizer-in-backward moves updates into the backward
    without changing their phase: a backward node after it says so."""
    if node.phase is Phase.FORWARD:
        return "in the forward"
    if _before_backward_ends(graph, node):
        return "in the backward, where optimizer-in-backward scheduled them"
    return "in the optimizer step"


def _before_backward_ends(graph: Graph, node: Node) -> bool:
    """Whether a node of the backward runs after ``node`` (optimizer-in-backward moves updates there)."""
    return any(later.phase is Phase.BACKWARD for later in graph.nodes[graph.position(node):])


def _group(placeholder: Node) -> Group:
    meta = placeholder.tensor
    if placeholder.kind is NodeKind.BUFFER or (meta is not None and math.prod(meta.shape) <= 1):
        return Group.SAVED
    return Group.ACCUMULATED if placeholder.label.endswith(":" + ACCUMULATED_GRAD) else Group.MODEL


class _Copies:
    """Copies of some of a call's inputs (``(slot, tensor)``), kept from call to call, in buckets of
    one device and dtype that one ``_foreach_copy_`` each fills or empties; ``on_host``: in host
    memory, page-locked for CUDA tensors so that the copies out do not block."""

    def __init__(self, inputs: list[tuple[int, torch.Tensor]], on_host: bool) -> None:
        buckets: dict[tuple[torch.device, torch.dtype], tuple[list[int], list[torch.Tensor]]] = {}
        for slot, tensor in inputs:
            copy = torch.empty_like(tensor, device="cpu", pin_memory=tensor.is_cuda) if on_host \
                else torch.empty_like(tensor)  # fmt: skip
            slots, copies = buckets.setdefault((tensor.device, tensor.dtype), ([], []))
            slots.append(slot)
            copies.append(copy)
        self.buckets = list(buckets.values())

    def save(self, flat: Sequence[torch.Tensor]) -> None:
        # Non-blocking: the copies are queued on the stream the step then runs on, so they read
        # the state before the step writes it, and a restore is queued after them.
        for slots, copies in self.buckets:
            torch._foreach_copy_(copies, [flat[slot] for slot in slots], non_blocking=True)

    def restore(self, flat: Sequence[torch.Tensor]) -> None:
        for slots, copies in self.buckets:
            torch._foreach_copy_([flat[slot] for slot in slots], copies, non_blocking=True)
