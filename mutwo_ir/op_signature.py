"""Which nodes do the same work, and pooling their measured times.

A network repeats itself: ResNet-152's 36 bottlenecks of its third stage, BERT's 12 layers, run
the same ops on tensors of the same shapes. Measured one node at a time, those ops still come back
a few percent apart (clocks, caches, what the allocator did before), and a greedy selection
ranks equal candidates by that noise alone: two profiles of one model on one GPU gave plans that
recomputed different sets and trained 5% apart (ResNet-152 channels-last b128 under Inductor,
docs/benchmarks.md, sixth session). Pooling gives every node of one signature the median of
their times, so equal work is priced equally and the plan follows the model, not the noise.

A signature is the op, the shapes and dtypes of the tensors it reads, how each operand was made
when it is a view (a transposed matrix runs another GEMM kernel than a contiguous one of the same
shape) and every non-tensor argument. Placeholders, the output and collectives keep their own
times: they are not repeated work. The IR records no strides or devices (:class:`TensorMeta`), so
two nodes whose operands differ only in layout or device share a signature: in a channels-last
ResNet a few ``threshold_backward`` nodes with an NCHW operand pool with NHWC ones (found in a CPU
capture; BERT has no such group).
"""

from __future__ import annotations

import statistics
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from torch.utils import _pytree as pytree

from mutwo.ir.graph import Graph
from mutwo.ir.node import Node


class TimedNode(Protocol):
    """What pooling reads and writes of a node's measurement (runtime.profiler.NodeProfile)."""

    seconds: float
    replay_seconds: float | None


def _operand(value: Any) -> Hashable:
    """What an argument contributes to a signature: a node's tensors (and, for a view, the op that
    made it), anything else its value."""
    if not isinstance(value, Node):
        return ("value", repr(value))
    shapes = tuple(None if t is None else (t.shape, t.dtype_name) for t in value.tensors)
    made_by = value.op_name if value.is_alias else ""
    return ("node", shapes, made_by)


def op_signature(node: Node) -> Hashable | None:
    """What identifies the work ``node`` does, or None for nodes that are not pooled."""
    if node.op != "call_function" or node.is_collective:
        return None
    leaves, spec = pytree.tree_flatten((node.args, node.kwargs))
    return (node.op_name, str(spec), tuple(_operand(leaf) for leaf in leaves))


@dataclass(frozen=True)
class PoolingSummary:
    """What pooling did: how many nodes shared a signature with another and in how many groups,
    and how far the pooled nodes' own times were from their group's median at most."""

    pooled_nodes: int
    groups: int
    largest_deviation: float  #: max |own − median| / median over pooled nodes (0.25 = 25%)

    def to_json(self) -> dict[str, Any]:
        return {"pooled_nodes": self.pooled_nodes, "groups": self.groups,
                "largest_deviation": round(self.largest_deviation, 4)}  # fmt: skip


def pool_times(graph: Graph, nodes: Mapping[int, TimedNode]) -> PoolingSummary:
    """Give every node of ``graph`` measured in ``nodes`` the median time of the nodes of its
    signature (``seconds`` and, where measured, ``replay_seconds``), in place."""
    groups: dict[Hashable, list[TimedNode]] = {}
    for node in graph:
        measured = nodes.get(node.id)
        signature = op_signature(node) if measured is not None else None
        if signature is not None:
            groups.setdefault(signature, []).append(measured)  # type: ignore[arg-type]
    pooled = [members for members in groups.values() if len(members) > 1]
    deviation = 0.0
    for members in pooled:
        median = statistics.median(m.seconds for m in members)
        if median > 0:
            deviation = max(deviation, max(abs(m.seconds - median) for m in members) / median)
        replays = [m.replay_seconds for m in members if m.replay_seconds is not None]
        replay_median = statistics.median(replays) if replays else None
        for member in members:
            member.seconds = median
            if member.replay_seconds is not None:
                member.replay_seconds = replay_median
    return PoolingSummary(sum(len(m) for m in pooled), len(pooled), deviation)
