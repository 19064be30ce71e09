"""The ``chunk`` transform: run a language-model head and its loss in slices of tokens."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from mutwo.ir.budget import Budget, parse_budget, readable_bytes, sizes
from mutwo.ir.graph import Graph
from mutwo.ir.liveness import Liveness, compute_liveness
from mutwo.ir.memory import allocation_size, simulate
from mutwo.ir.pass_base import Pass, PassContext, PassFailure, option
from mutwo.ir.row_region import find_regions
from mutwo.ir.row_slicing import SlicedRegion, slice_regions
from mutwo.passes.liveness import liveness_of
from mutwo.passes.select import SelectPass, resolve_budget

WHEN = ("budget", "cost", "always")
#: The slice counts tried when ``k`` is not given, fewest first.
SLICE_COUNTS = (2, 4, 8, 16, 32, 64)
#: Doubling the slices stops paying once it lowers the region's floor by less than this share:
#: what is left is what no slicing removes (the weight gradient, the hidden state and its gradient).
MIN_GAIN = 0.01
#: Where slicing can only lower the floor recomputation could reach (at budget min, or under a
#: budget out of reach either way), it trades bitwise sums for memory: it is applied only where it
#: lowers that floor by at least this share.
MIN_FLOOR_GAIN = 0.05
#: With when=cost, under a budget recomputation reaches with the head whole, the head is sliced
#: only where select's plan on the sliced graph is predicted at least this share faster.
MIN_TIME_GAIN = 0.02
#: The slice counts when=cost prices, fewest first (each costs one trial of select).
COST_SLICE_COUNTS = (2, 4, 8, 16)


@dataclass
class Floors:
    """Lower bounds of the peak recomputation could reach, over the region and elsewhere: at each
    node, what is live there minus every activation idle there (select can drop at most those),
    the most over the nodes from the region's first to its last (the nodes between them run
    while its values are live) and over the others."""

    region: int
    rest: int
    peak: int  #: the simulated peak, nothing recomputed

    @property
    def set_by_region(self) -> bool:
        return self.region > self.rest


@dataclass
class ChunkReport:
    """What ``chunk`` did (chunk.json); ``unsliced_peak`` is the simulated peak of the graph it
    was given, which a budget given as a fraction of the unoptimized peak stays a fraction of."""

    applied: bool
    reason: str
    unsliced_peak: int
    peak_after: int | None = None
    floors_before: dict[str, int] = field(default_factory=dict)
    floors_after: dict[str, int] = field(default_factory=dict)
    slices: int | None = None
    regions: list[dict[str, Any]] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    #: with when=cost: select's predicted iteration seconds at the budget, the head whole
    #: ("whole") and in each slice count tried (None where select's plan misses the budget)
    predicted_seconds: dict[str, float | None] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ChunkReport:
        return cls(**data)


def floors(graph: Graph, region_nodes: set[int], liveness: Liveness | None = None,
           workspace: dict[int, int] | None = None) -> Floors:  # fmt: skip
    """:class:`Floors` of ``graph`` for the region of the nodes ``region_nodes``, with the profiled
    ``workspace`` of its nodes (as select simulates it) and its ``liveness`` when already known."""
    liveness = liveness if liveness is not None else compute_liveness(graph)
    simulation = simulate(graph, liveness, workspace)
    curve = torch.tensor(simulation.curve, dtype=torch.int64)
    for record in liveness.activations():
        if record.device == simulation.device:  # the simulation counts only the main device's
            start, end = record.inactive_interval
            curve[start + 1:end] -= allocation_size(record.bytes, simulation.device)
    inside = torch.zeros(len(curve), dtype=torch.bool)
    ranks = [liveness.rank[node_id] for node_id in region_nodes if node_id in liveness.rank]
    if ranks:
        inside[min(ranks):max(ranks) + 1] = True
    region = int(curve[inside].max()) if bool(inside.any()) else 0
    rest = int(curve[~inside].max()) if bool((~inside).any()) else 0
    return Floors(region, rest, simulation.peak_bytes)


@dataclass(frozen=True)
class ChunkPass(Pass):
    """Run each language-model head and its loss in k slices of tokens, forward and backward slice by slice.

    Recomputation cannot lower a peak made of one region's own working set: a language model's
    logits [tokens x vocabulary], their log-softmax and, in the backward, two more tensors of that
    size. This pass finds each matmul whose output, wider than its input, feeds a log-softmax, and
    the nodes reading its wide values forward and backward (views, casts, elementwise ops, the
    nll loss with ignore_index and mean or sum reduction, label smoothing's sums, the matmuls of
    the hidden state's and the weight's gradients, the bias gradient's sum). It replaces them, at
    the end of the forward pass, by k slices of the tokens, each computing its logits, its part of
    the loss and its gradients before the next; the loss and the weight and bias gradients are
    added up slice by slice, the hidden state's gradient is concatenated. The loss's gradient
    seed (``ones_like(loss)``, possibly scaled) must be computable before the slices run; a head
    that cannot be sliced is refused in one sentence naming the node. The sums add floats in
    another order: ``--check`` compares the loss, those gradients and what they update within a
    stated tolerance, everything else bitwise on CPU (docs/chunk.md).
    when=budget slices only where the budget needs it: a budget in bytes or a
    fraction below what recomputation could reach with the head whole (the most that is live at a
    node of the head, less every activation idle there); at budget min, and under a budget out of
    reach sliced or not, where the head sets that floor and slicing lowers it by at least 5%.
    when=cost (the default) slices where when=budget does, and also under a budget recomputation
    reaches with the head whole, where select's plan for the sliced graph (2, 4, 8 or 16 slices, doubled while
    that is 2% faster) is predicted at least 2% faster than its plan with the head whole: the
    memory the slices free is then memory select need not recompute (each plan a trial of select
    with its default options, in bytes). It is the default because that is where slicing pays
    most: BERT-base b64 on the H100 at what per-layer checkpointing held, 591 ms per step sliced
    against 680 ms with the head whole, at the same held memory (docs/benchmarks.md).
    Without a budget on the CPU it does nothing. k, unless given, is the fewest of 2, 4, ..., 64
    slices after which the head no longer sets the floor nor holds more than the budget. It runs
    after profile and the optimizer passes and before select, as in the default pipeline
    (profile,optimizer,chunk,select,rewrite): the slices are priced from the profiled whole ops
    (each its share of the rows), and select plans on the sliced graph, a fraction budget staying
    a fraction of the peak before slicing. Writes chunk.json.
    """

    name = "chunk"
    is_transform = True
    provides = ("chunk",)
    k: int | None = option(None, "slices per head (default: the fewest of 2, 4, ..., 64 after which the head no "
                                 "longer sets the floor recomputation could reach)")
    when: str = option("cost", "'budget': only where the budget needs it (below what recomputation could reach "
                                 "with the head whole); 'cost': also where select's plan is predicted faster sliced; "
                                 "'always' (and a head that cannot be sliced is a failure)")
    budget: str | None = option(None, "0.5, 6GiB or min (default: --budget, else the device's memory)")

    def __post_init__(self) -> None:
        if self.when not in WHEN:
            raise ValueError(f"when must be one of {', '.join(WHEN)}, got {self.when!r}")
        if self.k is not None and self.k < 1:
            raise ValueError("k must be at least 1")
        if self.budget is not None:
            parse_budget(self.budget)

    def replaying(self, report: ChunkReport) -> ChunkPass | None:
        """This pass as a plan-cache hit runs it, from what it decided when the plan was made
        (``report``): the same slices without deciding again (no trials of select, and the same
        count as the kept plan's where calibration re-planned at another budget), or None where it
        left the head whole; itself where a head was refused (deciding again says so again)."""
        if not report.applied:
            return None
        return self if report.refused or report.slices is None else replace(self, k=report.slices, when="always")

    def run(self, graph: Graph, ctx: PassContext) -> ChunkReport:
        _own_profile(ctx, graph)
        regions, refusals = find_regions(graph)
        for refusal in refusals:
            if self.when == "always":
                raise PassFailure(f"chunk: {refusal}", node=refusal.node)
            ctx.log(f"chunk: not sliced: {refusal}")
        # Simulated as select simulates the graph it is given (its cached liveness, the profile's
        # workspaces): a fraction resolves to the same bytes, and a graph left whole costs one simulation.
        workspace = _workspace(ctx, graph)
        before = floors(graph, {n.id for region in regions for n in region.rules}, liveness_of(graph, ctx), workspace)
        report = ChunkReport(False, "", before.peak, refused=[str(r) for r in refusals],
                             floors_before={"region": before.region, "rest": before.rest})  # fmt: skip
        ctx.artifacts["chunk"] = report
        if not regions:
            return self._finish(ctx, report, f"no language-model head that can be sliced ({refusals[0]})" if refusals
                                else "no language-model head whose logits are wider than its input")  # fmt: skip
        budget = self._budget(ctx, before.peak)
        if budget is None:
            return self._finish(ctx, report, "no budget and no device limit (CPU): the head stays whole")
        budget_bytes = budget.resolve(before.peak)
        skip = self._not_needed(budget, budget_bytes, before)
        cheaper: int | None = None
        if skip and self.when == "cost" and not budget.minimum and budget_bytes >= before.region:
            cheaper, why = self._cheaper_sliced(graph, ctx, budget_bytes, report)
            skip = "" if cheaper is not None else f"{skip}; {why}"
        if skip:
            return self._finish(ctx, report, skip)
        slices, trial = ((self.k, None) if self.k is not None else (cheaper, None) if cheaper is not None
                         else self._slice_count(graph, budget, budget_bytes, workspace))  # fmt: skip
        if self.when != "always" and cheaper is None and (budget.minimum or budget_bytes < before.rest):
            # At min, or under a budget no plan reaches sliced or not (below the floor away from the
            # head), slicing only lowers the lowest peak (what select then reaches, or its failure names).
            skip = self._too_little(before, trial or _sliced_floors(graph.copy(), slices, workspace))
            if skip:
                unreachable = "" if budget.minimum else f"{self._out_of_reach(budget_bytes, before)}; "
                return self._finish(ctx, report, unreachable + skip)
        records = slice_regions(graph, slices)
        _price_from_profile(ctx, records)
        after = floors(graph, {node_id for record in records for node_id in record.nodes},
                       workspace=_sliced_workspace(workspace, records))  # fmt: skip
        report.applied, report.slices, report.peak_after = True, slices, after.peak
        report.regions = [record.to_json() for record in records]
        report.floors_after = {"region": after.region, "rest": after.rest}
        return self._finish(ctx, report, self._applied(records, before, after) + self._cost_text(report, slices))

    # -- the decision -----------------------------------------------------------------------
    def _budget(self, ctx: PassContext, peak: int) -> Budget | None:
        """The budget, as select resolves it; None on a CPU with none (nothing needs saving),
        unless the pass must slice anyway (when=always)."""
        if self.budget is None and ctx.services.get("budget") is None and ctx.services.get("device_memory") is None:
            return Budget(minimum=True) if self.when == "always" else None
        budget = resolve_budget(self.budget, ctx, peak, "")
        limit = ctx.services.get("memory_limit")
        if limit is not None and not budget.minimum and budget.resolve(peak) > limit:
            budget = Budget(bytes=int(limit))
        return budget

    def _not_needed(self, budget: Budget, budget_bytes: int, before: Floors) -> str:
        """Why the head can stay whole (empty when it cannot): for a budget in bytes, recomputation
        alone could reach it (no node of the head holds more); where the head does not set the
        floor recomputation could reach, slicing it lowers nothing: at budget min, and for a budget
        below the head's floor, which is then out of reach sliced or not."""
        if self.when == "always":
            return ""
        region, rest = sizes(before.region, before.rest)
        if not budget.minimum and budget_bytes >= before.region:
            return (f"the budget ({readable_bytes(budget_bytes)}) is not below what recomputation could reach with "
                    f"the head whole ({region})")  # fmt: skip
        if before.set_by_region:
            return ""
        if not budget.minimum:  # below the head's floor, and so below the rest's, which is higher
            return self._out_of_reach(budget_bytes, before)
        return (f"the head does not set the lowest peak recomputation could reach ({region} at the head, {rest} "
                "elsewhere)")  # fmt: skip

    @staticmethod
    def _out_of_reach(budget_bytes: int, before: Floors) -> str:
        """Why a budget below what recomputation could reach away from the head is out of reach,
        sliced or not (select's failure then says how far)."""
        return (f"the budget ({readable_bytes(budget_bytes)}) is out of reach, sliced or not: it is below what "
                f"recomputation could reach away from the head ({sizes(before.rest)[0]})")  # fmt: skip

    @staticmethod
    def _too_little(before: Floors, after: Floors) -> str:
        """Why slicing is not worth its rounding where it could only lower the floor (at budget
        min, or under a budget out of reach either way; empty when it is): it lowers the floor
        recomputation could reach by less than :data:`MIN_FLOOR_GAIN`."""
        lowest, sliced = max(before.region, before.rest), max(after.region, after.rest)
        if sliced <= (1 - MIN_FLOOR_GAIN) * lowest:
            return ""
        lowest_text, sliced_text = sizes(lowest, sliced)
        return (f"slicing would lower the lowest peak recomputation could reach only from {lowest_text} to "
                f"{sliced_text}, less than {MIN_FLOOR_GAIN:.0%}: not worth summing the loss in another order")

    def _slice_count(self, graph: Graph, budget: Budget, budget_bytes: int,
                     workspace: dict[int, int]) -> tuple[int, Floors]:  # fmt: skip
        """The fewest slices after which the head's floor is at most the rest's (and, for a
        budget in bytes above that, at most the budget); where no count gets there, the count
        after which doubling lowers it by less than :data:`MIN_GAIN`. Returns it with the
        floors of the graph sliced so (with the whole graph's node ``workspace``)."""
        best: tuple[int, Floors] | None = None
        rows = min(region.rows for region in find_regions(graph)[0])
        for slices in (count for count in SLICE_COUNTS if count <= rows):
            sliced = _sliced_floors(graph.copy(), slices, workspace)
            target = sliced.rest if budget.minimum else max(budget_bytes, sliced.rest)
            if sliced.region <= target:
                return slices, sliced
            if best is not None and sliced.region > (1 - MIN_GAIN) * best[1].region:
                break
            if best is None or sliced.region < best[1].region:
                best = (slices, sliced)
        return best if best is not None else (1, floors(graph, set(), workspace=workspace))

    def _cheaper_sliced(self, graph: Graph, ctx: PassContext, budget_bytes: int,
                        report: ChunkReport) -> tuple[int | None, str]:  # fmt: skip
        """With when=cost: the slice count whose select plan at ``budget_bytes`` is predicted the
        fastest, doubling the count while that is at least :data:`MIN_TIME_GAIN` faster, if at least
        as much faster than the plan with the head whole (else None and why). Each plan is a trial
        of select on a copy of the graph, in a context of its own: no files, no log, a copy of the
        profile (which slicing prices)."""
        profile = ctx.artifacts.get("profile")
        if profile is None:
            return None, "no profile to price select's plans with (when=cost needs one)"
        whole_plan = _trial_plan(graph.copy(), ctx, profile, budget_bytes, None)
        whole = None if whole_plan is None else whole_plan.predicted_seconds
        report.predicted_seconds["whole"] = whole
        if whole_plan is not None and not whole_plan.entries:
            return None, "select's plan with the head whole recomputes nothing"
        best: tuple[int, float] | None = None
        rows = min(region.rows for region in find_regions(graph)[0])
        for slices in (self.k,) if self.k is not None else (c for c in COST_SLICE_COUNTS if c <= rows):
            plan = _trial_plan(graph.copy(), ctx, profile, budget_bytes, slices)
            seconds = None if plan is None else plan.predicted_seconds
            report.predicted_seconds[str(slices)] = seconds
            if seconds is None:
                continue
            if best is not None and seconds > (1 - MIN_TIME_GAIN) * best[1]:
                break  # doubling the slices stopped paying for what the price leaves out
            best = (slices, seconds)
        if best is None:
            return None, "select's plan misses the budget sliced too"
        if whole is not None and best[1] > (1 - MIN_TIME_GAIN) * whole:
            gain = f"less than {MIN_TIME_GAIN:.0%} faster"
            return None, (f"select's plan is predicted {whole * 1e3:.1f} ms with the head whole and "
                          f"{best[1] * 1e3:.1f} ms in {best[0]} slices, {gain}")  # fmt: skip
        return best[0], ""

    @staticmethod
    def _cost_text(report: ChunkReport, slices: int) -> str:
        """For a head sliced because select's plan is faster so: the two predicted times."""
        whole, sliced = report.predicted_seconds.get("whole"), report.predicted_seconds.get(str(slices))
        if sliced is None:
            return ""
        whole_text = "misses the budget" if whole is None else f"{whole * 1e3:.1f} ms"
        return f"; select's plan is predicted {sliced * 1e3:.1f} ms sliced, with the head whole {whole_text}"

    # -- reporting --------------------------------------------------------------------------
    @staticmethod
    def _applied(records: list[SlicedRegion], before: Floors, after: Floors) -> str:
        heads = "; ".join(f"logits %{r.logits} [{r.rows} x {r.width}] in {r.slices} slices of "
                          f"{-(-r.rows // r.slices)} rows, summing {', '.join(r.summed) or 'nothing'}"
                          for r in records)  # fmt: skip
        peak, peak_after, head, head_after, rest = sizes(before.peak, after.peak, before.region, after.region,
                                                         after.rest)  # fmt: skip
        return (f"{heads}: simulated peak {peak} -> {peak_after}; the lowest peak recomputation could reach at the "
                f"head {head} -> {head_after} ({rest} elsewhere)")  # fmt: skip

    @staticmethod
    def _finish(ctx: PassContext, report: ChunkReport, reason: str) -> ChunkReport:
        report.reason = reason
        ctx.log(f"chunk: {'sliced ' if report.applied else 'not applied: '}{reason}")
        ctx.save_json("chunk.json", report.to_json())
        return report


def _own_profile(ctx: PassContext, graph: Graph) -> None:
    """Give the pass a profile of its own, without nodes ``graph`` has not made yet. Calibration
    re-plans copies of one graph with one profile: the nodes an earlier round's slicing priced into
    it took the ids this round's slicing gives other nodes (a sum after the slices, unpriced in a
    first plan, then cost what a slice of the logits' matmul did). Measured on the H100 (GPT-2 small
    b8, 2026-11-27): the kept round's 4 slices were planned again as 8, and the step trained held
    8,468 MiB where the kept round had measured 7,838 MiB."""
    profile = ctx.artifacts.get("profile")
    if profile is not None:
        ctx.artifacts["profile"] = replace(profile, nodes={node_id: measured for node_id, measured
                                                           in profile.nodes.items() if node_id < graph.next_id})


def _price_from_profile(ctx: PassContext, records: list[SlicedRegion]) -> None:
    """Give the added nodes times in the profile, when one was made before the pass: a slice's
    op takes its share of the rows of the whole op's measured time (a moved node, the whole time;
    the sums and concatenations after the slices, none measured), so that select prices the
    iteration and any recomputation through the slices."""
    profile = ctx.artifacts.get("profile")
    if profile is None:
        return
    for record in records:
        for node_id, (source, share) in record.derived.items():
            measured = profile.nodes.get(source)
            if measured is not None:
                profile.nodes[node_id] = replace(measured, seconds=measured.seconds * share,
                                                 replay_seconds=None, allocated_before=None, allocated_after=None,
                                                 peak=None)  # fmt: skip


def _workspace(ctx: PassContext, graph: Graph) -> dict[int, int]:
    """The profiled workspace of ``graph``'s nodes (none without a profile). Only its own nodes:
    a profile priced by an earlier slicing of this graph (a plan cache entry's) holds nodes under
    the ids a trial's slices take, which would make the replayed decision differ from the first."""
    profile = ctx.artifacts.get("profile")
    if profile is None:
        return {}
    return {node_id: bytes_ for node_id, bytes_ in profile.workspace().items() if graph.has_node(node_id)}


def _sliced_workspace(workspace: dict[int, int], records: list[SlicedRegion]) -> dict[int, int]:
    """``workspace`` with each added node given its source's, as :func:`_price_from_profile` prices
    it, so that the floors of a sliced graph are what select then simulates."""
    derived = {node_id: workspace[source] for record in records
               for node_id, (source, _share) in record.derived.items() if source in workspace}  # fmt: skip
    return {**workspace, **derived}


def _sliced_floors(graph: Graph, slices: int, workspace: dict[int, int]) -> Floors:
    """Slice ``graph`` (a copy, for a trial) into ``slices``; the floors of the result."""
    records = slice_regions(graph, slices)
    return floors(graph, {node_id for record in records for node_id in record.nodes},
                  workspace=_sliced_workspace(workspace, records))  # fmt: skip


def _trial_plan(graph: Graph, ctx: PassContext, profile: Any, budget_bytes: int, slices: int | None) -> Any:
    """select's plan for ``graph`` (a copy: sliced into ``slices`` first, unless None) at
    ``budget_bytes``, made in a context of its own (the run's services, a copy of the profile, no
    files, no log); None where it misses the budget."""
    trial = PassContext(device=ctx.device, services=dict(ctx.services), artifacts={"profile": copy.deepcopy(profile)})
    if slices is not None:
        _price_from_profile(trial, slice_regions(graph, slices))
    try:
        plan = SelectPass(budget=f"{budget_bytes}B", lowest=False).run(graph, trial)
    except PassFailure:
        return None
    return plan
