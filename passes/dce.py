"""The ``dce`` transform: remove values nothing uses."""

from __future__ import annotations

from dataclasses import dataclass

from mutwo.ir.classify import classify
from mutwo.ir.graph import Graph
from mutwo.ir.node import Node
from mutwo.ir.pass_base import Pass, PassContext


def is_removable(node: Node) -> bool:
    """An unused computed node with no side effect: it writes nothing in place, draws no random
    numbers (removing a random op would shift every later draw of the generator) and is no
    collective (every rank must run the same collectives)."""
    return (
        node.op == "call_function"
        and not node.users
        and not node.mutated_operands
        and not node.is_random
        and not node.is_collective
        and not _schema_mutates(node)
    )


def _schema_mutates(node: Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return bool(schema is not None and schema.is_mutable)


@dataclass(frozen=True)
class DeadCodeEliminationPass(Pass):
    """Erase computed values that nothing uses and that have no side effect.

    In-place updates (parameters, optimizer state, batch-norm statistics), random ops and
    collectives are kept.
    """

    name = "dce"
    is_transform = True

    def run(self, graph: Graph, ctx: PassContext) -> int:
        erased = 0
        for node in reversed(graph.nodes):  # users come after their operands: one backward sweep
            if is_removable(node):
                graph.erase(node)
                erased += 1
        if erased:
            classify(graph)  # an activation whose backward users were erased is one no longer
        ctx.log(f"dce: erased {erased} unused nodes")
        return erased
