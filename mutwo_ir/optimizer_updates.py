"""The optimizer step as per-parameter updates, read off the IR's data flow, and rescheduling it.

Nothing here knows an optimizer's algorithm. The optimizer phase is cut into *items*: an ordinary
node is one item, a multi-tensor op (:mod:`mutwo.ir.multi_tensor`) is one item per list position.
Each item gets, from the data flow and from the storages it reads and writes:

* its dependencies: the items and the other nodes (backward nodes that produce a gradient, read a
  parameter or write a storage) that must run before it — operands, the last write of every
  storage it reads, and, for a storage it writes, the last write and every read since;
* when it could run at the earliest (``ready``: the rank of the last non-optimizer node it waits for);
* the gradients it depends on: an item depending on the gradients of several parameters (a
  gradient norm, a GradScaler's inf check) is a *global dependence* — no update can run before
  the whole backward is done;
* its owner: the one parameter whose gradient, value or state it touches (through its position's
  list elements for a multi-tensor op), or none (a learning-rate scalar).

:func:`schedule` then emits the items in a new order — whole groups of items at chosen points
after non-optimizer nodes, each item after everything it depends on (pulled in early when another
group needs it) — and :func:`apply` materialises that order on a graph, splitting multi-tensor
ops whose positions are emitted in several places. Every dependency is kept, so the new order
computes the same numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import NamedTuple

from mutwo.ir.graph import Graph
from mutwo.ir.multi_tensor import MultiTensorLayout, list_getitems, multi_tensor_layout, rename_storages
from mutwo.ir.multi_tensor import split_multi_tensor as _split
from mutwo.ir.node import Node, NodeKind, Phase, StorageKey


class Item(NamedTuple):
    """One node of the optimizer phase, or one list position of a multi-tensor op."""

    node: int  #: node id
    position: int | None


@dataclass
class OptimizerUpdates:
    """The items of a graph's optimizer phase (see the module docstring), in execution order."""

    items: list[Item]
    deps: dict[Item, list[Item]]
    ready: dict[Item, int]
    current_anchor: dict[Item, int]  #: rank of the last non-optimizer node before the item now
    owner: dict[Item, str | None]
    gradients_read: dict[Item, frozenset[str]]
    temporary_bytes: dict[Item, int]  #: bytes the item allocates (freed once the update is done)
    layouts: dict[int, MultiTensorLayout]
    gradients: dict[str, Node]  #: parameter -> its gradient node
    fixed: list[Node]  #: the non-optimizer nodes (and the output last), in execution order
    fixed_ranks: list[int]  #: their ranks: anchors are such ranks
    last_backward_rank: int
    conflicts: list[str] = field(default_factory=list)  #: non-optimizer nodes that read what an update wrote

    def mixing(self) -> list[tuple[Item, frozenset[str]]]:
        """Items that depend on the gradients of several parameters, in execution order."""
        return [(item, grads) for item in self.items if len(grads := self.gradients_read[item]) > 1]

    def parameters(self) -> list[str]:
        """Parameters that own at least one item, in the order of their first item."""
        return list(dict.fromkeys(o for o in (self.owner[i] for i in self.items) if o is not None))


def analyse(graph: Graph) -> OptimizerUpdates:
    """Cut the optimizer phase of ``graph`` into items and find what each depends on."""
    return _Analysis(graph).run()


class _Analysis:
    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.nodes = graph.nodes
        self.rank = {node.id: index for index, node in enumerate(self.nodes)}
        self.gradients = {n.label: n for n in self.nodes if n.kind is NodeKind.GRADIENT and n.label}
        self.seeds: dict[int, str] = {}  # node id -> parameter: its placeholder, its state, its gradient
        for node in graph.placeholders:
            name = node.label if node.kind is NodeKind.PARAMETER else node.label.rpartition(":")[0]
            if node.kind in (NodeKind.PARAMETER, NodeKind.OPTIMIZER_STATE) and name in self.gradients:
                self.seeds[node.id] = name
        for name, gradient in self.gradients.items():
            self.seeds[gradient.id] = name
        self.item_of: dict[int, Item] = {}  # optimizer node id (getitems of list ops too) -> item
        self.positions_of: dict[int, list[Item]] = {}  # multi-tensor op id -> its items
        self.writer: dict[StorageKey, Item | int] = {}
        self.readers: dict[StorageKey, list[Item | int]] = {}
        self.content_grads: dict[StorageKey, frozenset[str]] = {}
        self.content_owner: dict[StorageKey, frozenset[str]] = {}

    def run(self) -> OptimizerUpdates:
        items: list[Item] = []
        deps: dict[Item, list[Item]] = {}
        ready: dict[Item, int] = {}
        anchor: dict[Item, int] = {}
        owner: dict[Item, str | None] = {}
        grads: dict[Item, frozenset[str]] = {}
        temporary: dict[Item, int] = {}
        layouts: dict[int, MultiTensorLayout] = {}
        fixed: list[Node] = []
        conflicts: list[str] = []
        last_fixed = last_backward = -1
        for rank, node in enumerate(self.nodes):
            if node.op == "output" or node.phase is not Phase.OPTIMIZER:
                fixed.append(node)
                if node.op != "output":
                    last_fixed = rank
                    last_backward = rank if node.phase is Phase.BACKWARD else last_backward
                    conflict = self._note_fixed(node, rank)
                    if conflict:
                        conflicts.append(conflict)
                continue
            if node.id in self.item_of:  # a getitem of a multi-tensor op: part of that position's item
                continue
            layout = multi_tensor_layout(node)
            if layout is not None:
                layouts[node.id] = layout
                for position, getitems in list_getitems(node).items():
                    for getitem in getitems:
                        self.item_of[getitem.id] = Item(node.id, position)
            positions: list[int | None] = list(range(layout.positions)) if layout is not None else [None]
            shared = layout.shared_operands(node) if layout is not None else []
            if layout is None:
                self.item_of[node.id] = Item(node.id, None)
            else:
                self.positions_of[node.id] = [Item(node.id, p) for p in range(layout.positions)]
            for position in positions:
                item = Item(node.id, position)
                operands, owned_by, written = self._accesses(node, layout, position, shared)
                item_deps, waits, item_grads, touched = self._dependencies(operands, written)
                item_ready = max([waits, *(ready[d] for d in item_deps)])
                items.append(item)
                deps[item], ready[item], anchor[item], grads[item] = item_deps, item_ready, last_fixed, item_grads
                owners = touched if layout is None else self._touched(owned_by)
                owner[item] = next(iter(owners)) if len(owners) == 1 else None
                temporary[item] = self._allocated(node, position)
                self._note_item(item, operands, written, item_grads, owners)
        return OptimizerUpdates(items, deps, ready, anchor, owner, grads, temporary, layouts, self.gradients, fixed,
                                [self.rank[n.id] for n in fixed], last_backward, conflicts)  # fmt: skip

    # -- accesses ------------------------------------------------------------------------------
    def _accesses(self, node: Node, layout: MultiTensorLayout | None, position: int | None,
                  shared: list[Node]) -> tuple[list[Node], list[Node], list[Node]]:  # fmt: skip
        """(operands read, operands that identify its parameter, operands written) of one item."""
        if layout is None or position is None:
            return node.operands, node.operands, node.mutated_operands
        elements = layout.elements(node, position)
        return elements + shared, elements, layout.written_elements(node, position) + layout.writes_shared(node)

    def _dependencies(self, operands: list[Node], written: list[Node]) -> tuple[
            list[Item], int, frozenset[str], frozenset[str]]:  # fmt: skip
        """Items it waits for, the latest non-optimizer rank it waits for, gradients it depends on
        and parameters it touches."""
        item_deps: dict[Item, None] = {}
        waits = -1
        grads: set[str] = set()
        touched: set[str] = set()

        def wait_for(source: Item | int) -> None:
            nonlocal waits
            if isinstance(source, Item):
                item_deps[source] = None
            else:
                waits = max(waits, source)

        for operand in operands:
            seed = self.seeds.get(operand.id)
            if seed is not None:
                touched.add(seed)
                if operand.kind is NodeKind.GRADIENT:
                    grads.add(seed)
            if operand.id in self.item_of:
                wait_for(self.item_of[operand.id])
            elif operand.id in self.positions_of:  # the whole list of a multi-tensor op
                for part in self.positions_of[operand.id]:
                    wait_for(part)
            elif operand.op != "placeholder" and operand.phase is not Phase.FORWARD:
                wait_for(self.rank[operand.id])
            for key in _storages(operand):
                if key in self.writer:
                    wait_for(self.writer[key])
                grads |= self.content_grads.get(key, frozenset())
                touched |= self.content_owner.get(key, frozenset())
        for operand in written:
            for key in _storages(operand):
                for reader in self.readers.get(key, ()):
                    wait_for(reader)
        return list(item_deps), waits, frozenset(grads), frozenset(touched)

    def _touched(self, elements: list[Node]) -> frozenset[str]:
        """Parameters a multi-tensor position belongs to: through its list elements only."""
        touched: set[str] = set()
        for element in elements:
            if element.id in self.seeds:
                touched.add(self.seeds[element.id])
            for key in _storages(element):
                touched |= self.content_owner.get(key, frozenset())
        return frozenset(touched)

    def _note_item(self, item: Item, operands: list[Node], written: list[Node], grads: frozenset[str],
                   owners: frozenset[str]) -> None:  # fmt: skip
        for operand in operands:
            for key in _storages(operand):
                self.readers.setdefault(key, []).append(item)
        for operand in written:
            for key in _storages(operand):
                self.writer[key] = item
                self.readers[key] = []
                self.content_grads[key] = self.content_grads.get(key, frozenset()) | grads
                self.content_owner[key] = self.content_owner.get(key, frozenset()) | owners
        node = self.graph.node(item.node)
        if item.position is None:  # what it allocates carries what it was computed from
            for key in _storages(node):
                if key.creator == node.id:
                    self.content_grads[key], self.content_owner[key] = grads, owners
        elif node.is_tuple and item.position < len(node.tensors) and node.tensors[item.position] is not None:
            key = node.tensors[item.position].storage  # type: ignore[union-attr]
            if key.creator == node.id:
                self.content_grads[key], self.content_owner[key] = grads, owners

    def _note_fixed(self, node: Node, rank: int) -> str | None:
        """Record a non-optimizer node's reads and writes; say so if it reads what an update wrote."""
        conflict = None
        for operand in node.operands:
            for key in _storages(operand):
                if isinstance(self.writer.get(key), Item):
                    conflict = f"{node!r} ({node.op_name}) reads {operand!r}, which an update wrote before it"
                self.readers.setdefault(key, []).append(rank)
        for operand in node.mutated_operands:
            for key in _storages(operand):
                self.writer[key] = rank
                self.readers[key] = []
        return conflict

    def _allocated(self, node: Node, position: int | None) -> int:
        if position is None:
            return node.owned_bytes
        meta = node.tensors[position] if node.is_tuple and position < len(node.tensors) else None
        return meta.storage_bytes if meta is not None and meta.storage.creator == node.id else 0


def _storages(node: Node) -> list[StorageKey]:
    return list(dict.fromkeys(t.storage for t in node.tensors if t is not None))


# -- a new order -------------------------------------------------------------------------------------
class Unit(NamedTuple):
    """Consecutive items of one node in the new order: a node, or some positions of a multi-tensor op."""

    node: int
    positions: tuple[int, ...] | None


@dataclass
class Schedule:
    """The optimizer's units after each non-optimizer node (by rank), in the order to run them."""

    after: dict[int, list[Unit]]
    moved: int  #: items that now run at another anchor than before


def schedule(updates: OptimizerUpdates, group_of: Callable[[Item], Hashable | None],
             anchor_of: Callable[[Hashable], int]) -> Schedule:  # fmt: skip
    """Emit every group at its anchor (a rank of a non-optimizer node), its items in execution
    order, each after the items it depends on; items of no group run at their current anchor
    unless a group needs them earlier. Groups at one anchor run in the order of their first item."""
    groups: dict[Hashable, list[Item]] = {}
    loose: dict[int, list[Item]] = {}
    for item in updates.items:
        key = group_of(item)
        if key is None:
            loose.setdefault(updates.current_anchor[item], []).append(item)
        else:
            groups.setdefault(key, []).append(item)
    at: dict[int, list[Hashable]] = {}
    for key in groups:  # insertion order is the order of first items
        anchor = anchor_of(key)
        if anchor < max(updates.ready[i] for i in groups[key]):
            raise ValueError(f"group {key!r} anchored at rank {anchor}, before an item it holds is ready")
        at.setdefault(anchor, []).append(key)
    emitted: set[Item] = set()
    after: dict[int, list[Unit]] = {}
    placed: dict[Item, int] = {}
    for rank in sorted(set(at) | set(loose)):
        units = after.setdefault(rank, [])
        for key in at.get(rank, []):
            for item in groups[key]:
                _emit(item, updates, emitted, units, placed, rank)
        for item in loose.get(rank, []):
            _emit(item, updates, emitted, units, placed, rank)
    moved = sum(1 for item, rank in placed.items() if rank != updates.current_anchor[item])
    return Schedule(after, moved)


def _emit(item: Item, updates: OptimizerUpdates, emitted: set[Item], units: list[Unit], placed: dict[Item, int],
          rank: int) -> None:  # fmt: skip
    """Emit ``item`` after its dependencies (iteratively: dependency chains can be long)."""
    stack: list[tuple[Item, bool]] = [(item, False)]
    while stack:
        current, expanded = stack.pop()
        if current in emitted:
            continue
        if not expanded:
            stack.append((current, True))
            stack.extend((d, False) for d in reversed(updates.deps[current]) if d not in emitted)
            continue
        emitted.add(current)
        placed[current] = rank
        last = units[-1] if units else None
        if current.position is None:
            units.append(Unit(current.node, None))
        elif last is not None and last.node == current.node and last.positions is not None:
            units[-1] = Unit(current.node, (*last.positions, current.position))
        else:
            units.append(Unit(current.node, (current.position,)))


def apply(graph: Graph, updates: OptimizerUpdates, plan: Schedule) -> list[int]:
    """Reorder ``graph`` (the graph ``updates`` was computed on, or a copy of it) as ``plan`` says,
    splitting multi-tensor ops emitted in several units; returns the ids of the new split ops."""
    counts: dict[int, int] = {}
    for units in plan.after.values():
        for unit in units:
            counts[unit.node] = counts.get(unit.node, 0) + 1
    renamed: dict[StorageKey, StorageKey] = {}
    replaced: list[Node] = []
    created: list[int] = []
    placed: dict[int, list[Node]] = {}
    for rank, units in plan.after.items():
        for unit in units:
            node = graph.node(unit.node)
            layout = updates.layouts.get(unit.node)
            if layout is None or unit.positions is None:
                placed.setdefault(rank, []).append(node)
                continue
            if counts[unit.node] == 1 and unit.positions == tuple(range(layout.positions)):
                part = node
            else:
                part = _split(graph, node, layout, unit.positions, renamed)
                created.append(part.id)
                if node not in replaced:
                    replaced.append(node)
            getitems = list_getitems(part)
            placed.setdefault(rank, []).append(part)
            placed[rank] += [g for j in sorted(getitems) for g in getitems[j]]
    rename_storages(graph, renamed)
    for node in replaced:
        graph.erase(node)
    order: list[Node] = []
    fixed = [graph.node(n.id) for n in updates.fixed]
    for node, rank in zip(fixed, updates.fixed_ranks, strict=True):
        order.append(node)
        order += placed.get(rank, [])
    graph.reorder(order)
    return created
