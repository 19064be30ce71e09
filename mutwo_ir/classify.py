"""Kinds of computed nodes, derived from the graph's structure.

Transforms call :func:`classify` after changing the graph: a forward value stops being an
activation when the rewrite moves its backward uses to a recompute clone.
"""

from __future__ import annotations

from mutwo.ir.graph import Graph
from mutwo.ir.node import STATE_KINDS, Node, NodeKind, Phase, StorageKey


def classify(graph: Graph) -> None:
    """Set the kind of every computed node except gradients (which lowering marks).

    * an in-place update of a persistent-state placeholder takes that placeholder's kind;
    * a collective, and every node holding a storage a collective reads or writes (a gradient
      bucket, the coalesced buffers of a broadcast), is ``communication``;
    * a forward value read by the backward phase is an activation (views included: their
      ``alias`` storage tells they own no bytes);
    * everything else is ``other``.
    """
    communicated = communication_storages(graph)
    for node in graph:
        if node.op != "call_function" or node.kind is NodeKind.GRADIENT:
            continue
        owner_kind = state_kind_of_update(graph, node)
        if owner_kind is not None:
            node.kind = owner_kind
        elif node.is_collective or any(t is not None and t.storage in communicated for t in node.tensors):
            node.kind = NodeKind.COMMUNICATION
        elif node.phase is Phase.FORWARD and any(u.phase is Phase.BACKWARD for u in node.users):
            node.kind = NodeKind.ACTIVATION
        else:
            node.kind = NodeKind.OTHER


def communication_storages(graph: Graph) -> set[StorageKey]:
    """Storages that collectives communicate, other than the caller's (a collective writing a
    parameter or buffer in place leaves it a parameter or buffer)."""
    return {t.storage for node in graph if node.is_collective for t in node.tensors
            if t is not None and graph.has_node(t.storage.creator)
            and graph.node(t.storage.creator).op != "placeholder"}  # fmt: skip


def state_kind_of_update(graph: Graph, node: Node) -> NodeKind | None:
    """The kind of the persistent state that ``node`` updates in place, if it does."""
    meta = node.tensor
    if meta is None or meta.storage.creator == node.id:
        return None
    if not any(t is not None and t.storage == meta.storage for written in node.mutated_operands
               for t in written.tensors):  # fmt: skip
        return None
    if not graph.has_node(meta.storage.creator):
        return None
    owner = graph.storage_owner(meta.storage)
    if owner.op == "placeholder" and owner.kind in STATE_KINDS:
        return owner.kind
    return None
