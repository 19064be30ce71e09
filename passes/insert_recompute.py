"""The ``insert-recompute`` transform: put the recompute blocks into the backward pass."""

from __future__ import annotations

from dataclasses import dataclass

from mutwo.ir.budget import counted
from mutwo.ir.graph import Graph
from mutwo.ir.pass_base import Pass, PassContext
from mutwo.ir.recompute import insert_blocks


@dataclass(frozen=True)
class InsertRecomputePass(Pass):
    """Insert each extracted block before its first backward use and redirect backward readers.

    Clones carry ``origin`` (the text IR shows ``clone-of(%id)``, dot dumps draw them red); the
    forward originals lose their backward readers, so the generated code frees them after their
    last forward use. In-place ops are cloned out of place (or onto the block's own clone of
    their operand), training batch norms are replayed from their saved mean and inverse std, and
    random ops with the generator state they consumed, which a node right before the original
    copies; the generator ends where the original iteration leaves it.
    """

    name = "insert-recompute"
    requires = ("recompute-blocks",)
    provides = ("recomputed",)
    is_transform = True

    def run(self, graph: Graph, ctx: PassContext) -> dict[int, list[int]]:
        blocks = ctx.artifacts["recompute-blocks"]
        clones = insert_blocks(graph, blocks)
        ctx.artifacts["recomputed"] = clones
        ctx.save_json("clones.json", {str(k): v for k, v in sorted(clones.items())})
        ctx.log(f"insert-recompute: {counted(sum(len(c) for c in clones.values()), 'clone')} of "
                f"{counted(len(clones), 'forward node')}")
        return clones
