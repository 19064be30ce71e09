"""The time model of the simulators: how long each node keeps the device busy, from a profile.

A profile measures each node between two CUDA events recorded around it, without synchronising.
When the GPU has caught up with the host, the elapsed time is the host's launch time, not the
GPU's: a view, which launches no kernel, measures 20-45 µs on the H100's host, and BERT-base's
node times add up to 1.4x its measured iteration (docs/benchmarks.md, "The time model"). Scaling
every node by one factor so that they add up to the iteration charges views and host-side ops for
time the device does not spend, and under-prices the kernels.

This model separates the two:

* a node that does no work on the device costs nothing there: a placeholder or output, a swap op
  (its copies run on the copy streams), an alias that writes nothing (view, getitem, transpose,
  detach: no kernel), and, on a GPU, an op whose results all live in host memory and that writes
  no device tensor (host scalars: the host's time, which the GPU does not wait for when it has
  work queued);
* the nodes that do work share the measured iteration in proportion to their measured times (the
  launch gaps of the real iteration are spread over them): ``scale = iteration / their sum``.

Without a measured iteration (CPU, where the wall clock times the op itself) the scale is 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mutwo.ir.graph import Graph
from mutwo.ir.node import Node
from mutwo.ir.recompute import Block
from mutwo.ir.replay import batch_norm_from_stats
from mutwo.ir.swap import SWAP_OPS


def device_work(node: Node, device: str) -> bool:
    """Whether ``node`` keeps ``device`` busy (see the module docstring for what does not)."""
    if node.op != "call_function" or node.target in SWAP_OPS:
        return False
    written = node.mutated_operands
    if node.is_alias and not written:
        return False
    if device == "cpu" or not node.tensors:
        return True
    return any(t is not None and t.device != "cpu" for n in (node, *written) for t in n.tensors)


@dataclass(frozen=True)
class TimeModel:
    """Device seconds per node of one graph, from its profile (see the module docstring)."""

    profile: Any
    scale: float  #: measured iteration / the measured times of the nodes that do device work
    idle: frozenset[int]  #: profiled node ids that do no device work: they cost nothing

    @classmethod
    def of(cls, graph: Graph, profile: Any) -> TimeModel:
        """The model of ``graph`` (the graph ``profile`` was measured on)."""
        idle = frozenset(n.id for n in graph if n.id in profile.nodes and not device_work(n, profile.device))
        working = sum(p.seconds for node_id, p in profile.nodes.items() if node_id not in idle)
        iteration = profile.iteration.seconds if profile.iteration is not None else None
        scale = iteration / working if iteration and working > 0 else 1.0
        return cls(profile, scale, idle)

    def node_seconds(self, node_id: int, from_stats: bool = False) -> float:
        """Device seconds of the profiled node ``node_id``; ``from_stats``: of its replay from the
        statistics it saved (a training batch norm recomputed that way)."""
        if node_id in self.idle:
            return 0.0
        measured = self.profile.replay_seconds(node_id) if from_stats else self.profile.seconds(node_id)
        return self.scale * measured

    def block_seconds(self, block: Block) -> float:
        """What the clones of a recompute block cost."""
        return sum(self.node_seconds(n, n in block.from_stats) for n in block.nodes)

    def __call__(self, node: Node) -> float:
        """Device seconds of ``node`` of the graph or of a rewrite of it (a clone costs what its
        origin does, a batch norm replayed from its statistics the measured replay)."""
        if node.origin is None:
            return self.node_seconds(node.id)
        return self.node_seconds(node.origin, node.target is batch_norm_from_stats)
