"""Lowering the mutwo IR back to an executable ``torch.fx.GraphModule``."""

from __future__ import annotations

import torch
from torch import fx
from torch.fx.node import map_aggregate

from mutwo.ir.fx_modules import graph_module
from mutwo.ir.graph import Graph
from mutwo.ir.node import Node

NODE_ID_META = "mutwo_id"


def to_fx(graph: Graph) -> fx.GraphModule:
    """An fx GraphModule that runs ``graph`` with one positional argument per placeholder.

    fx's code generator drops each local (``x = None``) right after its last use, so the module
    frees every intermediate value as early as the IR's order allows. Every fx node carries
    ``meta["mutwo_id"]``, the stable id of its IR node, for profiling.
    """
    fx_graph = fx.Graph()
    mapping: dict[Node, fx.Node] = {}
    for node in graph:
        # fx's own mapper (in C): pytree's took a third of this function on ResNet-152's graph
        args, kwargs = map_aggregate((node.args, node.kwargs),
                                     lambda leaf: mapping[leaf] if isinstance(leaf, Node) else leaf)
        if node.op == "placeholder":
            fx_node = fx_graph.placeholder(node.name)
        elif node.op == "output":
            fx_node = fx_graph.output(args[0] if args else None)
        else:
            fx_node = fx_graph.call_function(node.target, args, kwargs)
            fx_node.name = node.name  # keep IR names so generated code and dumps agree
        fx_node.meta[NODE_ID_META] = node.id
        mapping[node] = fx_node
    fx_graph.lint()
    # its code is generated when it is first run or read: the compile-time rewrites and AOTAutograd's
    # renaming would each regenerate it, and a cached compile reads it once, for its key (mutwo.ir.fx_modules)
    return graph_module(torch.nn.Module(), fx_graph, class_name="MutwoStep")
