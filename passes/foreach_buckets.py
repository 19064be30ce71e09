"""The ``foreach-buckets`` transform: multi-tensor optimizer updates in buckets of bounded temporaries."""

from __future__ import annotations

from dataclasses import dataclass

from mutwo.ir.budget import readable_bytes
from mutwo.ir.graph import Graph
from mutwo.ir.memory import MemorySimulation
from mutwo.ir.optimizer_updates import Item, OptimizerUpdates, analyse, schedule
from mutwo.ir.pass_base import PassContext, option
from mutwo.passes.optimizer_schedule import (
    ScheduleOutcome,
    SchedulingPass,
    change,
    check_when,
    optimizer_peak,
    parse_bytes,
    raised_peak,
    try_schedule,
)  # fmt: skip


@dataclass(frozen=True)
class ForeachBucketsPass(SchedulingPass):
    """Split multi-tensor (foreach) optimizer updates into buckets whose temporaries stay under max_bytes.

    A multi-tensor update computes each step for every parameter of a bucket before the next step,
    so its temporaries (the weight-decayed gradients, Adam's denominators...) are live for all of
    them at once. This pass cuts each such bucket into consecutive parameters whose temporaries add
    up to at most max_bytes and runs the whole update of one bucket before the next, each
    multi-tensor op split by list position (same kernels, same numbers). Single-tensor updates
    are left alone. With when=lower it applies only where the simulated peak does not grow and
    the optimizer step's own peak drops. Writes foreach_buckets.json.
    """

    name = "foreach-buckets"
    is_transform = True
    provides = ("foreach-buckets",)
    max_bytes: str = option("64MiB", "the most temporary bytes one bucket's update may allocate")
    when: str = option("lower", "'lower': only where the peak does not grow and the optimizer step's drops; 'always'")

    def __post_init__(self) -> None:
        check_when(self.when)
        parse_bytes("max_bytes", self.max_bytes)

    def _applied(self, outcome: ScheduleOutcome) -> str:
        details = outcome.details
        return (f"{details['buckets']} buckets of at most {self.max_bytes} of temporaries; optimizer step's peak "
                f"{change(details['optimizer_peak_before'], details['optimizer_peak_after'])}, simulated peak "
                f"{change(outcome.peak_before, outcome.peak_after)}")  # fmt: skip

    def _run(self, graph: Graph, ctx: PassContext) -> ScheduleOutcome:
        limit = parse_bytes("max_bytes", self.max_bytes)
        updates = analyse(graph)
        if updates.conflicts:
            return ScheduleOutcome(False, f"the iteration reads a value after updating it: {updates.conflicts[0]}")
        buckets = _buckets(updates, limit)
        bucket_of = {p: key for key, members in buckets.items() for p in members}
        if not _splits_an_op(updates, bucket_of):
            return ScheduleOutcome(False, f"no multi-tensor update allocates more than {self.max_bytes} of temporaries")
        anchors: dict[int, int] = {}
        for item in updates.items:
            key = _bucket(updates, bucket_of, item)
            if key is not None:
                anchors[key] = max(anchors.get(key, -1), updates.current_anchor[item])
        plan = schedule(updates, lambda item: _bucket(updates, bucket_of, item), anchors.__getitem__)
        judge = _OptimizerPeakJudge(self.when)
        before, after, reason = try_schedule(graph, ctx, updates, plan, lambda _: None, judge,
                                             trial=self.when != "always")  # fmt: skip
        details = {"buckets": len(buckets), "max_bytes": limit, "optimizer_peak_before": judge.peaks[0],
                   "optimizer_peak_after": judge.peaks[1]}  # fmt: skip
        return ScheduleOutcome(not reason, reason, before.peak_bytes, after.peak_bytes, details)


class _OptimizerPeakJudge:
    """Keeps the new order unless, under ``when=lower``, it raises the simulated peak or leaves the
    optimizer step's own peak where it was; notes that peak before and after (``peaks``)."""

    def __init__(self, when: str) -> None:
        self.when = when
        self.old: MemorySimulation | None = None
        self.peaks = [0, 0]

    def before(self, graph: Graph, simulation: MemorySimulation) -> None:
        self.old, self.peaks[0] = simulation, optimizer_peak(graph, simulation)

    def verdict(self, graph: Graph, simulation: MemorySimulation) -> str:
        assert self.old is not None
        self.peaks[1] = optimizer_peak(graph, simulation)
        if self.when == "lower" and simulation.peak_bytes > self.old.peak_bytes:
            return raised_peak(self.old, simulation)
        if self.when == "lower" and self.peaks[1] >= self.peaks[0]:
            return (f"the optimizer step's peak ({readable_bytes(self.peaks[0])}) would not drop: its "
                    "temporaries are not what is live there")  # fmt: skip
        return ""


def _buckets(updates: OptimizerUpdates, limit: int) -> dict[int, list[str]]:
    """Consecutive parameters updated by the same multi-tensor ops, cut where their temporaries
    would exceed ``limit``; parameters updated by single-tensor ops are in no bucket."""
    signature: dict[str, frozenset[int]] = {}
    temporary: dict[str, int] = {}
    for item in updates.items:
        owner = updates.owner[item]
        if owner is None:
            continue
        temporary[owner] = temporary.get(owner, 0) + updates.temporary_bytes[item]
        if item.position is not None:
            signature[owner] = signature.get(owner, frozenset()) | {item.node}
    buckets: dict[int, list[str]] = {}
    current: list[str] = []
    size = 0
    for name in updates.parameters():
        if name not in signature:
            continue
        if not current or signature[name] != signature[current[-1]] or size + temporary[name] > limit:
            current, size = [], 0
            buckets[len(buckets)] = current
        current.append(name)
        size += temporary[name]
    return buckets


def _splits_an_op(updates: OptimizerUpdates, bucket_of: dict[str, int]) -> bool:
    """Whether some multi-tensor op has positions in several buckets (else nothing would change)."""
    seen: dict[int, set[int | None]] = {}
    for item in updates.items:
        if item.position is not None:
            owner = updates.owner[item]
            seen.setdefault(item.node, set()).add(bucket_of.get(owner) if owner is not None else None)
    return any(len(keys) > 1 for keys in seen.values())


def _bucket(updates: OptimizerUpdates, bucket_of: dict[str, int], item: Item) -> int | None:
    owner = updates.owner[item]
    return bucket_of.get(owner) if owner is not None else None
