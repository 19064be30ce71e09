"""The ``select`` pass: choose which activations to recompute (μ-TWO), as a plan."""

from __future__ import annotations

import copy
import csv
import io
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from mutwo.ir.budget import Budget, parse_budget
from mutwo.ir.graph import Graph
from mutwo.ir.liveness import Liveness, elapsed_seconds, idle_seconds
from mutwo.ir.memory import MemorySimulation, allocation_size, describe_breakdown, simulate
from mutwo.ir.node import Phase
from mutwo.ir.pass_base import Pass, PassContext, PassFailure, option, write_atomic
from mutwo.ir.printer import fingerprint
from mutwo.ir.recompute import Block, NotRecomputable, Recompute, insert_blocks
from mutwo.ir.replay import rng_refusal, rng_state_bytes
from mutwo.ir.time_model import TimeModel
from mutwo.passes.liveness import liveness_of
from mutwo.passes.mu_two import Candidate, GreedyResult, greedy, search

MIB = 2**20


@dataclass
class PlanData:
    """What every selection plan states (its JSON form is its fields: they hold only JSON values)."""

    fingerprint: str  #: of the graph it was made for
    budget: str
    budget_bytes: int
    unoptimized_peak: int
    predicted_peak: int
    predicted_peak_node: int
    predicted_peak_phase: str
    base_seconds: float  #: the unoptimized iteration (measured on CUDA, summed over nodes on CPU)

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Any:
        return cls(**data)

    def csv(self) -> str:
        raise NotImplementedError

    def table(self) -> str:
        raise NotImplementedError

    def publish(self, ctx: PassContext, artifact: str, stem: str, title: str) -> None:
        """Hand the plan to later passes as ``ctx.artifacts[artifact]``, write ``<stem>.json`` and
        ``<stem>.csv``, and log its table under ``title``."""
        ctx.artifacts[artifact] = self
        ctx.save_json(f"{stem}.json", self.to_json())
        if ctx.out_dir is not None:
            write_atomic(ctx.out_dir / f"{stem}.csv", self.csv())
        ctx.log(f"{title}:\n" + self.table())


@dataclass
class Plan(PlanData):
    """A recompute plan: what to recompute, what it saves and costs, and what it predicts."""

    added_seconds: float
    entries: list[dict[str, Any]]
    met: bool
    #: random ops that cannot be replayed, so their outputs stay live: "%id (op): why"
    refused: list[str] = field(default_factory=list)
    predicted_breakdown: dict[str, int] = field(default_factory=dict)  #: bytes live at the predicted peak by kind

    def keys(self) -> list[tuple[int, int]]:
        return [(e["storage_creator"], e["storage_output"]) for e in self.entries]

    def table(self) -> str:
        lines = [f"{'storage':>10} {'producer':<34} {'MiB':>8} {'count':>5} {'added ms':>9}  sources"]
        for e in self.entries:
            sources = " ".join(f"%{s}" for s in e["sources"][:6]) + (" ..." if len(e["sources"]) > 6 else "")
            lines.append(f"{e['storage']:>10} {e['op'][:34]:<34} {e['bytes'] / MIB:8.2f} {e['recompute_count']:5d} "
                         f"{e['seconds'] * 1e3:9.3f}  {sources}")  # fmt: skip
        lines.append(f"recompute {len(self.entries)} activations: predicted peak {self.predicted_peak / MIB:.1f} MiB "
                     f"(unoptimized {self.unoptimized_peak / MIB:.1f} MiB, budget {self.budget_bytes / MIB:.1f} MiB), "
                     f"+{self.added_seconds * 1e3:.1f} ms per iteration")  # fmt: skip
        return "\n".join(lines)

    def csv(self) -> str:
        out = io.StringIO()
        writer = csv.writer(out)
        columns = ["storage", "node", "op", "bytes", "recompute_count", "seconds", "total_seconds", "ratio",
                   "inactive_ranks", "sources"]  # fmt: skip
        writer.writerow(columns)
        for e in self.entries:
            writer.writerow([e[c] if c != "sources" else " ".join(f"%{s}" for s in e[c]) for c in columns])
        return out.getvalue()


@dataclass
class Start:
    """What selection starts from: the profile, the unoptimized graph's liveness and simulation
    (with the profiled workspaces), and the budget."""

    profile: Any
    liveness: Liveness
    workspace: dict[int, int]
    base: MemorySimulation
    budget: Budget
    budget_bytes: int


def start(graph: Graph, ctx: PassContext, option_value: str | None, unlimited: str) -> Start:
    """The starting point of a selection pass whose budget option is ``option_value`` (see
    :func:`resolve_budget` for ``unlimited``)."""
    profile = ctx.artifacts["profile"]
    liveness = liveness_of(graph, ctx)
    workspace = profile.workspace()
    base = simulate(graph, liveness, workspace)
    budget = resolve_budget(option_value, ctx, base.peak_bytes, unlimited)
    return Start(profile, liveness, workspace, base, budget, budget.resolve(base.peak_bytes))


def resolve_budget(option_value: str | None, ctx: PassContext, peak: int, unlimited: str) -> Budget:
    """The pass's budget: its option, else the run's ``--budget``, else the device's memory; on a
    CPU with none of these the unoptimized ``peak`` (nothing to do), logging ``unlimited``."""
    if option_value is not None:
        return parse_budget(option_value)  # valid: checked when the pass was built
    budget = ctx.services.get("budget")
    if budget is not None:
        return budget
    capacity = ctx.services.get("device_memory")
    if capacity is None:
        ctx.log(unlimited)
        return Budget(bytes=max(peak, 1))
    return Budget(bytes=int(capacity))


def plan_peak(graph: Graph, liveness: Liveness, keys: list[Any], workspace: dict[int, int]) -> tuple[
        MemorySimulation, torch.Tensor, list[Block]]:  # fmt: skip
    """Exact simulation of ``graph`` rewritten for ``keys`` (the rewrite applied to a copy), its
    curve projected onto the original ranks (a clone counts at the rank it is inserted before),
    and the blocks of the rewrite."""
    rewritten = graph.copy()
    blocks = Recompute(rewritten, liveness).plan(keys)
    clones = insert_blocks(rewritten, blocks)
    clone_workspace = dict(workspace)
    for origin, copies in clones.items():
        for clone_id in copies:
            if origin in workspace:
                clone_workspace[clone_id] = workspace[origin]
    simulation = simulate(rewritten, workspace=clone_workspace)
    projected = torch.zeros(len(liveness.rank), dtype=torch.int64)
    pending = 0  # the highest curve value among clones waiting for the original node they precede
    for node, value in zip(rewritten, simulation.curve, strict=True):
        if node.origin is not None or node.id not in liveness.rank:  # a clone, or a generator-state snapshot
            pending = max(pending, value)
            continue
        rank = liveness.rank[node.id]
        projected[rank] = max(value, pending)
        pending = 0
    return simulation, projected, blocks


def estimator(base: MemorySimulation, candidates: list[Candidate]) -> tuple[
        torch.Tensor, Callable[[Candidate], tuple[int, int]]]:  # fmt: skip
    """The greedy's estimate: the unoptimized curve, and a function that drops a candidate's
    bytes over its idle window and returns the new (peak, rank)."""
    curve = torch.tensor(base.curve, dtype=torch.int64)
    sizes = {c.key: c.memory for c in candidates}

    def peak_after(candidate: Candidate) -> tuple[int, int]:
        curve[candidate.inactive_start + 1:candidate.first_backward_use] -= sizes[candidate.key]
        rank = int(torch.argmax(curve))
        return int(curve[rank]), rank

    return curve, peak_after


def refused_random_ops(graph: Graph) -> list[str]:
    """Forward random ops that recomputation cannot replay, each as "%id (op): why"."""
    refused = []
    for node in graph:
        if node.phase is Phase.FORWARD and node.is_random:
            why = rng_refusal(node)
            if why is not None:
                refused.append(f"%{node.id} ({node.op_name}): {why}")
    return refused


@dataclass(frozen=True)
class SelectPass(Pass):
    """Choose activations to recompute with μ-TWO's greedy policy until the peak fits the budget.

    Candidates are activations that own storage and whose lineage can be replayed without side
    effects (random ops with the generator state they consumed, batch norms from their saved
    statistics, each priced at its measured replay time). Each has a recompute ratio = bytes /
    total recompute time from the profile; the highest ratio among those idle at the current peak
    is taken, sources, times and counts are updated as in the paper, and the peak is re-simulated
    incrementally. The final plan is checked by simulating the rewritten graph exactly; that
    simulation is the predicted peak.
    Budget: a fraction of the unoptimized simulated peak (0.5), bytes (6GiB), or 'min'; default:
    mutwo-opt's --budget, else the device's memory. Writes plan.json and plan.csv. When the budget
    is out of reach, the greedy goes on to the lowest peak it can reach and the failure says what
    that is; with ``lowest=false`` it stops there (the failure then reports the best plan it had),
    and fails before any exact simulation if the estimate, recomputing every candidate it can,
    stays above the budget.
    """

    name = "select"
    requires = ("profile",)
    provides = ("plan",)
    budget: str | None = option(None, "0.5, 6GiB or min (default: --budget, else the device's memory)")
    lowest: bool = option(True, "when the budget is out of reach, go on to the lowest reachable peak, which the "
                                "failure reports (false: fail at once, even before simulating exactly when the "
                                "greedy's estimate cannot reach the budget, as --fit's search does)")

    def __post_init__(self) -> None:
        # A bad budget is a usage error when the pipeline is built, before anything is captured.
        if self.budget is not None:
            parse_budget(self.budget)  # BudgetError is a ValueError: the registry reports it in one line

    def run(self, graph: Graph, ctx: PassContext) -> Plan:
        begin = start(graph, ctx, self.budget, "select: no budget and no device limit (CPU): nothing needs recomputing")
        profile, liveness, workspace, base = begin.profile, begin.liveness, begin.workspace, begin.base
        budget, budget_bytes = begin.budget, begin.budget_bytes
        recompute = Recompute(graph, liveness)
        # A compiled backend cannot replay a random op from a saved generator state (Inductor
        # would bake the state in as a constant; a CUDA graph cannot read it on the host).
        replay_random = ctx.services.get("replay_random", True)
        if not replay_random:
            ctx.log("select: the backend cannot replay random ops; their outputs are not recomputed")
        candidates = self._candidates(graph, liveness, recompute, profile, base.device, replay_random)
        refused = refused_random_ops(graph)
        if refused:
            ctx.log(f"select: {len(refused)} random ops cannot be replayed, their outputs stay live: "
                    + "; ".join(refused))  # fmt: skip
        ctx.log(f"select: {len(candidates)} candidates; unoptimized peak {base.peak_bytes / MIB:.1f} MiB, "
                f"budget {budget_bytes / MIB:.1f} MiB ({budget})")  # fmt: skip
        if not self.lowest:
            self._fail_fast(base, budget, budget_bytes, candidates)
        # The greedy cannot undo a choice: when its first choice made every exact plan worse than
        # none (a block's transients, which the estimate ignores, sat at the peak), plan again
        # without that candidate, a few times at most.
        banned: set[Any] = set()
        for _retry in range(4):
            best, first = self._greedy_plan(graph, liveness, workspace, base, budget_bytes,
                                            [copy.deepcopy(c) for c in candidates if c.key not in banned])  # fmt: skip
            if best[0].peak_bytes < base.peak_bytes or first is None:
                break
            banned.add(first)
        exact, chosen, blocks = best
        plan = self._plan(graph, budget, budget_bytes, base, exact, chosen, blocks, profile)
        plan.refused = refused
        plan.publish(ctx, "plan", "plan", "select")
        if not plan.met:
            raise PassFailure(self._unreachable(graph, plan, base, budget, "optimizer-in-backward" in ctx.artifacts))
        return plan

    def _greedy_plan(self, graph: Graph, liveness: Liveness, workspace: dict[int, int], base: MemorySimulation,
                     budget_bytes: int, candidates: list[Candidate]) -> tuple[
            tuple[MemorySimulation, list[Candidate], list[Block]], Any]:  # fmt: skip
        """μ-TWO's greedy towards ``budget_bytes``, then towards the lowest peak if that is out of
        reach: the best exactly simulated plan (simulation, choices, blocks), and the key of the
        first choice made (None if none)."""
        curve, peak_after = estimator(base, candidates)
        state = GreedyResult()
        remaining = list(candidates)
        # The best exactly simulated plan so far: a later choice can raise the exact peak (its
        # block's clones are live at once), and then the plan falls back to this one.
        best: tuple[MemorySimulation, list[Candidate], list[Block]] = (base, [], [])

        def grow(target: int, max_steps: int | None) -> bool:
            nonlocal best
            rank = int(torch.argmax(curve))
            grew = greedy(remaining, target, peak_after, (int(curve[rank]), rank), state, max_steps)
            if grew:
                exact, projected, blocks = plan_peak(graph, liveness, [c.key for c in state.chosen], workspace)
                curve.copy_(projected)
                if exact.peak_bytes < best[0].peak_bytes:
                    best = (exact, list(state.chosen), blocks)
            return grew

        search(budget_bytes, max(4, len(candidates) // 8), grow, lambda: best[0].peak_bytes, self.lowest)
        return best, state.chosen[0].key if state.chosen else None

    def _fail_fast(self, base: MemorySimulation, budget: Budget, budget_bytes: int,
                   candidates: list[Candidate]) -> None:  # fmt: skip
        """Fail before any exact simulation when the greedy's estimate cannot reach the budget:
        it ignores the transients of recompute blocks, so no exact plan gets lower (what makes
        a batch far out of reach cheap to refuse for --fit, whose search tries many)."""
        remaining = [copy.deepcopy(c) for c in candidates]
        curve, peak_after = estimator(base, remaining)
        rank = int(torch.argmax(curve))
        state = GreedyResult()
        greedy(remaining, budget_bytes, peak_after, (int(curve[rank]), rank), state)
        if state.peak > budget_bytes:
            raise PassFailure(f"budget {budget} ({budget_bytes / MIB:.1f} MiB) is out of reach: recomputing every "
                              f"activation idle at the peak, the estimate stays at {state.peak / MIB:.1f} MiB "
                              f"({100 * state.peak / base.peak_bytes:.0f}% of the unoptimized "
                              f"{base.peak_bytes / MIB:.1f} MiB), and recompute blocks only add to it (lowest=false: "
                              "the lowest reachable peak was not searched)")  # fmt: skip

    def _candidates(self, graph: Graph, liveness: Liveness, recompute: Recompute, profile: Any,
                    device: str, replay_random: bool = True) -> list[Candidate]:  # fmt: skip
        # Candidates are ranked on the simulators' time model (views free, the measured iteration
        # shared by the nodes with kernels), not on raw profiled times, in which a view's launch
        # gap can cost as much as a convolution (docs/benchmarks.md, "The time model").
        time_model = TimeModel.of(graph, profile)
        elapsed = elapsed_seconds(graph, time_model.node_seconds)
        candidates = []
        for record in liveness.activations():
            if record.device != device or record.bytes == 0:
                continue
            try:
                block = recompute.plan_block(record.key, set(), {})
            except NotRecomputable:
                continue
            if not replay_random and any(graph.node(n).is_random for n in block.nodes):
                continue
            start = record.last_forward_use if record.last_forward_use is not None else record.created
            end = record.first_backward_use
            assert end is not None
            sources = {t.storage for s in block.sources for t in graph.node(s).tensors if t is not None}
            # A replayed random op keeps its generator state from the forward on: on the CPU that
            # state (5 KiB) is memory of the same device, and can outweigh a small activation.
            memory = allocation_size(record.bytes, device) - sum(
                allocation_size(rng_state_bytes(device), device) for n in block.nodes
                if device == "cpu" and graph.node(n).is_random)  # fmt: skip
            if memory <= 0:
                continue
            candidates.append(Candidate(
                key=record.key, memory=memory, sources=sources,
                recompute_time=time_model.block_seconds(block), inactive_start=start,
                first_backward_use=end, last_backward_use=record.last_backward_use or end,
                inactive_time=idle_seconds(record, elapsed),
            ))  # fmt: skip
        return candidates

    def _plan(self, graph: Graph, budget: Budget, budget_bytes: int, base: MemorySimulation,
              exact: MemorySimulation, chosen: list[Candidate], blocks: list[Block], profile: Any) -> Plan:
        entries = []
        for candidate in chosen:
            creator = graph.node(candidate.key.creator)
            entries.append({
                "storage": str(candidate.key), "storage_creator": candidate.key.creator,
                "storage_output": candidate.key.output, "node": creator.id, "op": creator.op_name,
                "bytes": candidate.memory, "recompute_count": candidate.recompute_count,
                "seconds": candidate.recompute_time, "total_seconds": candidate.total_recompute_time,
                "ratio": candidate.ratio, "inactive_ranks": candidate.first_backward_use - candidate.inactive_start,
                "sources": sorted(k.creator for k in candidate.sources),
            })  # fmt: skip
        time_model = TimeModel.of(graph, profile)
        added = sum(time_model.block_seconds(block) for block in blocks)
        iteration = profile.iteration_seconds()
        return Plan(fingerprint(graph), str(budget), budget_bytes, base.peak_bytes, exact.peak_bytes, exact.peak_node,
                    exact.peak_phase, iteration, added, entries, exact.peak_bytes <= budget_bytes or budget.minimum,
                    dict(exact.breakdown))

    def _unreachable(self, graph: Graph, plan: Plan, base: MemorySimulation, budget: Budget,
                     optimizer_passes_ran: bool) -> str:  # fmt: skip
        node = graph.node(plan.predicted_peak_node) if graph.has_node(plan.predicted_peak_node) else None
        where = f"at %{plan.predicted_peak_node} ({node.op_name if node else 'a recompute clone'}, " \
                f"{plan.predicted_peak_phase})"
        share = f"{100 * plan.predicted_peak / base.peak_bytes:.0f}% of the unoptimized {base.peak_bytes / MIB:.1f} MiB"
        if not self.lowest:
            return (f"budget {budget} ({plan.budget_bytes / MIB:.1f} MiB) is out of reach: the best plan peaks at "
                    f"{plan.predicted_peak / MIB:.1f} MiB ({share}) {where} (lowest=false: the lowest reachable "
                    "peak was not searched)")  # fmt: skip
        if plan.predicted_peak_phase == "optimizer":
            why = "the peak is in the optimizer step, where recomputing activations cannot help"
            if not optimizer_passes_ran:
                why += "; the optimizer passes can: --passes profile,optimizer,select,rewrite"
        else:
            why = "no remaining activation that is idle at that point can be recomputed"
            if plan.refused:
                why += f" ({len(plan.refused)} random ops cannot be replayed: {plan.refused[0]}"
                why += ", ...)" if len(plan.refused) > 1 else ")"
        return (f"budget {budget} ({plan.budget_bytes / MIB:.1f} MiB) is unreachable: the lowest peak recomputation "
                f"reaches is {plan.predicted_peak / MIB:.1f} MiB ({share}) {where}, holding "
                f"{describe_breakdown(plan.predicted_breakdown)}; {why}")
