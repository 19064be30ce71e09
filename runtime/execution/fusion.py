"""Keeping Inductor's fusion from moving work across the forward/backward boundary, and its C++
backend from stretching buffer lifetimes across kernels.

Inductor fuses nodes that read the same data (horizontal fusion) or feed one another (vertical),
and a fused kernel runs where the earliest of its parts was. On a whole-iteration graph with
recomputes this can undo a plan: measured on CPU (docs/backends.md), the layout copies a
recomputed convolution reads were fused with the forward's copies of the same input, so the
recompute ran in the forward and its output stayed alive until the backward; a forward ReLU was
fused with the backward's ``threshold_backward`` of its recompute, with the same effect.
Inductor's own guard (``Scheduler.are_long_distant_nodes``: no horizontal fusion of nodes more
than 64 scheduler nodes apart) does not cover vertical fusion, nor near nodes.

The rules here: a forward node never fuses with a backward or optimizer node, a recompute
clone never fuses with a node it neither feeds nor reads (horizontal fusion: two recompute blocks
that read the same input would otherwise run together, the later one's output alive through the
earlier one's peak), and no kernel makes a slice of a sliced region (``chunk``) wait for a later
one. On the H100 Inductor fused the loss of every slice of a language-model head into one
reduction kernel (the running sum of the slices' losses chains them), which ran after the last
slice's logits were made, so every slice's logits were alive at once: BERT-base b64 in 4 slices
held 24,372 MiB where 17,158 MiB was simulated. With slices kept apart it still fused the loss's
``total_weight`` (the count of labelled tokens, which every slice's backward reads) with the sum
of the slices' losses divided by it, so every slice's backward waited for every slice's forward
(the 32k Llama's Inductor code, 2026-11-27): a kernel may not hold work that reads slice j and
work that an earlier or the same slice reads. Each fx node carries its phase in ``meta["custom"]``, which AOTAutograd
copies onto the aten nodes it traces from it
(``torch.fx.proxy._COPY_META_FIELDS``), so Inductor's IR nodes know it through their origins.
Fusion within the backward (a recompute into its consumers, an optimizer update into its
gradient's kernel) is kept: that is where recomputes become nearly free.

On the CPU one more thing undoes a plan: Inductor's C++ backend (``CppScheduling``) does not emit
one function per fused node but appends every fused node to a kernel group, one C++ function
called once, until an extern kernel (a convolution, a matmul) or 500 arguments end the group. The
wrapper allocates every buffer the group writes before that call and frees the buffers it last
reads after it, so buffers the plan frees between two of its nodes live through the whole group
(measured in docs/backends.md: a gradient dead after ``threshold_backward`` still alive when the
batch norm's input gradient and a channels-last copy of the batch are allocated, +9% peak).
:func:`kernel_per_node` ends the group after each fused node, as the Triton backend does anyway.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from torch import fx

from mutwo.ir.graph import Graph
from mutwo.ir.node import Phase
from mutwo.ir.row_region import SLICED_META
from mutwo.ir.to_fx import NODE_ID_META

#: The keys under ``meta["custom"]`` holding a node's phase and whether it is a recompute clone.
CUSTOM_PHASE = "mutwo_phase"
CUSTOM_CLONE = "mutwo_clone"
#: The key holding the slice a node of a sliced region computes (``"LOGITS-ID:INDEX"``).
CUSTOM_SLICE = "mutwo_slice"
#: The keys holding, for a node outside the slices, the last slice whose work it reads (directly
#: or through other nodes) and the first slice whose work reads it, per region: ``{"LOGITS-ID": INDEX}``.
CUSTOM_AFTER = "mutwo_after_slice"
CUSTOM_BEFORE = "mutwo_before_slice"


def mark_phases(module: fx.GraphModule, graph: Graph) -> None:
    """Record the phase of each node of ``module`` (made from ``graph`` by ``to_fx``), whether it
    is a recompute clone and the slice it computes, where AOTAutograd carries them to the nodes it
    traces."""
    slices = slice_of(graph)
    after, before = slice_order(graph, slices)
    for node in module.graph.nodes:
        if node.op == "call_function" and NODE_ID_META in node.meta:
            ir_node = graph.node(node.meta[NODE_ID_META])
            custom = node.meta.setdefault("custom", {})
            custom[CUSTOM_PHASE] = ir_node.phase.value
            custom[CUSTOM_CLONE] = ir_node.origin is not None
            where = slices.get(ir_node.origin if ir_node.origin is not None else ir_node.id)
            if where is not None:
                custom[CUSTOM_SLICE] = where
            if ir_node.id in after:
                custom[CUSTOM_AFTER] = after[ir_node.id]
            if ir_node.id in before:
                custom[CUSTOM_BEFORE] = before[ir_node.id]


def slice_of(graph: Graph) -> dict[int, str]:
    """Node id -> ``"LOGITS-ID:INDEX"``, the slice it computes, for the nodes of ``graph``'s sliced
    regions (what ``chunk`` recorded under :data:`~mutwo.ir.row_region.SLICED_META`)."""
    return {node_id: f"{record['logits']}:{index}" for record in graph.meta.get(SLICED_META, ())
            for index, nodes in enumerate(record.get("per_slice", ())) for node_id in nodes}  # fmt: skip


def slice_order(graph: Graph, slices: dict[int, str]) -> tuple[dict[int, dict[str, int]], dict[int, dict[str, int]]]:
    """For each node of ``graph`` outside the slices ``slices`` names (by id or by its origin's):
    the last slice of each region whose work it reads, and the first slice of each region whose
    work reads it (both through any path; nodes unrelated to a region are left out)."""
    if not slices:
        return {}, {}
    nodes = graph.nodes
    own: dict[int, dict[str, int]] = {}  # slice work: {region: its slice}
    for node in nodes:
        where = slices.get(node.origin if node.origin is not None else node.id)
        if where is not None:
            region, index = where.split(":")
            own[node.id] = {region: int(index)}
    after: dict[int, dict[str, int]] = {}
    for node in nodes:  # in order: every operand before its reader
        reads: dict[str, int] = {}
        for operand in node.operands:
            for region, index in own.get(operand.id, after.get(operand.id, {})).items():
                reads[region] = max(reads.get(region, index), index)
        if reads and node.id not in own:
            after[node.id] = reads
    readers: dict[int, dict[str, int]] = {}
    for node in reversed(nodes):  # every reader before its operands
        fed = own.get(node.id, readers.get(node.id, {}))
        for operand in node.operands:
            into = readers.setdefault(operand.id, {})
            for region, index in fed.items():
                into[region] = min(into.get(region, index), index)
    before = {node_id: fed for node_id, fed in readers.items() if fed and node_id not in own}
    return after, before


def _part_marks(part: Any) -> Iterator[dict[str, Any]]:
    """The ``meta["custom"]`` of every fx node behind one scheduler node's IR node (its origins)."""
    ir_node = getattr(part, "node", None)
    for origin in ir_node.get_origins() if ir_node is not None else ():
        yield origin.meta.get("custom", {})


def _part_output_marks(part: Any) -> Iterator[dict[str, Any]]:
    """The ``meta["custom"]`` of the fx node whose value one scheduler node writes (its buffer's
    ``origin_node``), leaving out what lowering inlined into it; every origin where Inductor did
    not record which one it realizes."""
    ir_node = getattr(part, "node", None)
    realized = getattr(ir_node, "origin_node", None) if ir_node is not None else None
    if realized is not None:
        yield realized.meta.get("custom", {})
    else:
        yield from _part_marks(part)


@dataclass(frozen=True)
class _Facts:
    """What the fusion rules read of one of Inductor's scheduler nodes: the phases of its fx
    origins, whether one is a recompute clone, the slices it holds and, per sliced region, its
    slices' indices, the last slice it reads (-1: none) and the first slice reading it
    (:data:`NO_SLICE`: none)."""

    phases: frozenset[str]
    has_clone: bool
    slices: frozenset[str]
    sides: dict[str, tuple[frozenset[int], int, int]]


def _part_facts(part: Any) -> _Facts:
    """:class:`_Facts` of one unfused scheduler node, from its origins' marks."""
    sides: dict[str, tuple[frozenset[int], int, int]] = {}
    for mark in _part_output_marks(part):  # what reads an inlined part reads the kernel, not its output
        for region, index in mark.get(CUSTOM_BEFORE, {}).items():
            own, read, fed = sides.get(region, (frozenset(), -1, NO_SLICE))
            sides[region] = (own, read, min(fed, index))
    marks = list(_part_marks(part))
    for mark in marks:
        for region, index in mark.get(CUSTOM_AFTER, {}).items():
            own, read, fed = sides.get(region, (frozenset(), -1, NO_SLICE))
            sides[region] = (own, max(read, index), fed)
        if CUSTOM_SLICE in mark:
            region, index = mark[CUSTOM_SLICE].split(":")
            own, read, fed = sides.get(region, (frozenset(), -1, NO_SLICE))
            sides[region] = (own | {int(index)}, read, fed)
    return _Facts(phases=frozenset(mark[CUSTOM_PHASE] for mark in marks if CUSTOM_PHASE in mark),
                  has_clone=any(mark.get(CUSTOM_CLONE) for mark in marks),
                  slices=frozenset(mark[CUSTOM_SLICE] for mark in marks if CUSTOM_SLICE in mark),
                  sides=sides)  # fmt: skip


def _merged(parts: list[_Facts]) -> _Facts:
    """The :class:`_Facts` of a fused node from its parts': every rule reads a union, a largest
    "last slice read" and a smallest "first slice reading"."""
    if len(parts) == 1:
        return parts[0]
    sides: dict[str, tuple[frozenset[int], int, int]] = {}
    for part in parts:
        for region, (own, read, fed) in part.sides.items():
            had_own, had_read, had_fed = sides.get(region, (frozenset(), -1, NO_SLICE))
            sides[region] = (had_own | own, max(had_read, read), min(had_fed, fed))
    return _Facts(phases=frozenset().union(*(part.phases for part in parts)),
                  has_clone=any(part.has_clone for part in parts),
                  slices=frozenset().union(*(part.slices for part in parts)), sides=sides)  # fmt: skip


#: While :func:`phase_bounded_fusion` is entered: each scheduler node's facts by ``id``, with the
#: node itself so that its id is not reused, one table for unfused parts and one for the nodes
#: asked about (a fused node is never taken for a part). Inductor asks ``can_fuse`` of every
#: candidate pair, and walking both nodes' origins each time took 43 s of ResNet-152's 272 s
#: compile on the H100.
_PARTS_SEEN: dict[int, tuple[Any, _Facts]] | None = None
_NODES_SEEN: dict[int, tuple[Any, _Facts]] | None = None


def _remembered(node: Any, seen: dict[int, tuple[Any, _Facts]] | None, gather: Callable[[Any], _Facts]) -> _Facts:
    """``gather(node)``, once per node in ``seen`` (every time without one)."""
    if seen is None:
        return gather(node)
    entry = seen.get(id(node))
    if entry is None or entry[0] is not node:
        entry = seen[id(node)] = (node, gather(node))
    return entry[1]


def _facts(node: Any) -> _Facts:
    """:class:`_Facts` of Inductor's scheduler ``node``, fused or not (its parts: ``get_nodes()``)."""
    return _remembered(node, _NODES_SEEN, lambda whole: _merged(
        [_remembered(part, _PARTS_SEEN, _part_facts) for part in whole.get_nodes()]))


def _forward_and_later(*nodes: Any) -> bool:
    phases = frozenset().union(*(_facts(node).phases for node in nodes))
    return Phase.FORWARD.value in phases and len(phases) > 1


def _has_clone(node: Any) -> bool:
    return _facts(node).has_clone


def mixes_slices(node1: Any, node2: Any) -> bool:
    """Whether fusing Inductor's scheduler nodes ``node1`` and ``node2`` would put work of different
    slices of a sliced region in one kernel: both hold slice work, and not of the same slices. A node
    lowering already joined (a concatenation of the slices' parts, its producers inlined) fuses only
    with nodes of no slice: fused with one slice's node, it would move that work after every slice."""
    first, second = _facts(node1).slices, _facts(node2).slices
    return bool(first and second and first != second)


def delays_a_slice(node1: Any, node2: Any) -> bool:
    """Whether fusing Inductor's scheduler nodes ``node1`` and ``node2`` would make some slice's work
    wait for a later (or the same) slice's: one side reads work of slice j (directly or through
    other nodes) and the other side is slice i's work or is read by slice i's, with i <= j (i < j
    where the other side is slice i's own work, which may fuse with what reads it)."""
    first, second = _facts(node1).sides, _facts(node2).sides
    if not first or not second:
        return False
    for region in first.keys() & second.keys():
        for (_, reads, feeds), (own, _, other_feeds) in ((first[region], second[region]),
                                                         (second[region], first[region])):  # fmt: skip
            if reads >= other_feeds:
                return True  # one side reads slice j, the other feeds slice i <= j
            if own and (reads > min(own) or feeds < max(own)):
                return True  # the other side is slice i's work; this one reads a later slice or feeds an earlier
    return False


#: A slice index past every region's last slice: "reads no slice".
NO_SLICE = 1 << 30


#: Names the fusion rule and the kernel grouping in Inductor's cache keys (through
#: :class:`PhasesArrived`): change it when either changes, or the FX graph cache serves code
#: generated under the old one.
RULE_VERSION = "mutwo-phase-bounded-fusion-4-kernel-per-node-slice-bounded-2"


def phases_arrived(more_rules: str = "") -> Any:
    """A post-grad pass for Inductor that fails the compile when no node of the graph Inductor
    lowers carries a phase (a torch whose AOTAutograd does not copy ``meta["custom"]`` would make
    the fusion rule silently do nothing); its ``uuid`` puts :data:`RULE_VERSION` (and
    ``more_rules``, the version of other rules the compile applies) in the cache key."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class PhasesArrived(CustomGraphPass):
        def __call__(self, graph: fx.Graph) -> None:
            if not any(CUSTOM_PHASE in node.meta.get("custom", {}) for node in graph.nodes):
                raise RuntimeError("no node reached Inductor with its phase, so fusion cannot be kept within "
                                   "phases on this torch version")  # fmt: skip

        def uuid(self) -> str:
            return RULE_VERSION + (f"+{more_rules}" if more_rules else "")

    return PhasesArrived()


@contextmanager
def phase_bounded_fusion() -> Iterator[None]:
    """Inductor's choices handler refusing fusions that mix forward and later nodes, two slices of a
    sliced region, or make a slice wait for a later one, while compiling (use with
    ``post_grad_custom_post_pass=phases_arrived()``)."""
    from torch._inductor.choices import InductorChoices
    from torch._inductor.virtualized import V

    class PhaseBoundedChoices(InductorChoices):
        @staticmethod
        def can_fuse(scheduler: Any, node1: Any, node2: Any, shared_data_score: int) -> bool:
            # asked before every fusion, vertical or horizontal
            if _forward_and_later(node1, node2) or mixes_slices(node1, node2) or delays_a_slice(node1, node2):
                return False
            return InductorChoices.can_fuse(scheduler, node1, node2, shared_data_score)

        @staticmethod
        def can_fuse_horizontal(scheduler: Any, node1: Any, node2: Any, shared_data_score: int) -> bool:
            if _has_clone(node1) or _has_clone(node2):
                return False
            return InductorChoices.can_fuse_horizontal(scheduler, node1, node2, shared_data_score)

    global _PARTS_SEEN, _NODES_SEEN
    outer = _PARTS_SEEN, _NODES_SEEN
    _PARTS_SEEN, _NODES_SEEN = {}, {}
    try:
        with V.set_choices_handler(PhaseBoundedChoices()):
            yield
    finally:
        _PARTS_SEEN, _NODES_SEEN = outer


@contextmanager
def kernel_per_node() -> Iterator[None]:
    """Inductor's C++ backend ending its kernel group after each fused node, while compiling: each
    node's buffers are allocated right before its kernel and freed right after its last reader,
    in the plan's order (the scheduler asks ``ready_to_flush`` after every node it generates)."""
    from torch._inductor.codegen.cpp import CppScheduling

    grouping = CppScheduling.ready_to_flush
    CppScheduling.ready_to_flush = lambda self: True  # type: ignore[method-assign]
    try:
        yield
    finally:
        CppScheduling.ready_to_flush = grouping  # type: ignore[method-assign]
