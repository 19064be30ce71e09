"""mutwo's intermediate representation of a whole training iteration, and the tools over it."""

from mutwo.ir.from_fx import LoweringError, from_fx
from mutwo.ir.graph import Graph, GraphError
from mutwo.ir.node import Node, NodeKind, Phase, StorageKey, TensorMeta
from mutwo.ir.to_fx import to_fx

__all__ = [
    "Graph", "GraphError", "LoweringError", "Node", "NodeKind", "Phase", "StorageKey", "TensorMeta",
    "from_fx", "to_fx",
]  # fmt: skip
