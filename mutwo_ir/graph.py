"""The mutwo IR graph: an ordered list of nodes with a narrow mutation API.

Nodes are kept in execution order. Every mutation goes through this class so that users,
stable ids and the change counter (which invalidates cached analyses) stay right.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any

from mutwo.ir.node import Node, NodeKind, Phase, StorageKey, TensorMeta, iter_nodes, map_nodes


class GraphError(ValueError):
    """A mutation the IR does not allow (erasing a used node, inserting a foreign node...)."""


class Graph:
    """A whole training iteration as IR nodes in execution order.

    ``slots`` lists, for each placeholder in order, the qualified name of what the runtime feeds
    it (for example ``fc.weight`` or ``fc.weight:exp_avg``); see :mod:`mutwo.runtime.capture.iteration`.
    """

    def __init__(self) -> None:
        self._nodes: list[Node] = []
        self._index: dict[Node, int] | None = None
        self._scans = 0  # lookups by scanning since the last mutation (see position())
        # The node the last insertion went just before, and its position now: inserting many
        # nodes before one point (a recompute block's clones) looks it up without a scan.
        self._before: tuple[Node, int] | None = None
        self._by_id: dict[int, Node] = {}
        self._names: set[str] = set()
        self._name_suffix: dict[str, int] = {}  # next suffix to try per base name: naming stays linear
        self._next_id = 0
        self.version = 0  #: bumped by every mutation; cached analyses compare against it
        self.meta: dict[str, Any] = {}  #: facts about the whole iteration (model, batch size...)

    # -- reading ---------------------------------------------------------------------------
    @property
    def nodes(self) -> list[Node]:
        """The nodes in execution order (a copy: mutate through the graph's methods)."""
        return list(self._nodes)

    def __iter__(self) -> Iterator[Node]:
        return iter(list(self._nodes))

    def __len__(self) -> int:
        return len(self._nodes)

    @property
    def next_id(self) -> int:
        """The id the next node created gets: every node this graph (or a copy) made has a lower one."""
        return self._next_id

    def node(self, node_id: int) -> Node:
        """The node with this stable id."""
        try:
            return self._by_id[node_id]
        except KeyError:
            raise GraphError(f"no node %{node_id} in the graph") from None

    def has_node(self, node_id: int) -> bool:
        return node_id in self._by_id

    def position(self, node: Node) -> int:
        """Index of ``node`` in execution order.

        Between mutations, lookups use an index built on demand; right after a mutation a few
        lookups scan the list instead (a C-level scan is far cheaper than rebuilding the index,
        which matters when many nodes are inserted one after another).
        """
        if self._index is None and self._before is not None and self._before[0] is node:
            return self._before[1]
        if self._index is None and self._scans < 16:
            self._scans += 1
            try:
                return self._nodes.index(node)
            except ValueError:
                raise GraphError(f"{node!r} is not in this graph") from None
        if self._index is None:
            self._index = {n: i for i, n in enumerate(self._nodes)}
        try:
            return self._index[node]
        except KeyError:
            raise GraphError(f"{node!r} is not in this graph") from None

    def node_at(self, position: int) -> Node:
        """The node at ``position`` in execution order (what :meth:`position` returns)."""
        return self._nodes[position]

    @property
    def placeholders(self) -> list[Node]:
        return [n for n in self._nodes if n.op == "placeholder"]

    @property
    def output(self) -> Node:
        """The output node (the verifier checks there is exactly one, at the end)."""
        for node in reversed(self._nodes):
            if node.op == "output":
                return node
        raise GraphError("the graph has no output node")

    def storage_owner(self, key: StorageKey) -> Node:
        """The node that allocated the storage ``key``."""
        return self.node(key.creator)

    # -- building --------------------------------------------------------------------------
    def mark_changed(self) -> None:
        self.version += 1

    def _order_changed(self) -> None:
        """Forget every remembered position (nodes were inserted, removed or reordered)."""
        self._index, self._scans, self._before = None, 0, None

    def _fresh_name(self, base: str) -> str:
        name, suffix = base, self._name_suffix.get(base, 1)
        while name in self._names:
            name = f"{base}_{suffix}"
            suffix += 1
        self._name_suffix[base] = suffix
        self._names.add(name)
        return name

    def create_node(
        self,
        op: str,
        target: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        *,
        name: str,
        kind: NodeKind = NodeKind.OTHER,
        phase: Phase = Phase.FORWARD,
        tensors: tuple[TensorMeta | None, ...] = (),
        is_tuple: bool = False,
        label: str = "",
        origin: int | None = None,
        node_id: int | None = None,
        before: Node | None = None,
        after: Node | None = None,
    ) -> Node:
        """Create a node and insert it at the end, or just before ``before`` / after ``after``.

        ``tensors`` may name the new node's own id as storage creator through ``StorageKey(-1, i)``,
        which is replaced by the id the node receives.
        """
        if before is not None and after is not None:
            raise GraphError("give at most one of before= and after=")
        # Check everything before changing anything: a refused node leaves no trace.
        for operand in iter_nodes((args, kwargs or {})):
            if operand.graph is not self:
                raise GraphError(f"operand {operand!r} of new node {name!r} is not in this graph")
        insert_at = len(self._nodes)
        if before is not None:
            insert_at = self.position(before)
        elif after is not None:
            insert_at = self.position(after) + 1
        new_id = self._next_id if node_id is None else node_id
        if new_id in self._by_id:
            raise GraphError(f"node id %{new_id} is already used")
        self._next_id = max(self._next_id, new_id + 1)
        tensors = tuple(
            None if t is None else (TensorMeta(t.shape, t.dtype, t.device, StorageKey(new_id, t.storage.output),
                                               t.storage_bytes) if t.storage.creator == -1 else t)
            for t in tensors
        )  # fmt: skip
        node = Node(
            id=new_id, name=self._fresh_name(name), op=op, target=target, kind=kind, phase=phase,
            tensors=tensors, is_tuple=is_tuple, label=label, origin=origin,
        )  # fmt: skip
        node.graph = self
        node.set_operands(tuple(args), dict(kwargs or {}))
        self._nodes.insert(insert_at, node)
        self._by_id[new_id] = node
        self._order_changed()
        if before is not None:
            self._before = (before, insert_at + 1)
        self.mark_changed()
        return node

    def copy_node(
        self,
        node: Node,
        remap: Mapping[Node, Node],
        *,
        before: Node | None = None,
        after: Node | None = None,
        phase: Phase | None = None,
        kind: NodeKind | None = None,
        clone: bool = True,
    ) -> Node:
        """Insert a copy of ``node`` whose operands are replaced through ``remap``.

        The copy gets a new id and records ``origin`` (with ``clone=False``, for a copy that moves
        a computation rather than replays it for recomputation, it records none); storages the
        original allocated become new storages of the copy, and storages it aliased follow the
        remapped operands.
        """
        args, kwargs = map_nodes((node.args, node.kwargs), lambda leaf: remap.get(leaf, leaf))
        storage_map = _storage_remap(node, remap)
        tensors = tuple(
            None if t is None else TensorMeta(t.shape, t.dtype, t.device, storage_map.get(t.storage, t.storage),
                                              t.storage_bytes)
            for t in node.tensors
        )  # fmt: skip
        return self.create_node(
            node.op, node.target, args, kwargs, name=node.name, kind=kind or node.kind,
            phase=phase or node.phase, tensors=tensors, is_tuple=node.is_tuple, label=node.label,
            origin=(node.id if node.origin is None else node.origin) if clone else None, before=before, after=after,
        )  # fmt: skip

    def replace_uses_after(self, old: Node, new: Node, point: Node) -> int:
        """Make every user of ``old`` placed after ``point`` read ``new`` instead; returns how many."""
        for node in (old, new, point):
            if node.graph is not self:
                raise GraphError(f"{node!r} is not in this graph")
        start = self.position(point)
        changed = 0
        for user in list(old.users):
            if user is new or self.position(user) <= start:
                continue
            args, kwargs = map_nodes((user.args, user.kwargs), lambda leaf: new if leaf is old else leaf)
            user.set_operands(args, kwargs)
            changed += 1
        return changed

    def reorder(self, order: list[Node]) -> None:
        """Put the nodes in ``order``, which must hold exactly this graph's nodes (verify the
        result: a node placed before one of its operands breaks the topological order)."""
        if len(order) != len(self._nodes) or set(order) != set(self._nodes):
            raise GraphError("reorder needs every node of the graph exactly once")
        self._nodes = list(order)
        self._order_changed()
        self.mark_changed()

    def erase(self, node: Node) -> None:
        """Remove a node that nothing uses."""
        if node.graph is not self:
            raise GraphError(f"cannot erase {node!r}: it is not in this graph")
        if node.users:
            users = ", ".join(repr(u) for u in node.users)
            raise GraphError(f"cannot erase {node!r}: it is still used by {users}")
        node.set_operands((), {})
        self._nodes.remove(node)
        del self._by_id[node.id]
        self._names.discard(node.name)
        node.graph = None
        self._order_changed()
        self.mark_changed()

    def copy(self) -> Graph:
        """A deep copy with the same ids, names and metadata.

        It builds the nodes directly rather than through :meth:`create_node`: the source graph
        already satisfies what create_node checks, and copying is on the hot path of selection.
        """
        clone = Graph()
        clone.meta = copy.deepcopy(self.meta)
        mapping: dict[Node, Node] = {}
        for node in self._nodes:
            new = Node(id=node.id, name=node.name, op=node.op, target=node.target, kind=node.kind, phase=node.phase,
                       tensors=node.tensors, is_tuple=node.is_tuple, label=node.label, origin=node.origin)
            new._args = map_nodes(node._args, mapping.__getitem__) if node._args else ()
            new._kwargs = map_nodes(node._kwargs, mapping.__getitem__) if node._kwargs else {}
            new.graph = clone
            for operand in new.operands:
                operand.users[new] = None
            mapping[node] = new
            clone._nodes.append(new)
            clone._by_id[new.id] = new
        clone._names = set(self._names)
        clone._name_suffix = dict(self._name_suffix)
        clone._next_id = self._next_id
        return clone


def _storage_remap(node: Node, remap: Mapping[Node, Node]) -> dict[StorageKey, StorageKey]:
    """How the storages of ``node`` map onto a copy of it whose operands follow ``remap``.

    Storages ``node`` allocated map to ``StorageKey(-1, i)`` (the copy's own, filled in by
    ``create_node``); storages of operands map to the same output of the remapped operand.
    """
    mapping: dict[StorageKey, StorageKey] = {}
    for operand in node.operands:
        replacement = remap.get(operand, operand)
        for old_meta, new_meta in zip(operand.tensors, replacement.tensors, strict=False):
            if old_meta is not None and new_meta is not None:
                mapping.setdefault(old_meta.storage, new_meta.storage)
    for meta in node.tensors:
        if meta is not None and meta.storage.creator == node.id:
            mapping[meta.storage] = StorageKey(-1, meta.storage.output)
    return mapping
