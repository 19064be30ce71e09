"""Ranks and storage liveness: when each storage is allocated, used and freed.

Bytes belong to storages, not nodes. A storage is allocated by its creating node and stays
alive while any node that holds it (its creator, views of it, in-place results, tuples and the
getitems taken from them) may still be read: it is freed right after the last node that reads a
holder, exactly as the generated fx code drops each local after its last use. Storages of
placeholders belong to the caller and live through the whole iteration, and so do storages
the output returns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from mutwo.ir.graph import Graph
from mutwo.ir.node import Node, NodeKind, Phase, StorageKey

#: When one storage is held by nodes of several kinds, the first kind in this list names it.
KIND_PRECEDENCE = (
    NodeKind.PARAMETER, NodeKind.BUFFER, NodeKind.OPTIMIZER_STATE, NodeKind.INPUT, NodeKind.COMMUNICATION,
    NodeKind.GRADIENT, NodeKind.ACTIVATION, NodeKind.OTHER,
)  # fmt: skip


@dataclass
class StorageLiveness:
    """The life of one storage, in ranks (positions in execution order)."""

    key: StorageKey
    bytes: int
    device: str
    kind: NodeKind  #: the most significant kind among its holders (see KIND_PRECEDENCE)
    persistent: bool  #: a graph input's storage, held by the caller
    created: int
    last_use: int  #: the rank after which it is freed (the output's rank if returned)
    holders: list[int] = field(default_factory=list)  #: ids of the nodes holding it
    last_forward_use: int | None = None
    first_backward_use: int | None = None
    last_backward_use: int | None = None
    returned: bool = False
    phase_of_creation: Phase = Phase.FORWARD

    @property
    def is_activation(self) -> bool:
        """Allocated by a forward computation and read again by the backward."""
        return (not self.persistent and self.first_backward_use is not None
                and self.phase_of_creation is Phase.FORWARD)  # fmt: skip

    @property
    def inactive_interval(self) -> tuple[int, int] | None:
        """(last forward use, first backward use) of an activation: the stretch it sits idle."""
        if not self.is_activation or self.first_backward_use is None:
            return None
        return (self.last_forward_use if self.last_forward_use is not None else self.created, self.first_backward_use)


@dataclass
class Liveness:
    """Liveness of every storage of a graph, for one version of it."""

    version: int
    rank: dict[int, int]  #: node id -> position
    storages: dict[StorageKey, StorageLiveness]
    freed_after: dict[int, list[StorageKey]]  #: rank -> storages freed right after that node
    allocated_at: dict[int, list[StorageKey]]  #: rank -> storages that node allocates

    def of_node(self, node: Node) -> list[StorageLiveness]:
        """The storages a node holds."""
        keys = dict.fromkeys(t.storage for t in node.tensors if t is not None)
        return [self.storages[k] for k in keys if k in self.storages]

    def activations(self) -> list[StorageLiveness]:
        return [s for s in self.storages.values() if s.is_activation]


def elapsed_seconds(graph: Graph, seconds: Callable[[int], float]) -> list[float]:
    """``elapsed[i]``: the summed time of the first ``i`` nodes, given each node id's time."""
    elapsed = [0.0]
    for node in graph:
        elapsed.append(elapsed[-1] + seconds(node.id))
    return elapsed


def idle_seconds(record: StorageLiveness, elapsed: list[float]) -> float:
    """Time an activation sits idle: the nodes strictly between its last forward use and its
    first backward use (0 for anything that is not an activation)."""
    start, end = record.inactive_interval or (record.created, record.created)
    return elapsed[end] - elapsed[start + 1] if end > start else 0.0


def compute_ranks(graph: Graph) -> dict[int, int]:
    """Node id -> position in execution order."""
    return {node.id: index for index, node in enumerate(graph)}


def compute_liveness(graph: Graph) -> Liveness:
    """Liveness of every storage in ``graph`` (linear in nodes plus edges)."""
    nodes = graph.nodes
    rank = {node.id: index for index, node in enumerate(nodes)}
    output_rank = len(nodes) - 1
    storages: dict[StorageKey, StorageLiveness] = {}
    for index, node in enumerate(nodes):
        for meta in node.tensors:
            if meta is None:
                continue
            record = storages.get(meta.storage)
            if record is None:
                creator = graph.node(meta.storage.creator) if graph.has_node(meta.storage.creator) else node
                persistent = creator.op == "placeholder"
                record = StorageLiveness(
                    key=meta.storage, bytes=meta.storage_bytes, device=meta.device, kind=node.kind,
                    persistent=persistent, created=rank.get(creator.id, index),
                    last_use=output_rank if persistent else index, phase_of_creation=creator.phase,
                )  # fmt: skip
                storages[meta.storage] = record
            if not record.holders or record.holders[-1] != node.id:  # a node's tensors come together
                record.holders.append(node.id)
                if KIND_PRECEDENCE.index(node.kind) < KIND_PRECEDENCE.index(record.kind):
                    record.kind = node.kind
            # Reading a holder keeps the storage alive; so does the holder's own definition.
            record.last_use = max(record.last_use, index)
            for user in node.users:
                _note_use(record, rank[user.id], user.phase, output_rank, user.op == "output")
    freed_after: dict[int, list[StorageKey]] = {}
    allocated_at: dict[int, list[StorageKey]] = {}
    for key, record in storages.items():
        if not record.persistent:
            allocated_at.setdefault(record.created, []).append(key)
            if not record.returned:
                freed_after.setdefault(record.last_use, []).append(key)
    return Liveness(graph.version, rank, storages, freed_after, allocated_at)


def _note_use(record: StorageLiveness, at: int, phase: Phase, output_rank: int, is_output: bool) -> None:
    if is_output:
        record.returned = True
        record.last_use = output_rank
        return
    record.last_use = max(record.last_use, at)
    if phase is Phase.FORWARD:
        record.last_forward_use = at if record.last_forward_use is None else max(record.last_forward_use, at)
    elif phase is Phase.BACKWARD:
        record.first_backward_use = at if record.first_backward_use is None else min(record.first_backward_use, at)
        record.last_backward_use = at if record.last_backward_use is None else max(record.last_backward_use, at)
