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
earlier one's peak), and no kernel mixes two slices of a sliced region (``chunk``). On the H100
Inductor fused the loss of every slice of a language-model head into one reduction kernel (the
running sum of the slices' losses chains them), which ran after the last slice's logits were
made, so every slice's logits were alive at once: BERT-base b64 in 4 slices held 24,372 MiB where
17,158 MiB was simulated. Each fx node carries its phase in ``meta["custom"]``, which AOTAutograd
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

from collections.abc import Iterator
from contextlib import contextmanager
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


def mark_phases(module: fx.GraphModule, graph: Graph) -> None:
    """Record the phase of each node of ``module`` (made from ``graph`` by ``to_fx``), whether it
    is a recompute clone and the slice it computes, where AOTAutograd carries them to the nodes it
    traces."""
    slices = slice_of(graph)
    for node in module.graph.nodes:
        if node.op == "call_function" and NODE_ID_META in node.meta:
            ir_node = graph.node(node.meta[NODE_ID_META])
            custom = node.meta.setdefault("custom", {})
            custom[CUSTOM_PHASE] = ir_node.phase.value
            custom[CUSTOM_CLONE] = ir_node.origin is not None
            where = slices.get(ir_node.origin if ir_node.origin is not None else ir_node.id)
            if where is not None:
                custom[CUSTOM_SLICE] = where


def slice_of(graph: Graph) -> dict[int, str]:
    """Node id -> ``"LOGITS-ID:INDEX"``, the slice it computes, for the nodes of ``graph``'s sliced
    regions (what ``chunk`` recorded under :data:`~mutwo.ir.row_region.SLICED_META`)."""
    return {node_id: f"{record['logits']}:{index}" for record in graph.meta.get(SLICED_META, ())
            for index, nodes in enumerate(record.get("per_slice", ())) for node_id in nodes}  # fmt: skip


def _marks(*nodes: Any) -> Iterator[dict[str, Any]]:
    """The ``meta["custom"]`` of every fx node behind Inductor's scheduler ``nodes``."""
    for scheduler_node in nodes:
        for part in scheduler_node.get_nodes():
            ir_node = getattr(part, "node", None)
            for origin in ir_node.get_origins() if ir_node is not None else ():
                yield origin.meta.get("custom", {})


def _forward_and_later(*nodes: Any) -> bool:
    phases = {mark[CUSTOM_PHASE] for mark in _marks(*nodes) if CUSTOM_PHASE in mark}
    return Phase.FORWARD.value in phases and len(phases) > 1


def _has_clone(node: Any) -> bool:
    return any(mark.get(CUSTOM_CLONE) for mark in _marks(node))


def _slices(node: Any) -> set[str]:
    return {mark[CUSTOM_SLICE] for mark in _marks(node) if CUSTOM_SLICE in mark}


def mixes_slices(node1: Any, node2: Any) -> bool:
    """Whether fusing Inductor's scheduler nodes ``node1`` and ``node2`` would put work of different
    slices of a sliced region in one kernel: both hold slice work, and not of the same slices. A node
    lowering already joined (a concatenation of the slices' parts, its producers inlined) fuses only
    with nodes of no slice: fused with one slice's node, it would move that work after every slice."""
    first, second = _slices(node1), _slices(node2)
    return bool(first and second and first != second)


#: Names the fusion rule and the kernel grouping in Inductor's cache keys (through
#: :class:`PhasesArrived`): change it when either changes, or the FX graph cache serves code
#: generated under the old one.
RULE_VERSION = "mutwo-phase-bounded-fusion-4-kernel-per-node-slice-bounded"


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
    """Inductor's choices handler refusing fusions that mix forward and later nodes, or two slices
    of a sliced region, while compiling (use with ``post_grad_custom_post_pass=phases_arrived()``)."""
    from torch._inductor.choices import InductorChoices
    from torch._inductor.virtualized import V

    class PhaseBoundedChoices(InductorChoices):
        @staticmethod
        def can_fuse(scheduler: Any, node1: Any, node2: Any, shared_data_score: int) -> bool:
            # asked before every fusion, vertical or horizontal
            if _forward_and_later(node1, node2) or mixes_slices(node1, node2):
                return False
            return InductorChoices.can_fuse(scheduler, node1, node2, shared_data_score)

        @staticmethod
        def can_fuse_horizontal(scheduler: Any, node1: Any, node2: Any, shared_data_score: int) -> bool:
            if _has_clone(node1) or _has_clone(node2):
                return False
            return InductorChoices.can_fuse_horizontal(scheduler, node1, node2, shared_data_score)

    with V.set_choices_handler(PhaseBoundedChoices()):
        yield


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
