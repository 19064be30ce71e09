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

**Fused pricing** (``fused=True``, asked for with ``select{fused=true}`` under a backend that
compiles the step with Inductor; off by default, see the end of this docstring): a recompute
block's clones are priced as Inductor runs them, not as eager does. Inductor fuses pointwise ops
vertically: a batch norm replayed from its statistics followed by a ReLU is one kernel, which reads
the batch norm's input and writes the ReLU's output, so the ReLU clone adds no time of its own. A
clone costs nothing, then, when its op is pointwise (tagged ``torch.Tag.pointwise``; an in-place op
by its out-of-place form's tag when it lacks its own) and one of its tensor operands is computed by
another clone of the same block that is pointwise, a batch norm replayed from its statistics or a
dropout replayed from its mask (:mod:`mutwo.ir.mask_replay`) (looking through the block's clones of
views and getitems, which launch no kernel and which Inductor folds into the indexing). The head of
such a chain keeps its measured time: its reads and its write are what the fused kernel does.
Priced eagerly, such chains cost what eager pays for them: on the H100 (ResNet-152 b128,
channels-last, inductor) ``select``'s plan at torch.compile budget 0.5's peak recomputed 47
convolutions and the step ran 1.1% slower than torch.compile. Priced fused, on the same H100
(2026-11-24), the plans recomputed batch-norm replays instead and ran no faster (121.5-125.5 ms in
three runs against 119.9-122.0 ms eager-priced; docs/backends.md): hence off by default.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from mutwo.ir.graph import Graph
from mutwo.ir.mask_replay import dropout_from_mask
from mutwo.ir.node import Node
from mutwo.ir.recompute import Block, out_of_place
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


def is_pointwise(target: Any) -> bool:
    """Whether ``target`` is a pointwise aten op (tagged so; an in-place op without the tag by its
    out-of-place form's), which Inductor fuses with the pointwise ops around it."""
    if torch.Tag.pointwise in getattr(target, "tags", ()):
        return True
    functional = out_of_place(target)
    return functional is not None and torch.Tag.pointwise in functional.tags


def is_plain_alias(node: Node) -> bool:
    """A view or getitem: an alias of its operand's storage that writes nothing (no kernel)."""
    return node.op == "call_function" and node.is_alias and not node.mutated_operands


def producer_chains(node: Node) -> tuple[tuple[Node, ...], ...]:
    """For each tensor operand of ``node``, the nodes from that operand down through plain aliases
    (views, getitems) to the node that computed the values: ``(alias, ..., producer)``."""
    chains = []
    for operand in node.operands:
        if not any(t is not None for t in operand.tensors):
            continue  # a symbolic size or a scalar: nothing a kernel reads
        chain = [operand]
        while is_plain_alias(operand):
            storages = {t.storage for t in operand.tensors if t is not None}
            base = next((o for o in operand.operands if any(t is not None and t.storage in storages
                                                             for t in o.tensors)), None)  # fmt: skip
            if base is None:
                break
            operand = base
            chain.append(operand)
        chains.append(tuple(chain))
    return tuple(chains)


def producer_paths(node: Node) -> tuple[tuple[int, ...], ...]:
    """:func:`producer_chains` as node ids."""
    return tuple(tuple(n.id for n in chain) for chain in producer_chains(node))


@dataclass(frozen=True)
class TimeModel:
    """Device seconds per node of one graph, from its profile (see the module docstring)."""

    profile: Any
    scale: float  #: measured iteration / the measured times of the nodes that do device work
    idle: frozenset[int]  #: profiled node ids that do no device work, or are not in the graph: they cost nothing
    fused: bool = False  #: price recompute blocks as Inductor fuses them (see the module docstring)
    #: with ``fused``: each pointwise node -> :func:`producer_paths` of its tensor operands
    pointwise: Mapping[int, tuple[tuple[int, ...], ...]] = field(default_factory=dict)

    @classmethod
    def of(cls, graph: Graph, profile: Any, fused: bool = False) -> TimeModel:
        """The model of ``graph`` (the graph ``profile`` was measured on); ``fused``: price
        recompute blocks as Inductor fuses them."""
        # A profiled node that is not in the graph costs nothing too: a profile the chunk pass
        # priced a head's slices in still holds the whole head's nodes, which counted beside their
        # slices made a sliced BERT-base's step 30% slower than the whole one (CPU, b8).
        present = {n.id for n in graph}
        idle = frozenset(n.id for n in graph if n.id in profile.nodes and not device_work(n, profile.device)) | \
            frozenset(node_id for node_id in profile.nodes if node_id not in present)  # fmt: skip
        working = _working_seconds(profile, idle)
        iteration = profile.iteration.seconds if profile.iteration is not None else None
        scale = iteration / working if iteration and working > 0 else 1.0
        pointwise = {n.id: producer_paths(n) for n in graph if n.op == "call_function" and is_pointwise(n.target)} \
            if fused else {}  # fmt: skip
        return cls(profile, scale, idle, fused, pointwise)

    def iteration_seconds(self) -> float:
        """The profiled graph's iteration as this model prices it: the measured iteration where
        there is one (CUDA), else the summed times of the nodes that do work (on CPU a view's
        measured microseconds are the host's, and the model prices it at nothing), so that a plan's
        predicted time and its baseline are on one scale."""
        return self.scale * _working_seconds(self.profile, self.idle)

    def node_seconds(self, node_id: int, from_stats: bool = False) -> float:
        """Device seconds of the profiled node ``node_id``; ``from_stats``: of its replay from the
        statistics it saved (a training batch norm recomputed that way)."""
        if node_id in self.idle:
            return 0.0
        measured = self.profile.replay_seconds(node_id) if from_stats else self.profile.seconds(node_id)
        return self.scale * measured

    def block_seconds(self, block: Block) -> float:
        """What the clones of a recompute block cost (with ``fused``, those :meth:`fused_away` nothing)."""
        free = self.fused_away(block)
        return sum(self.node_seconds(n, n in block.from_stats) for n in block.nodes if n not in free)

    def fused_away(self, block: Block) -> set[int]:
        """The clones of ``block`` that Inductor fuses into a producer clone of the block, so they
        add no time of their own: pointwise ones reading, through the block's alias clones, a
        pointwise clone, a batch norm replayed from its statistics or a dropout replayed from its
        mask. Empty unless ``fused``."""
        members = set(block.nodes)

        def fuses_into(path: tuple[int, ...]) -> bool:
            producer = path[-1]
            return all(n in members for n in path) and (
                producer in self.pointwise or producer in block.from_stats or producer in block.from_mask)

        return {n for n in block.nodes if any(map(fuses_into, self.pointwise.get(n, ())))}

    def __call__(self, node: Node) -> float:
        """Device seconds of ``node`` of the graph or of a rewrite of it (a clone costs what its
        origin does, a batch norm replayed from its statistics the measured replay; with
        ``fused``, a clone :func:`fused_clone` says Inductor fuses into its producer costs nothing)."""
        if node.origin is None:
            return self.node_seconds(node.id)
        if self.fused and fused_clone(node):
            return 0.0
        return self.node_seconds(node.origin, node.target is batch_norm_from_stats)


def _working_seconds(profile: Any, idle: frozenset[int]) -> float:
    """The measured times of the profiled nodes that do device work, summed."""
    return sum(p.seconds for node_id, p in profile.nodes.items() if node_id not in idle)


def fused_clone(node: Node) -> bool:
    """Whether ``node``, a recompute clone in a rewritten graph, is one Inductor fuses into the clone
    that produces its operand: the rule of :meth:`TimeModel.fused_away` read off the rewritten
    graph (a pointwise clone reading, through clones of views and getitems, a pointwise clone of
    its block, a batch norm replayed from its statistics or a dropout replayed from its mask). A
    block's clones are inserted together, before one node: a producer of the same block is one
    reached from ``node`` through clones only; a clone of an earlier block, inserted elsewhere, was
    written to memory and is read back."""
    if node.origin is None or node.op != "call_function" or not is_pointwise(node.target):
        return False

    def fuses_into(chain: tuple[Node, ...]) -> bool:
        producer = chain[-1]
        return all(n.origin is not None for n in chain) and _same_block(producer, node) and (
            is_pointwise(producer.target) or producer.target in (batch_norm_from_stats, dropout_from_mask))

    return any(map(fuses_into, producer_chains(node)))


def _same_block(producer: Node, clone: Node) -> bool:
    """Whether only clones run between ``producer`` and ``clone`` (so they were inserted together)."""
    graph = clone.graph
    if graph is None or producer.graph is not graph:
        return False
    start, end = graph.position(producer), graph.position(clone)
    return start < end and all(graph.node_at(index).origin is not None for index in range(start + 1, end))
