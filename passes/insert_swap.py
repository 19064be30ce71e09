"""The ``insert-swap`` transform: realise a ``select-swap`` plan in the graph."""

from __future__ import annotations

from dataclasses import dataclass

from mutwo.ir.budget import counted
from mutwo.ir.graph import Graph
from mutwo.ir.node import StorageKey
from mutwo.ir.pass_base import Pass, PassContext, PassFailure
from mutwo.ir.printer import fingerprint
from mutwo.ir.recompute import NotRecomputable, replays_from_masks
from mutwo.ir.swap import SWAP_RELEASES, NotSwappable, Placement, SwapAnalysis, SwapRewrite, rewrite
from mutwo.passes.liveness import liveness_of
from mutwo.passes.mu_two_swap import RECOMPUTE, SWAP


@dataclass(frozen=True)
class InsertSwapPass(Pass):
    """Insert the plan's swaps (offload, prefetch, wait) and recompute blocks into the graph.

    Each swapped activation is offloaded to host memory right after its last forward use, its
    prefetch is issued before the node the plan chose and its wait sits right before its first
    backward use, whose readers (and their views) then read the swapped-in copy; recompute blocks
    go right before their first backward use as in insert-recompute, reading swapped-in copies
    that are live there. The plan's release points (where a step recorded as a CUDA graph frees
    each offloaded tensor, its copy out ended) go into the graph's metadata. Writes swaps.json and
    clones.json.
    """

    name = "insert-swap"
    requires = ("swap-plan",)
    provides = ("swapped",)
    is_transform = True

    def run(self, graph: Graph, ctx: PassContext) -> SwapRewrite:
        plan = ctx.artifacts["swap-plan"]
        if plan.fingerprint != fingerprint(graph):
            raise PassFailure("the swap plan was made for a different graph; run select-swap on this graph again")
        liveness = liveness_of(graph, ctx)
        analysis = SwapAnalysis(graph, liveness)
        try:
            placements = [Placement(analysis.site(StorageKey(e["storage_creator"], e["storage_output"])),
                                    e["prefetch_before"]) for e in plan.of(SWAP)]  # fmt: skip
            result = rewrite(graph, liveness, placements,
                             [StorageKey(e["storage_creator"], e["storage_output"]) for e in plan.of(RECOMPUTE)],
                             mask_replay=replays_from_masks(ctx))  # fmt: skip
        except (NotSwappable, NotRecomputable) as error:
            raise PassFailure(f"the swap plan cannot be realised: {error}") from None
        # Where a step recorded as a CUDA graph frees each offloaded tensor (mutwo.runtime.execution.swap_graphs);
        # keyed by the offloads' tags, the ids of the tensors they copy.
        graph.meta[SWAP_RELEASES] = {placement.site.base: entry["release_before"]
                                     for placement, entry in zip(placements, plan.of(SWAP), strict=True)
                                     if "release_before" in entry}  # fmt: skip
        ctx.artifacts["swapped"] = result
        ctx.save_json("swaps.json", result.swaps)
        ctx.save_json("clones.json", {str(k): v for k, v in sorted(result.clones.items())})
        ctx.log(f"insert-swap: {counted(len(result.swaps), 'swap')}, "
                f"{counted(sum(len(c) for c in result.clones.values()), 'recompute clone')} of "
                f"{counted(len(result.clones), 'forward node')}")  # fmt: skip
        return result
