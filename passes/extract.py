"""The ``extract`` pass: the recompute subgraph of every activation a plan recomputes."""

from __future__ import annotations

from dataclasses import dataclass

from mutwo.ir.graph import Graph
from mutwo.ir.node import StorageKey
from mutwo.ir.pass_base import Pass, PassContext, PassFailure
from mutwo.ir.printer import fingerprint
from mutwo.ir.recompute import Block, NotRecomputable, Recompute, replays_from_masks
from mutwo.passes.liveness import liveness_of


@dataclass(frozen=True)
class ExtractPass(Pass):
    """Extract, for each activation the plan recomputes, the forward slice that regenerates it.

    Each block runs from the activation's sources (placeholders, kept activations, nodes that
    cannot be replayed, clones of earlier blocks still live) to it, and is placed right before
    its first backward use. Blocks are planned in backward order, so a block reads a clone made
    by an earlier one when that clone is live; a block the plan shares regenerates the activations
    it names for good (select's ``share``). Under a backend that cannot replay a generator state
    (``replay_random`` service off), dropouts are replayed from their kept masks, as select
    planned them. Writes recompute_blocks.json.
    """

    name = "extract"
    requires = ("plan",)
    provides = ("recompute-blocks",)

    def run(self, graph: Graph, ctx: PassContext) -> list[Block]:
        plan = ctx.artifacts["plan"]
        if plan.fingerprint != fingerprint(graph):
            raise PassFailure("the plan was made for a different graph; run select on this graph again")
        keys = [StorageKey(creator, output) for creator, output in plan.keys()]
        try:
            blocks = Recompute(graph, liveness_of(graph, ctx), mask_replay=replays_from_masks(ctx)).plan(
                keys, shared=plan.shared())
        except NotRecomputable as error:
            raise PassFailure(f"the plan cannot be realised: {error}") from None
        ctx.artifacts["recompute-blocks"] = blocks
        ctx.save_json("recompute_blocks.json", [b.to_json() for b in blocks])
        ctx.log(f"extract: {len(blocks)} blocks, {sum(len(b.nodes) for b in blocks)} nodes to clone")
        return blocks
