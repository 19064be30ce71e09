"""The ``share-gathers`` transform: one all-gather per ``fully_shard`` group in the backward.

A ``fully_shard`` step gathers a group's shards again before the backward's first read of its
weights (``reshard_after_forward=True``, :mod:`mutwo.runtime.capture.gather_schedule`), and
``insert-recompute`` may replay the forward's gather of the same group for each recompute block
that reads those weights (:func:`mutwo.ir.recompute.regathers_shards`). Each is the same
collective on the same shards, so the backward can gather the group once: this pass keeps the
group's first backward gather and has every later one's readers read it, then erases the later
gathers (their waits, and what only fed them). Measured on two H200s, the 0.5B Llama's plan at
per-layer checkpointing's held memory held 96 all-gathers where the unplanned step had 33
(docs/benchmarks.md, "Data parallel and FSDP2 on two GPUs").

The kept gather's value then lives until the last of the merged ones' readers: one group's
gathered weights held longer. The pass simulates the graph with the merges and applies them when
its peak stays within the plan's budget (or does not rise); otherwise it takes them one by one,
each that keeps the peak there, and says how many it left. Two gathers are merged only when no
node between them writes the shards (an update scheduled into the backward,
``optimizer-in-backward``, would make them differ). Every rank runs the same graph, so every rank
drops the same collectives.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from torch.utils import _pytree as pytree

from mutwo.ir.budget import counted
from mutwo.ir.classify import classify
from mutwo.ir.graph import Graph
from mutwo.ir.liveness import Liveness, compute_liveness
from mutwo.ir.memory import simulate
from mutwo.ir.node import Node, Phase, StorageKey
from mutwo.ir.pass_base import Pass, PassContext
from mutwo.ir.recompute import ALL_GATHER, _mutation_positions, follow_storage, regathers_shards, upstream
from mutwo.passes.dce import is_removable


@dataclass(frozen=True)
class Merge:
    """A later gather (``dropped``, with its wait ``dropped_wait``) whose readers read the first
    gather's wait (``kept_wait``) instead."""

    kept_wait: int
    dropped: int
    dropped_wait: int


def value_key(node: Node, memo: dict[int, Hashable]) -> Hashable:
    """What ``node`` computes, as a key equal for two nodes that compute the same value from the
    same placeholders by the same ops and arguments (a replayed chain and its original)."""
    if node.id in memo:
        return memo[node.id]
    if node.op == "placeholder":
        key: Hashable = ("placeholder", node.id)
    else:
        leaves = tuple(value_key(leaf, memo) if isinstance(leaf, Node) else repr(leaf)
                       for leaf in pytree.tree_leaves((node.args, node.kwargs)))  # fmt: skip
        key = (str(node.target), leaves)
    memo[node.id] = key
    return key


def _shard_storages(gather: Node) -> list[StorageKey]:
    """The storages of the placeholders ``gather`` is computed from: its group's shards."""
    return [t.storage for n in upstream(gather) if n.op == "placeholder" for t in n.tensors if t is not None]


def _writes_to(storages: list[StorageKey], writes: dict[StorageKey, list[int]]) -> list[int]:
    """The positions of every in-place write to ``storages``."""
    return [w for storage in storages for w in writes.get(storage, ())]


def _wait_of(gather: Node) -> Node | None:
    waits = [user for user in gather.users if user.is_wait]
    return waits[0] if len(waits) == 1 and len(gather.users) == 1 else None


def planned_merges(graph: Graph, liveness: Liveness) -> list[Merge]:
    """The merges of every backward all-gather into the first backward one of the same group,
    where nothing between them writes the group's shards (in place, through any view: the
    storages' writes, as recomputation checks them)."""
    keys: dict[int, Hashable] = {}
    writes = _mutation_positions(graph, liveness)
    rank = liveness.rank
    #: per group: the wait of its first backward gather (since its shards were last written), and
    #: that gather's position
    first: dict[Hashable, tuple[Node, int]] = {}
    merges: list[Merge] = []
    for node in graph.nodes:
        if node.op_name != ALL_GATHER or node.phase is not Phase.BACKWARD or not regathers_shards(node):
            continue
        wait = _wait_of(node)
        if wait is None:
            continue
        key, position = value_key(node, keys), rank[node.id]
        kept = first.get(key)
        # The kept gather must be waited for before this one is issued (so before any of its
        # readers), and its shards unwritten since; else this gather becomes the group's first.
        if kept is None or rank[kept[0].id] > position or \
                any(kept[1] < w < position for w in _writes_to(_shard_storages(node), writes)):  # fmt: skip
            first[key] = (wait, position)
            continue
        merges.append(Merge(kept[0].id, node.id, wait.id))
    return merges


def apply_merges(graph: Graph, merges: list[Merge]) -> int:
    """Make each dropped gather's readers read the kept one's wait, erase the dropped gathers and
    their waits, then what fed only them; returns how many nodes were erased."""
    erased = 0
    for merge in merges:
        kept, dropped, wait = graph.node(merge.kept_wait), graph.node(merge.dropped), graph.node(merge.dropped_wait)
        follow_storage(wait, kept, list(wait.users))  # the readers' views now view the kept gather's storage
        graph.replace_uses_after(wait, kept, wait)
        feeding: list[Node] = list(dropped.operands)
        graph.erase(wait)
        graph.erase(dropped)
        erased += 2
        while feeding:
            node = feeding.pop()
            if node.graph is graph and is_removable(node):
                feeding.extend(node.operands)
                graph.erase(node)
                erased += 1
    return erased


@dataclass(frozen=True)
class ShareGathersPass(Pass):
    """Gather each ``fully_shard`` group once in the backward: later all-gathers of the same
    shards (FSDP2's re-gather, and those recompute blocks replay) read the first one instead,
    where the simulated peak stays within the budget. Nothing changes in a graph without them."""

    name = "share-gathers"
    provides = ("shared-gathers",)
    is_transform = True

    def run(self, graph: Graph, ctx: PassContext) -> dict[str, Any]:
        liveness = compute_liveness(graph)
        merges = planned_merges(graph, liveness)
        outcome: dict[str, Any] = {"merged": 0, "erased": 0, "planned": len(merges)}
        if merges:
            profile = ctx.artifacts.get("profile")
            workspace = _workspace(graph, profile.workspace() if profile is not None else {})
            before = simulate(graph, liveness, workspace).peak_bytes
            plan = ctx.artifacts.get("plan")
            ceiling = max(before, plan.budget_bytes if plan is not None and plan.budget_bytes > 0 else 0)
            kept = _within(graph, merges, ceiling, workspace)
            outcome["erased"] = apply_merges(graph, kept)
            outcome.update(merged=len(kept), peak_before=before, ceiling=ceiling,
                           peak_after=simulate(graph, workspace=workspace).peak_bytes)  # fmt: skip
            if kept:
                classify(graph)
                _forget_erased_clones(graph, ctx)
        ctx.artifacts["shared-gathers"] = outcome
        if merges:
            ctx.save_json("shared_gathers.json", outcome)
            left = outcome["planned"] - outcome["merged"]
            ctx.log(f"share-gathers: {counted(outcome['merged'], 'all-gather')} read an earlier gather of the same "
                    f"shards instead" + (f"; {left} kept, sharing them would raise the simulated peak over "
                                         f"{ceiling:,} bytes" if left else "")
                    + f"; simulated peak {outcome['peak_before']:,} -> {outcome['peak_after']:,} bytes")
        return outcome


def _forget_erased_clones(graph: Graph, ctx: PassContext) -> None:
    """Drop the gathers a merge erased from the recompute clones insert-recompute (its
    ``recomputed`` artifact) or insert-swap (its ``swapped`` result's) listed by id, and write
    clones.json again."""
    swapped = ctx.artifacts.get("swapped")
    clones = ctx.artifacts.get("recomputed", swapped.clones if swapped is not None else None)
    if clones is None:
        return
    left = {origin: [i for i in ids if graph.has_node(i)] for origin, ids in clones.items()}
    left = {origin: ids for origin, ids in left.items() if ids}
    if left != clones:
        clones.clear()
        clones.update(left)  # in place: the artifact (or the swap result) holding it sees it
        ctx.save_json("clones.json", {str(k): v for k, v in sorted(left.items())})


def _workspace(graph: Graph, profiled: dict[int, int]) -> dict[int, int]:
    """Each node's profiled workspace, a recompute clone's its original's, as ``select`` prices the
    peak it plans (:func:`mutwo.passes.select.plan_peak`)."""
    return {n.id: profiled[origin] for n in graph
            if (origin := n.origin if n.origin is not None else n.id) in profiled}  # fmt: skip


def _within(graph: Graph, merges: list[Merge], ceiling: int, workspace: dict[int, int]) -> list[Merge]:
    """The merges to apply: all of them when the graph with them simulates at most ``ceiling``
    bytes, else, one by one in order, each that keeps it there with those taken before it (a
    trial graph is copied again only after a merge it must undo)."""
    trial = graph.copy()
    apply_merges(trial, merges)
    if simulate(trial, workspace=workspace).peak_bytes <= ceiling:
        return merges
    taken: list[Merge] = []
    trial = graph.copy()
    for merge in merges:
        apply_merges(trial, [merge])
        if simulate(trial, workspace=workspace).peak_bytes <= ceiling:
            taken.append(merge)
        else:
            trial = graph.copy()
            apply_merges(trial, taken)
    return taken
