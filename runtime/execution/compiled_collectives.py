"""The collectives of a data-parallel step (:mod:`mutwo.runtime.capture.collectives`) made
compilable by Inductor, in the order the plan put them.

The captured graph issues its collectives in place: ``all_reduce_`` of each gradient bucket in the
backward, ``broadcast_`` of the buffers before the forward, each returning its buffer for the
``wait_tensor`` that ends it. AOTAutograd, which Inductor's ``compile_fx`` runs first, functionalizes
the graph and refuses a custom op whose output aliases an input (``_c10d_functional::all_reduce_(
Tensor(a!) input, ...) -> Tensor(a!)``: "Found a custom (non-ATen) operator whose output has alias
annotations"). :func:`functional_collectives` rewrites each into its out-of-place form
(``all_reduce``, ``broadcast``), the form ``torch.compile`` hands Inductor: Inductor lowers it to
its in-place kernel on a copy of the buffer, and its ``reinplace`` pass drops the copy when nothing
reads the buffer after it (an all-reduced bucket: the collective is its last reader). The rewrite is
exact only when nothing reads the buffer after the collective by its old name, which would see the
communicated values in eager and the old ones once functional; the graphs mutwo captures read a
buffer after its collective only through the ``wait_tensor``, and one that does not is refused.

Every rank must issue the same collectives in the same order, and the plan (which the memory
simulator priced) puts each issue in the backward where its bucket fills and the waits at the
backward's end, as under eager. Inductor keeps the collectives in the graph's order
(``comms.decide_global_ordering_of_comms`` chains each to the one before); :data:`ORDER_KEPT` keeps
its passes that would merge buckets or reorder compute around the collectives off while such a step
compiles, and loop reordering after fusion, which failed compiling one such step (see its comment).
One pass stays on: ``simple_overlap`` (``aten_distributed_optimizations``, on by default in torch
2.14) moves an issue earlier or a wait later by adjacent swaps, never one collective past another
and never raising its own estimate of the peak. It only lengthens the overlap: on the
CPU the wait of a bucket then sits right before the first kernel reading it (an optimizer update),
and compute keeps the plan's order.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from mutwo.ir.graph import Graph
from mutwo.ir.node import Node, StorageKey
from mutwo.runtime.execution.errors import BackendError

_C10D = torch.ops._c10d_functional

#: In-place functional collectives -> their out-of-place forms (the same arguments).
OUT_OF_PLACE: dict[Any, Any] = {
    _C10D.all_reduce_.default: _C10D.all_reduce.default,
    _C10D.broadcast_.default: _C10D.broadcast.default,
}

#: Inductor passes kept off for a step with collectives (all off by default; pinned so that a
#: user's global Inductor config cannot turn them on under the plan).
ORDER_KEPT: dict[str, Any] = {
    "reorder_for_compute_comm_overlap": False,  # moves compute across collectives, by estimated runtimes
    "_fuse_ddp_communication": False,  # merges all-reduces into larger buckets than DDP's
    "bucket_all_reduces_fx": "none",  # the same, as an FX pass
    "aten_distributed_optimizations.enable_overlap_scheduling": False,  # reorders compute around collectives
    # Not about order: with loop reordering after fusion on, torch 2.11's Inductor failed a bare
    # assertion in ``reorder_loops_by_dep_pair`` (scheduler.py:1950) compiling ResNet-152-cl's
    # data-parallel step for two H200s, and compiled it with the option off, the step then running
    # 70.3 ms at half of eager DDP's held memory (2026-11-28, bench/results/session26_gpus/).
    # One-GPU steps compile with it on; on the CPU (torch 2.14) a ResNet-18 data-parallel step
    # compiles either way, so no CPU test can show the failure.
    "loop_ordering_after_fusion": False,
}


def order_kept_options() -> dict[str, Any]:
    """:data:`ORDER_KEPT` as this torch knows it: an older one lacks the newer passes, and with them
    the need to turn them off (``config.patch`` refuses a name it does not know)."""
    from torch._inductor import config

    known = config.get_config_copy()
    return {name: value for name, value in ORDER_KEPT.items() if name in known}


def has_collectives(graph: Graph) -> bool:
    """Whether ``graph`` communicates (a data-parallel step)."""
    return any(node.is_collective for node in graph)


def functional_collectives(module: fx.GraphModule, graph: Graph) -> None:
    """Rewrite each in-place functional collective of ``module`` (made from ``graph`` by ``to_fx``)
    into its out-of-place form (see the module docstring); :class:`BackendError` where the graph reads
    a communicated buffer after its collective other than through its ``wait_tensor``."""
    _refuse_stale_reads(graph)
    for node in list(module.graph.nodes):
        functional = OUT_OF_PLACE.get(node.target)
        if functional is None:
            continue
        with module.graph.inserting_before(node):
            replacement = module.graph.call_function(functional, node.args, node.kwargs)
        replacement.meta = dict(node.meta)
        node.replace_all_uses_with(replacement)
        module.graph.erase_node(node)
    module.recompile()


def _refuse_stale_reads(graph: Graph) -> None:
    """Refuse a node that reads a communicated buffer through a node from before its collective
    (the old name, which the out-of-place form leaves holding the values sent, not those received)."""
    issued: dict[StorageKey, tuple[int, Node]] = {}  # storage -> its latest collective, and where it is
    for position, node in enumerate(graph):
        if node.is_wait:
            continue
        for operand in node.operands:
            for meta in operand.tensors:
                collective = issued.get(meta.storage) if meta is not None else None
                if collective is not None and graph.position(operand) < collective[0]:
                    raise BackendError(f"Inductor cannot compile {node!r}: it reads the buffer {collective[1]!r} "
                                       f"communicates through {operand!r}, from before the collective, not through "
                                       "its wait_tensor; use backend='eager'")  # fmt: skip
        if node.is_collective:
            issued.update((meta.storage, (position, node)) for meta in node.tensors if meta is not None)
