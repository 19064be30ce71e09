"""Running a graph whose values do not fit on the device: at most ``limit`` bytes of them there.

Planning must not need more memory than the step it plans (docs/out-of-core.md): the user who
needs mutwo is the one whose unoptimized step does not fit. So the profiler can run the captured
iteration out of core. Every value keeps a home in host memory; before each node, the values it
reads are brought to the device, and values it does not read are sent home — those read again
furthest in the future first (Belady's rule: the graph says when each value is read next) —
until the node's inputs, its outputs and what else stays resident fit under ``limit``. The node
then runs as it would in the whole iteration: the same kernel on the same inputs, so its time
and its workspace (the allocator's peak inside it minus what it keeps) are the node's own, and
its results are bitwise those of the in-memory run. The copies happen between nodes, outside the
timed events.

The graph's inputs (parameters, buffers, optimizer state, the batch) are the ones the process
already holds: the run reads and writes them where they are, so it needs no second copy of the
model on the device. A snapshot of each is taken home first, and every input is restored from
it when the run ends, failed or not: the model is left exactly as it was. The
limit is on everything else: the iteration's activations, gradients and temporaries.

What is moved is storage, not tensors: views, in-place results and getitems of a value share
their storage's one copy (one host home, at most one device copy), so an in-place write through
one view is seen through all of them. A storage an op writes in place is marked dirty and copied
home before its device copy is dropped; a clean one is dropped without a copy.

Used by :func:`mutwo.runtime.measurement.profiler.profile_graph` with ``device_limit``; the
choice between in memory and out of core is :func:`profiling_limit`'s.
"""

from __future__ import annotations

import bisect
import math
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from mutwo.ir.budget import readable_bytes
from mutwo.ir.graph import Graph
from mutwo.ir.memory import allocation_size
from mutwo.ir.to_fx import NODE_ID_META, to_fx
from mutwo.runtime.measurement.iterations import device_of

#: How much of the limit is kept free for what a node allocates besides its outputs (its kernel's
#: workspace, cuBLAS's and cuDNN's buffers) and for the allocator's rounding: the resident values,
#: a node's inputs and its outputs are planned to fit in the rest.
WORKSPACE_SHARE = 0.1


class OutOfCoreError(RuntimeError):
    """A node cannot run within the limit even with everything else sent home."""


@dataclass(eq=False)
class _Slot:
    """One storage of the run: its host home, its device copy while resident, and the values
    (``fx`` nodes of the environment) that view it."""

    nbytes: int
    host: torch.UntypedStorage | None = None
    device: torch.UntypedStorage | None = None
    #: the device copy is newer than the host's (or the host has none yet)
    dirty: bool = True
    keys: set[Any] = field(default_factory=set)
    #: an input of the graph: its device copy is the caller's own tensor, never sent home, and its
    #: home the snapshot it is restored from when the run ends
    input: bool = False


@dataclass(frozen=True, eq=False)
class Spilled:
    """A tensor whose storage waits at home: what a value holds in place of it until a node reads it."""

    slot: _Slot
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    @classmethod
    def of(cls, tensor: torch.Tensor, slot: _Slot) -> Spilled:
        return cls(slot, tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())

    def on(self, storage: torch.UntypedStorage) -> torch.Tensor:
        """The tensor again, as a view of ``storage`` (the slot's device copy or its home)."""
        return torch.empty(0, dtype=self.dtype, device=storage.device).set_(storage, self.offset, self.size,
                                                                             self.stride)  # fmt: skip


def _leaves(value: Any) -> list[Any]:
    return pytree.tree_leaves(value)


class Residency:
    """Which storages of a run are on the device, within ``limit`` bytes, and where the rest wait.

    ``order`` is the graph's nodes in execution order: a value's next reader decides when it is
    sent home. The environment of the interpreter that runs the graph is a :class:`TrackedEnv`
    reporting to this object, so that a value's storage is forgotten with its last view.
    """

    def __init__(self, device: torch.device, limit: int, order: Sequence[fx.Node]) -> None:
        self.device = device
        self.limit = limit
        self.position = {node: i for i, node in enumerate(order)}
        self.readers: dict[fx.Node, list[int]] = {
            node: sorted(self.position[user] for user in node.users) for node in order}  # fmt: skip
        self.env: TrackedEnv | None = None
        self.resident: dict[int, _Slot] = {}  #: by the device copy's data pointer
        self.resident_bytes = 0
        self.max_resident_bytes = 0
        #: the most one node needs resident besides the inputs: what it reads and what it makes
        self.largest_node_bytes = 0
        self.copied_in = 0
        self.copied_out = 0
        self.now = 0
        #: host buffers of values that are gone, by size, for the next value sent home: the
        #: iterations of a profile send home the same sizes, so after the first nothing is allocated
        #: (page-locked on CUDA, so that copies run at the link's speed)
        self.free_homes: dict[int, list[torch.UntypedStorage]] = {}

    # -- which tensors are managed ----------------------------------------------------------------
    def managed(self, value: Any) -> bool:
        """Tensors with storage on the device (a CPU learning rate beside a CUDA model is left alone)."""
        return (isinstance(value, torch.Tensor) and value.device == self.device and value.layout == torch.strided
                and value.untyped_storage().nbytes() > 0)  # fmt: skip

    def _size(self, slot: _Slot) -> int:
        return allocation_size(slot.nbytes, str(self.device))

    def slot_of(self, leaf: Any) -> _Slot | None:
        """The slot a value's leaf lives in, made for a new device storage."""
        if isinstance(leaf, Spilled):
            return leaf.slot
        if not self.managed(leaf):
            return None
        storage = leaf.untyped_storage()
        slot = self.resident.get(storage.data_ptr())
        if slot is None:
            slot = _Slot(storage.nbytes(), device=storage)
            self._add_resident(slot)
        return slot

    def _add_resident(self, slot: _Slot) -> None:
        assert slot.device is not None
        self.resident[slot.device.data_ptr()] = slot
        self.resident_bytes += self._size(slot)
        self.max_resident_bytes = max(self.max_resident_bytes, self.resident_bytes)

    # -- the inputs ----------------------------------------------------------------------------------
    def adopt_inputs(self, inputs: Iterable[Any]) -> list[Any]:
        """The graph's inputs to run on: tensors on the device as they are (views of one storage share
        one slot), each storage's snapshot taken home; other tensors cloned (a CPU step count beside
        a CUDA model), as the in-memory profiler clones every input."""
        adopted: list[Any] = []
        for value in inputs:
            if not self.managed(value):
                adopted.append(value.clone() if isinstance(value, torch.Tensor) else value)
                continue
            storage = value.untyped_storage()
            if storage.data_ptr() not in self.resident:
                snapshot = self._home(storage.nbytes())
                snapshot.copy_(storage)
                slot = _Slot(storage.nbytes(), host=snapshot, device=storage, dirty=False, input=True)
                self.resident[storage.data_ptr()] = slot  # held already: not counted against the limit
            adopted.append(value)
        return adopted

    # -- before and after each node -----------------------------------------------------------------
    def prepare(self, node: fx.Node, output_bytes: int) -> None:
        """Bring what ``node`` reads to the device, sending other values home first while the
        resident values, its inputs and ``output_bytes`` would exceed the limit."""
        assert self.env is not None
        self.now = self.position[node]
        needed = self._read_by(node)
        incoming = sum(self._size(s) for s in needed if s.device is None)
        own = sum(self._size(s) for s in needed if not s.input) + output_bytes
        self.largest_node_bytes = max(self.largest_node_bytes, own)
        excess = self.resident_bytes + incoming + output_bytes - self.limit
        if excess > 0:
            for slot in self._eviction_order(needed):
                if excess <= 0:
                    break
                excess -= self._size(slot)
                self.send_home(slot)
        for slot in needed:
            if slot.device is None:
                self._bring(slot)

    def _read_by(self, node: fx.Node) -> list[_Slot]:
        """The slots ``node`` reads: of each input value, all of its storages, but of a getitem only
        the item's (an optimizer's list of hundreds of tensors is read one getitem at a time)."""
        assert self.env is not None
        values: list[Any] = []
        if node.target is operator.getitem and isinstance(node.args[1], int):
            container = self.env[node.args[0]]
            values.append(container[node.args[1]] if isinstance(container, (list, tuple)) else container)
        else:
            values.extend(self.env[n] for n in node.all_input_nodes)
        slots: dict[int, _Slot] = {}
        for leaf in _leaves(values):
            slot = self.slot_of(leaf)
            if slot is not None:
                slots[id(slot)] = slot
        return list(slots.values())

    def _next_read(self, slot: _Slot) -> float:
        soonest = math.inf
        for key in slot.keys:
            readers = self.readers.get(key, [])
            i = bisect.bisect_right(readers, self.now)
            if i < len(readers):
                soonest = min(soonest, readers[i])
        return soonest

    def _eviction_order(self, needed: list[_Slot]) -> list[_Slot]:
        keep = {id(s) for s in needed}
        candidates = [s for s in self.resident.values() if id(s) not in keep and not s.input]
        return sorted(candidates, key=self._next_read, reverse=True)

    def _bring(self, slot: _Slot) -> None:
        assert slot.host is not None and self.env is not None
        storage = torch.UntypedStorage(slot.nbytes, device=self.device)
        storage.copy_(slot.host)
        slot.device, slot.dirty = storage, False
        self.copied_in += slot.nbytes
        self._add_resident(slot)
        for key in slot.keys:
            self.env.replace(key, lambda leaf: leaf.on(storage) if isinstance(leaf, Spilled) and leaf.slot is slot
                             else leaf)  # fmt: skip

    def send_home(self, slot: _Slot) -> None:
        """Drop the slot's device copy, copying it home first when the device's is newer."""
        assert slot.device is not None and self.env is not None
        device = slot.device
        if slot.dirty or slot.host is None:
            slot.host = slot.host if slot.host is not None else self._home(slot.nbytes)
            slot.host.copy_(device)
            self.copied_out += slot.nbytes
        pointer = device.data_ptr()
        for key in slot.keys:
            self.env.replace(key, lambda leaf: Spilled.of(leaf, slot) if self.managed(leaf)
                             and leaf.untyped_storage().data_ptr() == pointer else leaf)  # fmt: skip
        del self.resident[pointer]
        self.resident_bytes -= self._size(slot)
        slot.device, slot.dirty = None, False

    def make_room_for(self, node: fx.Node) -> None:
        """Send home everything ``node`` does not read (it ran out of memory with less)."""
        needed = {id(s) for s in self._read_by(node)}
        for slot in [s for s in self.resident.values() if id(s) not in needed and not s.input]:
            self.send_home(slot)

    def mark_written(self, values: Iterable[Any]) -> None:
        """After a node ran: the storages of ``values``, which it may have written in place, are
        newer on the device than at home."""
        for leaf in _leaves(list(values)):
            slot = self.slot_of(leaf)
            if slot is not None:
                slot.dirty = True

    def _home(self, nbytes: int) -> torch.UntypedStorage:
        free = self.free_homes.get(nbytes)
        if free:
            return free.pop()
        pinned = self.device.type == "cuda"
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned).untyped_storage()

    def forget(self, slot: _Slot) -> None:
        """The last value viewing ``slot`` is gone: free its device copy (an input's stays, the
        caller's) and keep its home for the next value of its size."""
        if slot.input:
            return
        if slot.device is not None:
            del self.resident[slot.device.data_ptr()]
            self.resident_bytes -= self._size(slot)
            slot.device, slot.dirty = None, False
        if slot.host is not None:
            self.free_homes.setdefault(slot.nbytes, []).append(slot.host)
            slot.host = None

    def finish(self) -> None:
        """End of a run, failed or not: nothing of it left on the device, and every input restored
        from its snapshot. Every one, not only those marked written: an op that fails after writing
        part of its operands (a multi-tensor update out of memory half-way) never got to mark them."""
        for slot in list(self.resident.values()):
            if not slot.input:
                self.forget(slot)
            else:
                assert slot.device is not None and slot.host is not None
                slot.device.copy_(slot.host)
                slot.dirty = False


class GraphFacts:
    """What the IR knows of each node of the lowered graph that running it out of core needs: the
    bytes it allocates, and which of its operands it writes in place (the schema's ``(a!)``, and
    the running statistics a training batch norm updates without declaring them)."""

    def __init__(self, graph: Graph, module: fx.GraphModule) -> None:
        self.graph = graph
        self.by_id = {n.meta[NODE_ID_META]: n for n in module.graph.nodes if NODE_ID_META in n.meta}

    def output_bytes(self, node: fx.Node, device: torch.device) -> int:
        """What ``node`` allocates for its results on ``device``, as the allocator rounds each storage."""
        owned = self.graph.node(node.meta[NODE_ID_META]).owned_storages()
        return sum(allocation_size(meta.storage_bytes, str(device)) for meta in owned)

    def random(self, node: fx.Node) -> bool:
        """Whether ``node`` draws from the generator (running it again would draw again)."""
        if node.op != "call_function" or NODE_ID_META not in node.meta:
            return False
        return getattr(node.target, "_schema", None) is None or self.graph.node(node.meta[NODE_ID_META]).is_random

    def written(self, node: fx.Node) -> list[fx.Node]:
        """The values ``node`` may write in place; every operand of an op without a schema (a
        higher-order op replaying a random op in place)."""
        if node.op != "call_function" or node.target is operator.getitem:
            return []
        if getattr(node.target, "_schema", None) is None:
            return list(node.all_input_nodes)
        return [self.by_id[m.id] for m in self.graph.node(node.meta[NODE_ID_META]).mutated_operands]


class TrackedEnv(dict):  # type: ignore[type-arg]
    """An interpreter's environment that tells its :class:`Residency` which values view which
    storages, and when the last view of one is gone."""

    def __init__(self, residency: Residency) -> None:
        super().__init__()
        self.residency = residency
        residency.env = self
        self.slots: dict[Any, list[_Slot]] = {}

    def __setitem__(self, key: Any, value: Any) -> None:
        self._drop(key)
        if isinstance(key, fx.Node) and key.op == "call_function" and not key.users:
            # Nothing reads it (Adam leaves a parameter-sized quotient per parameter), yet the
            # interpreter would keep it to the end: let it go now.
            value = None
        super().__setitem__(key, value)
        slots: dict[int, _Slot] = {}
        for leaf in _leaves(value):
            slot = self.residency.slot_of(leaf)
            if slot is not None:
                slots[id(slot)] = slot
                slot.keys.add(key)
        self.slots[key] = list(slots.values())

    def __delitem__(self, key: Any) -> None:
        self._drop(key)
        super().__delitem__(key)

    def _drop(self, key: Any) -> None:
        for slot in self.slots.pop(key, []):
            slot.keys.discard(key)
            if not slot.keys:
                self.residency.forget(slot)

    def release(self) -> None:
        """Drop every value (the end of a run): their device copies are freed, their homes kept for reuse."""
        for key in list(self):
            del self[key]

    def replace(self, key: Any, leaf: Callable[[Any], Any]) -> None:
        """Rebuild the value of ``key`` leaf by leaf (a storage moved), keeping what it views."""
        super().__setitem__(key, pytree.tree_map(leaf, dict.__getitem__(self, key)))


class OutOfCore:
    """Mixed into an ``fx.Interpreter`` (before it in the bases): each node runs after its
    :class:`Residency` made room for it (``facts`` says what it allocates and writes). Run it with
    ``initial_env=TrackedEnv(residency)`` and the inputs from ``residency.adopt_inputs``."""

    residency: Residency
    facts: GraphFacts

    def run_node(self, n: fx.Node) -> Any:
        if n.op in ("placeholder", "output"):  # the outputs stay where they are (see materialize)
            return super().run_node(n)  # type: ignore[misc]
        output_bytes = self.facts.output_bytes(n, self.residency.device)
        failed = self._attempt(n, output_bytes)
        if failed is not None:
            # Out of the except block first, so that the failed attempt's frames are gone.
            held = self.residency.resident_bytes
            if self.facts.written(n) or self.facts.random(n):  # it may have written or drawn: not twice
                raise self._too_large(n, held, "it writes in place or draws random numbers, so it is not "
                                               "run again") from failed  # fmt: skip
            self.residency.make_room_for(n)
            torch.cuda.empty_cache()
            failed = self._attempt(n, output_bytes)
            if failed is not None:
                raise self._too_large(n, held, "this op alone needs more than the limit") from failed
        env = self.env  # type: ignore[attr-defined]
        self.residency.mark_written(env[m] for m in self.facts.written(n))
        result, self._result = self._result, None
        return result

    def _attempt(self, n: fx.Node, output_bytes: int) -> torch.OutOfMemoryError | None:
        """Make room and run ``n`` (its result in ``_result``); the out-of-memory error, if it ran out."""
        try:
            self.residency.prepare(n, output_bytes)
            self._result = super().run_node(n)  # type: ignore[misc]
        except torch.OutOfMemoryError as error:
            error.__traceback__ = None  # nothing of the attempt stays referenced
            return error
        return None

    def _too_large(self, n: fx.Node, held: int, why: str) -> OutOfCoreError:
        return OutOfCoreError(
            f"out of core: node {n.name} ({n.target}) ran out of device memory with "
            f"{readable_bytes(held)} of the run's values resident (the limit: "
            f"{readable_bytes(self.residency.limit)}): {why}; raise the budget or the memory limit")


class OutOfCoreInterpreter(OutOfCore, fx.Interpreter):
    """Runs a graph out of core."""

    def __init__(self, module: fx.GraphModule, residency: Residency, facts: GraphFacts) -> None:
        fx.Interpreter.__init__(self, module, garbage_collect_values=True)
        self.residency = residency
        self.facts = facts


def run_out_of_core(graph: Graph, inputs: Sequence[Any], limit: int) -> tuple[Any, list[Any], Residency]:
    """Run ``graph`` once on ``inputs`` with at most ``limit`` bytes of its other values on their
    device. Returns its outputs and the inputs as the run left them (as host tensors), and the
    residency, which says what was held and copied; ``inputs`` themselves are left as they were."""
    module = to_fx(graph)
    residency = Residency(device_of(list(inputs)), limit, list(module.graph.nodes))
    state = residency.adopt_inputs(inputs)
    try:
        with torch.no_grad():
            interpreter = OutOfCoreInterpreter(module, residency, GraphFacts(graph, module))
            outputs = interpreter.run(*state, initial_env=TrackedEnv(residency))
            host = torch.device("cpu")
            outputs = pytree.tree_map(lambda leaf: leaf.to(host, copy=True) if isinstance(leaf, torch.Tensor)
                                      else materialize(leaf), outputs)  # fmt: skip
            state = [t.to(host, copy=True) if isinstance(t, torch.Tensor) else t for t in state]
    finally:
        if residency.env is not None:
            residency.env.release()
        residency.finish()
    return outputs, state, residency


def materialize(value: Any) -> Any:
    """``value`` with every :class:`Spilled` leaf made a tensor again, a copy of it at home."""
    return pytree.tree_map(lambda leaf: leaf.on(leaf.slot.host).clone() if isinstance(leaf, Spilled) else leaf,
                           value)  # fmt: skip


@dataclass(frozen=True)
class ProfilingLimit:
    """Whether the profile runs out of core, and why, in one line for the log."""

    device_limit: int | None  #: bytes of the iteration's values the device may hold; None: in memory
    reason: str


def profiling_limit(simulated_peak: int, held: int, cap: int | None, forced: bool | None) -> ProfilingLimit:
    """Decide how to profile. ``simulated_peak``: the unoptimized step's peak by the simulator
    (its inputs included); ``held``: what the process already holds on the device (the model and
    optimizer state the profile runs beside); ``cap``: the most the process may hold (the budget in
    bytes or the memory limit, whichever is lower; None: no cap known); ``forced``: the profile
    pass's ``out_of_core`` option (None: decide)."""
    need = held + simulated_peak  # in memory, the profile runs on clones of the inputs beside the originals
    # The simulator knows no workspace before the profile: the same share is kept free for it.
    if forced is False or (forced is None and (cap is None or need <= cap * (1 - WORKSPACE_SHARE))):
        why = "asked for" if forced is False else (f"the unoptimized step needs {readable_bytes(need)}, within "
                                                   f"{readable_bytes(cap)}" if cap is not None else "no memory limit")
        return ProfilingLimit(None, f"in memory ({why})")
    if cap is None:
        raise OutOfCoreError("profiling out of core needs a memory limit or a budget in bytes to stay within; "
                             "give one (memory_limit=, --memory-limit, or budget='12GiB')")  # fmt: skip
    room = int((cap - held) * (1 - WORKSPACE_SHARE))  # out of core, on the originals themselves
    if room <= 0:
        raise OutOfCoreError(f"the process already holds {readable_bytes(held)} on the device (the model, its "
                             f"optimizer state and the batch), leaving nothing of the {readable_bytes(cap)} it may "
                             "hold for running the step; raise the budget or the memory limit")  # fmt: skip
    why = "asked for" if forced else (f"the unoptimized step needs {readable_bytes(need)}, over "
                                      f"{readable_bytes(int(cap * (1 - WORKSPACE_SHARE)))}: the "
                                      f"{readable_bytes(cap)} cap less {WORKSPACE_SHARE:.0%} for workspace")
    return ProfilingLimit(room, f"out of core ({why}): at most {readable_bytes(room)} of the step's values on the "
                                "device at once, the rest in host memory")  # fmt: skip
