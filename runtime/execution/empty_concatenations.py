"""Concatenations of one tensor with empty ones keep eager's layout under Inductor.

A transformers model with a key-value cache (GPT-2 in transformers 5) concatenates each layer's
keys and values onto the cache's empty tensors: ``aten.cat([empty, keys], -2)``. Eager's ``cat``
returns a contiguous tensor. Inductor's decomposition of ``cat`` drops the empty inputs and, with
one tensor left, returns ``keys.clone()``, which keeps the layout of ``keys`` (a transposed slice
of the fused QKV projection): the captured graph's ``aten.view`` of that result, valid on eager's
contiguous tensor, then fails while Inductor traces it ("Cannot view a tensor with shape ...").
GPT-2 under ``backend="inductor"`` on a CPU could not compile at all.

:func:`single_tensor_concatenations` rewrites each such ``cat`` into what eager computes, a
contiguous copy of the one non-empty input, before the graph goes to Inductor. Eager's ``cat``
is contiguous unless every input suggests another memory format (channels-last), which a
concatenation onto an empty cache does not; the values are the same either way.
"""

from __future__ import annotations

import torch
from torch import fx

from mutwo.ir.graph import Graph
from mutwo.ir.to_fx import NODE_ID_META

aten = torch.ops.aten


def single_tensor_concatenations(module: fx.GraphModule, graph: Graph) -> int:
    """Rewrite every ``aten.cat`` of ``module`` whose inputs are all empty but one into a contiguous
    ``aten.clone`` of that one (``graph``: the IR ``module`` was lowered from, for the inputs'
    shapes); how many were rewritten."""
    rewritten = 0
    for node in list(module.graph.nodes):
        if node.target is not aten.cat.default:
            continue
        tensors, dim = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        shapes = [_shape(tensor, graph) for tensor in tensors]
        if any(shape is None for shape in shapes):
            continue  # an input whose shape the IR does not know: left as it is
        kept = [tensor for tensor, shape in zip(tensors, shapes, strict=True) if not _dropped(shape, dim)]
        if len(kept) != 1 or len(tensors) == 1:
            continue
        with module.graph.inserting_before(node):
            copy = module.graph.call_function(aten.clone.default, (kept[0],),
                                              {"memory_format": torch.contiguous_format})  # fmt: skip
        copy.meta = dict(node.meta)
        node.replace_all_uses_with(copy)
        module.graph.erase_node(node)
        rewritten += 1
    if rewritten:
        module.recompile()
    return rewritten


def _shape(value: object, graph: Graph) -> tuple[int, ...] | None:
    """The shape of the tensor an fx argument stands for, from its IR node; None if unknown."""
    if not isinstance(value, fx.Node) or NODE_ID_META not in value.meta:
        return None
    tensors = graph.node(value.meta[NODE_ID_META]).tensors
    if len(tensors) != 1 or tensors[0] is None:
        return None
    return tuple(tensors[0].shape)


def _dropped(shape: tuple[int, ...], dim: int) -> bool:
    """Whether Inductor's ``cat`` decomposition drops an input of ``shape`` (its rule: a legacy
    empty 1-D tensor, or one of size 0 along the concatenated dimension)."""
    if len(shape) == 1 and shape[0] == 0:
        return True
    axis = dim + len(shape) if dim < 0 else dim
    return 0 <= axis < len(shape) and shape[axis] == 0
