"""The ``optimizer-in-backward`` transform: each parameter's update runs as soon as its gradient is final."""

from __future__ import annotations

from dataclasses import dataclass

from mutwo.ir.budget import readable_bytes
from mutwo.ir.graph import Graph
from mutwo.ir.memory import MemorySimulation
from mutwo.ir.node import Node, NodeKind, Phase
from mutwo.ir.optimizer_updates import Item, OptimizerUpdates, analyse, schedule
from mutwo.ir.pass_base import PassContext, option
from mutwo.passes.optimizer_schedule import (
    ScheduleOutcome,
    SchedulingPass,
    change,
    check_when,
    parse_bytes,
    raised_peak,
    try_schedule,
)  # fmt: skip


def returned_gradients(graph: Graph) -> list[Node]:
    """The gradients the graph returns after the loss."""
    returned = graph.output.args[0] if graph.output.args else ()
    return [node for node in returned[1:] if isinstance(node, Node)] if isinstance(returned, (tuple, list)) else []


def drop_gradient_outputs(graph: Graph) -> None:
    """Return the loss only, so each gradient is freed after its last use."""
    returned = graph.output.args[0]
    graph.output.set_operands(((returned[0],),), {})


def gradient_bytes(nodes: list[Node]) -> int:
    """Bytes of the distinct storages of ``nodes``."""
    storages = {t.storage: t.storage_bytes for node in nodes for t in node.tensors if t is not None}
    return sum(storages.values())


@dataclass(frozen=True)
class OptimizerInBackwardPass(SchedulingPass):
    """Run each parameter's optimizer update right after its gradient is final, and free the gradient there.

    Updates are read off the data flow, whatever the optimizer: the optimizer-phase nodes (list
    positions of multi-tensor ops) that touch one parameter's gradient, value or state form its
    update; each runs once everything it depends on has run — its gradient, the last backward read
    of the parameter, the step-count scalars it shares — and multi-tensor updates of parameters
    whose gradients become final one after another are merged up to group_bytes of gradients.
    The graph then returns the loss only (unless keep_grads), so every gradient is freed after its
    update. It does not apply, and says why, when a node combines the gradients of several
    parameters (gradient-norm clipping, a GradScaler inf check), when gradients are kept, or
    (when=lower) when the simulated peak would grow. Writes optimizer_in_backward.json.
    """

    name = "optimizer-in-backward"
    is_transform = True
    provides = ("optimizer-in-backward",)
    keep_grads: bool | None = option(None, "keep returning the gradients (default: as the runtime asks; "
                                           "mutwo.optimize(keep_grads=True) does)")  # fmt: skip
    group_bytes: str = option("32MiB", "merge the multi-tensor updates of consecutive parameters up to this many "
                                       "gradient bytes")  # fmt: skip
    when: str = option("lower", "'lower': only if the simulated peak does not grow; 'always'")

    def __post_init__(self) -> None:
        check_when(self.when)
        parse_bytes("group_bytes", self.group_bytes)

    def _applied(self, outcome: ScheduleOutcome) -> str:
        return (f"{outcome.details['moved_parameters']} parameter updates run in the backward, "
                f"{readable_bytes(outcome.details['freed_gradient_bytes'])} of gradients freed after their update; "
                f"simulated peak {change(outcome.peak_before, outcome.peak_after)}")  # fmt: skip

    def _run(self, graph: Graph, ctx: PassContext) -> ScheduleOutcome:
        limit = parse_bytes("group_bytes", self.group_bytes)
        keep = self.keep_grads if self.keep_grads is not None else bool(ctx.services.get("keep_grads", False))
        updates = analyse(graph)
        returned = returned_gradients(graph)
        why = _not_applicable(updates, keep, returned)
        if why:
            return ScheduleOutcome(False, why)
        anchors = _parameter_anchors(updates)
        # Gradient-norm clipping computed in the backward phase scales every gradient by a factor
        # read from all of them: each update then waits for the backward's last computation.
        last = max((rank for rank, node in enumerate(graph.nodes)
                    if node.phase is Phase.BACKWARD and node.kind is not NodeKind.GRADIENT), default=-1)  # fmt: skip
        if anchors and min(anchors.values()) >= last:
            node = graph.nodes[last]
            return ScheduleOutcome(False, f"no gradient is final before the backward's last computation (%{node.id}, "
                                          f"{node.op_name}), as with gradient-norm clipping or a GradScaler inf "
                                          "check: no update can run earlier")  # fmt: skip
        groups = _merge(updates, anchors, limit)
        group_anchor = {key: max(anchors[p] for p in members) for key, members in groups.items()}
        group_of = {p: key for key, members in groups.items() for p in members}
        plan = schedule(updates, lambda item: _group(updates, group_of, item), group_anchor.__getitem__)
        if not plan.moved:
            return ScheduleOutcome(False, "every update already runs right after the gradients it needs")

        before, after, reason = try_schedule(graph, ctx, updates, plan, drop_gradient_outputs, _PeakJudge(self.when),
                                             trial=self.when != "always")  # fmt: skip
        details = {"moved_parameters": len(anchors), "groups": len(groups), "moved_items": plan.moved,
                   "freed_gradient_bytes": gradient_bytes(returned)}  # fmt: skip
        return ScheduleOutcome(not reason, reason, before.peak_bytes, after.peak_bytes, details)


class _PeakJudge:
    """Keeps the new order unless, under ``when=lower``, it raises the simulated peak."""

    def __init__(self, when: str) -> None:
        self.when = when
        self.old: MemorySimulation | None = None

    def before(self, graph: Graph, simulation: MemorySimulation) -> None:
        self.old = simulation

    def verdict(self, graph: Graph, simulation: MemorySimulation) -> str:
        assert self.old is not None
        if self.when == "lower" and simulation.peak_bytes > self.old.peak_bytes:
            return (f"{raised_peak(self.old, simulation)} (at %{simulation.peak_node}, {simulation.peak_phase}); "
                    "when=always applies it anyway")  # fmt: skip
        return ""


def _not_applicable(updates: OptimizerUpdates, keep: bool, returned: list[Node]) -> str:
    if updates.conflicts:
        return f"the iteration reads a value after updating it: {updates.conflicts[0]}"
    mixing = updates.mixing()
    if mixing:
        item, grads = mixing[0]
        names = sorted(grads)
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        return (f"%{item.node} combines the gradients of {len(names)} parameters ({shown}), as gradient-norm "
                "clipping or a GradScaler inf check do: every update waits for the whole backward")
    if keep:
        return "the gradients are kept (keep_grads): moving the updates would free none of them"
    if not returned or not updates.parameters():
        return "the graph returns no gradient that an update reads"
    return ""


def _parameter_anchors(updates: OptimizerUpdates) -> dict[str, int]:
    """For each parameter, the rank after which all of its update can run."""
    anchors: dict[str, int] = {}
    for item in updates.items:
        owner = updates.owner[item]
        if owner is not None:
            anchors[owner] = max(anchors.get(owner, -1), updates.ready[item])
    return anchors


def _merge(updates: OptimizerUpdates, anchors: dict[str, int], limit: int) -> dict[int, list[str]]:
    """Groups of parameters updated together: consecutive (by anchor) parameters that share their
    multi-tensor ops, up to ``limit`` gradient bytes; single-tensor updates stay one parameter each."""
    first: dict[str, int] = {}
    signature: dict[str, set[int]] = {}
    for index, item in enumerate(updates.items):
        owner = updates.owner[item]
        if owner is not None:
            first.setdefault(owner, index)
            if item.position is not None:
                signature.setdefault(owner, set()).add(item.node)
    groups: dict[int, list[str]] = {}
    current: list[str] = []
    size = 0
    for name in sorted(anchors, key=lambda p: (anchors[p], first[p])):
        grad = gradient_bytes([updates.gradients[name]])
        joins = (current and signature.get(name) and signature.get(name) == signature.get(current[-1])
                 and size + grad <= limit)  # fmt: skip
        if not joins:
            current, size = [], 0
            groups[len(groups)] = current
        current.append(name)
        size += grad
    return groups


def _group(updates: OptimizerUpdates, group_of: dict[str, int], item: Item) -> int | None:
    owner = updates.owner[item]
    return group_of.get(owner) if owner is not None else None
