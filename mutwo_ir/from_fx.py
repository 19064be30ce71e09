"""Lowering a captured fx graph into the mutwo IR: classify every node and record its memory."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import fx
from torch.fx.node import map_aggregate

from mutwo.ir.classify import classify
from mutwo.ir.graph import Graph
from mutwo.ir.node import Node, NodeKind, Phase, StorageKey, TensorMeta, is_wait

PHASE_META = "mutwo_phase"


class LoweringError(ValueError):
    """The fx graph lacks what the IR needs (phases, tensor metadata, a known node kind)."""


def from_fx(
    graph_module: fx.GraphModule,
    slots: Sequence[tuple[NodeKind, str]],
    gradient_labels: Sequence[str],
) -> Graph:
    """Build the IR of a captured iteration.

    ``slots`` gives (kind, label) for each placeholder in order; the output must be
    ``(loss, *gradients)`` with ``gradient_labels`` naming the parameter of each gradient. Each fx
    node must carry ``meta["val"]`` (fake tensors from make_fx) and ``meta["mutwo_phase"]``.
    Storage identity comes from the fake tensors themselves, so views, ``getitem`` of tuples,
    ``alias`` and in-place results are recognised as aliases whatever op produced them.
    """
    graph = Graph()
    fx_nodes = list(graph_module.graph.nodes)
    placeholders = [n for n in fx_nodes if n.op == "placeholder"]
    if len(placeholders) != len(slots):
        raise LoweringError(f"the graph has {len(placeholders)} placeholders but {len(slots)} slots were given")
    slot_of = dict(zip(placeholders, slots, strict=True))
    storages: dict[int, tuple[StorageKey, int]] = {}  # fake storage address -> (key, bytes)
    mapping: dict[fx.Node, Node] = {}

    for fx_node in fx_nodes:
        if fx_node.op not in ("placeholder", "call_function", "output"):
            raise LoweringError(f"fx node {fx_node.name} has op {fx_node.op!r}; only placeholder, "
                                "call_function and output are supported")  # fmt: skip
        phase = fx_node.meta.get(PHASE_META, Phase.FORWARD if fx_node.op in ("placeholder", "output") else None)
        if phase is None:
            raise LoweringError(f"fx node {fx_node.name} has no phase; capture it with runtime.capture")
        node_id = len(mapping)
        value = fx_node.meta.get("val")
        if fx_node.op == "call_function" and is_wait(fx_node.target):
            value = _waited(value, fx_node.args[0].meta.get("val"), storages)
        tensors, is_tuple = _tensor_metas(value, node_id, storages)
        kind, label = slot_of.get(fx_node, (NodeKind.OTHER, ""))
        args, kwargs = map_aggregate((fx_node.args, fx_node.kwargs),
                                     lambda leaf: mapping[leaf] if isinstance(leaf, fx.Node) else leaf)
        if fx_node.op == "output":
            phase = Phase.OPTIMIZER
        mapping[fx_node] = graph.create_node(
            fx_node.op, fx_node.target if fx_node.op == "call_function" else fx_node.name, args, kwargs,
            name=fx_node.name, kind=kind, phase=Phase(phase), tensors=tensors, is_tuple=is_tuple, label=label,
        )  # fmt: skip

    _classify(graph, gradient_labels)
    return graph


def _waited(value: Any, operand: Any, storages: dict[int, tuple[StorageKey, int]]) -> Any:
    """A collective's wait returns its operand itself at run time, but its fake kernel returns a
    new tensor: make that tensor's storage (and so every view later taken of it) the operand's,
    or the buffer would be counted twice."""
    if isinstance(value, torch.Tensor) and isinstance(operand, torch.Tensor):
        known = storages.get(operand.untyped_storage()._cdata)
        if known is not None:
            storages[value.untyped_storage()._cdata] = known
    return operand


def _tensor_metas(value: Any, node_id: int, storages: dict[int, tuple[StorageKey, int]]) -> tuple[
        tuple[TensorMeta | None, ...], bool]:  # fmt: skip
    """TensorMetas of a node's value; storages first seen here are created by ``node_id``."""
    if isinstance(value, torch.Tensor):
        return (_meta(value, node_id, 0, storages),), False
    if isinstance(value, (tuple, list)):
        metas = tuple(
            _meta(v, node_id, i, storages) if isinstance(v, torch.Tensor) else None for i, v in enumerate(value)
        )
        return metas, True
    return (), False


def _meta(tensor: torch.Tensor, node_id: int, output: int, storages: dict[int, tuple[StorageKey, int]]) -> TensorMeta:
    storage = tensor.untyped_storage()
    address = storage._cdata
    if address not in storages:
        storages[address] = (StorageKey(node_id, output), storage.nbytes())
    key, nbytes = storages[address]
    return TensorMeta(tuple(int(s) for s in tensor.shape), tensor.dtype, str(tensor.device), key, nbytes)


def _classify(graph: Graph, gradient_labels: Sequence[str]) -> None:
    """Mark the returned gradients, then classify every computed node."""
    output = graph.output
    returned = output.args[0] if output.args else ()
    if not isinstance(returned, (tuple, list)) or len(returned) != len(gradient_labels) + 1:
        raise LoweringError("the output must be (loss, *gradients) with one gradient per gradient label")
    for grad, label in zip(returned[1:], gradient_labels, strict=True):
        if isinstance(grad, Node):
            grad.kind = NodeKind.GRADIENT
            grad.label = label
    classify(graph)

