"""What the optimizer-scheduling passes share: trying a new order on a copy and reporting it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from mutwo.ir.budget import BudgetError, sizes
from mutwo.ir.budget import parse_bytes as budget_bytes
from mutwo.ir.classify import classify
from mutwo.ir.graph import Graph
from mutwo.ir.memory import MemorySimulation
from mutwo.ir.node import Phase
from mutwo.ir.optimizer_updates import OptimizerUpdates, Schedule, apply
from mutwo.ir.pass_base import Pass, PassContext
from mutwo.passes.memory import simulate_with_profile

WHEN = ("lower", "always")


@dataclass
class ScheduleOutcome:
    """What an optimizer-scheduling pass did, or why it changed nothing; saved as JSON."""

    applied: bool
    reason: str  #: why it did not apply ('' when it did)
    peak_before: int = 0
    peak_after: int = 0
    details: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"applied": self.applied, "reason": self.reason, "peak_before": self.peak_before,
                "peak_after": self.peak_after, **self.details}  # fmt: skip

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ScheduleOutcome:
        """The outcome :meth:`to_json` wrote (the plan cache keeps it)."""
        fixed = ("applied", "reason", "peak_before", "peak_after")
        return cls(bool(data["applied"]), str(data["reason"]), int(data["peak_before"]), int(data["peak_after"]),
                   {key: value for key, value in data.items() if key not in fixed})  # fmt: skip


def parse_bytes(option: str, text: str) -> int:
    """An option given as bytes with a unit (``64MiB``); a ValueError naming the fix (the registry
    reports it as a usage error when the pipeline is built)."""
    try:
        return budget_bytes(text)
    except BudgetError as error:
        raise ValueError(f"{option}: {error}") from None


def check_when(when: str) -> None:
    """Refuse an unknown ``when`` option."""
    if when not in WHEN:
        raise ValueError(f"when must be one of {', '.join(WHEN)}, not {when!r}")


class Judge(Protocol):
    """What decides whether a new order is kept, from the graph's simulation before and after it."""

    def before(self, graph: Graph, simulation: MemorySimulation) -> None:
        """Note what it needs of the graph as it is (it may change once this returns)."""

    def verdict(self, graph: Graph, simulation: MemorySimulation) -> str:
        """Why not to keep the new order of ``graph`` ('' to keep it)."""


def try_schedule(graph: Graph, ctx: PassContext, updates: OptimizerUpdates, plan: Schedule,
                 finish: Callable[[Graph], None], judge: Judge, *, trial: bool = True,
                 ) -> tuple[MemorySimulation, MemorySimulation, str]:  # fmt: skip
    """Apply ``plan`` (then ``finish``) to a copy and simulate both; the judge says why not to keep
    it ('' to keep it), and only then is the graph changed the same way. Without ``trial`` (an
    order kept whatever it does: ``when=always``) the graph is changed at once, with no copy."""
    before = simulate_with_profile(graph, ctx)
    judge.before(graph, before)
    if not trial:
        _apply(graph, updates, plan, finish)
        after = simulate_with_profile(graph, ctx)
        return before, after, judge.verdict(graph, after)
    copy = graph.copy()
    _apply(copy, updates, plan, finish)
    after = simulate_with_profile(copy, ctx)
    reason = judge.verdict(copy, after)
    if not reason:
        _apply(graph, updates, plan, finish)
    return before, after, reason


def _apply(graph: Graph, updates: OptimizerUpdates, plan: Schedule, finish: Callable[[Graph], None]) -> None:
    apply(graph, updates, plan)
    finish(graph)
    classify(graph)


def optimizer_peak(graph: Graph, simulation: MemorySimulation) -> int:
    """The most memory live while an optimizer node runs."""
    return max((value for node, value in zip(graph, simulation.curve, strict=True) if node.phase is Phase.OPTIMIZER),
               default=0)  # fmt: skip


def change(before: int, after: int) -> str:
    """``1.2 MiB -> 0.9 MiB``: a peak before and after, in one unit that tells them apart."""
    return " -> ".join(sizes(before, after))


def raised_peak(before: MemorySimulation, after: MemorySimulation) -> str:
    """Why a new order is not kept under ``when=lower``: the simulated peak it would raise."""
    return "it would raise the simulated peak from {} to {}".format(*sizes(before.peak_bytes, after.peak_bytes))


class SchedulingPass(Pass):
    """What both optimizer-scheduling passes do around their own ``_run``: keep the outcome as the
    artifact named after the pass, save it as JSON, and log what changed or why nothing did."""

    when: str

    def replaying(self, outcome: ScheduleOutcome) -> SchedulingPass | None:
        """This pass as a plan-cache hit runs it, from its ``outcome`` when the plan was made: none
        where it changed nothing, else the same order applied without a trial (``when=always``:
        the graph is the one it was tried on, so the trial would keep it again)."""
        return dataclasses.replace(self, when="always") if outcome.applied else None

    def run(self, graph: Graph, ctx: PassContext) -> ScheduleOutcome:
        outcome = self._run(graph, ctx)
        ctx.artifacts[self.name] = outcome
        ctx.save_json(f"{self.name.replace('-', '_')}.json", outcome.to_json())
        ctx.log(f"{self.name}: {self._applied(outcome) if outcome.applied else 'does not apply: ' + outcome.reason}")
        return outcome

    def _run(self, graph: Graph, ctx: PassContext) -> ScheduleOutcome:
        raise NotImplementedError

    def _applied(self, outcome: ScheduleOutcome) -> str:
        raise NotImplementedError
