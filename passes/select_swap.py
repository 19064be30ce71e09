"""The ``select-swap`` pass: keep, recompute or swap every activation (μ-TWO), as a plan."""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from mutwo.ir.budget import Budget, UnreachableBudget, budget_text, parse_budget, sizes
from mutwo.ir.graph import Graph
from mutwo.ir.liveness import Liveness, elapsed_seconds, idle_seconds
from mutwo.ir.mask_replay import mask_holder
from mutwo.ir.memory import MemorySimulation, allocation_size, simulate
from mutwo.ir.node import Node, Phase, StorageKey
from mutwo.ir.pass_base import Pass, PassContext, PassFailure, option
from mutwo.ir.printer import fingerprint
from mutwo.ir.recompute import NotRecomputable, Recompute, replays_from_masks
from mutwo.ir.replay import rng_state
from mutwo.ir.swap import NotSwappable, Placement, SwapAnalysis, SwapRewrite, SwapSite, rewrite
from mutwo.ir.time_model import TimeModel
from mutwo.ir.timeline import CUDA_COMPUTE_SLOWDOWN, GraphTimeline, TransferModel, graph_timeline, release_points
from mutwo.passes.mu_two import GreedyResult, search
from mutwo.passes.mu_two_swap import RECOMPUTE, SWAP, SwapCandidate, Timeline, schedule, swap_overhead
from mutwo.passes.select import FUSED_OPTION, PlanData, recompute_time_model, start

MIB = 2**20
ACTIONS = ("swap", "recompute")
#: What the refinement adds to a plan's predicted stall when it compares plans: on the H100 the
#: compute stream idled 1.4-1.6x the stall BERT-base's swap plans predicted (docs/benchmarks.md,
#: "Swap and recompute"), so a swap must win by more than its predicted stall to be taken.
STALL_MARGIN = 0.5


@dataclass
class SwapPlan(PlanData):
    """A plan of swaps and recomputations, what it saves and costs, and what it predicts."""

    predicted_seconds: float
    recompute_seconds: float  #: what the recompute clones add
    stall_seconds: float  #: what the copies the compute cannot hide add
    time_scale: float  #: measured iteration / summed times of the nodes that do device work (TimeModel)
    transfer: dict[str, Any]
    entries: list[dict[str, Any]]
    kept: int  #: candidate activations kept on the device
    #: the plan not kept when ``keep_faster`` compared swap+recompute with recompute only: its
    #: ``allow``, predicted seconds and peak, whether it met the budget, what it swapped and recomputed
    alternative: dict[str, Any] | None = None

    def of(self, action: str) -> list[dict[str, Any]]:
        return [e for e in self.entries if e["action"] == action]

    def table(self) -> str:
        if not self.entries:
            return ""
        lines = [f"{'action':<9} {'storage':>10} {'producer':<34} {'MiB':>8} {'ms':>8}  detail"]
        for e in self.entries:
            if e["action"] == SWAP:
                cost, detail = e["stall_seconds"], f"prefetch before %{e['prefetch_before']}, copy in " \
                                                   f"{e['h2d_seconds'] * 1e3:.3f} ms"
            else:
                cost, detail = e["seconds"], f"x{e['recompute_count']} from {len(e['sources'])} sources"
            lines.append(f"{e['action']:<9} {e['storage']:>10} {e['op'][:34]:<34} {e['bytes'] / MIB:8.2f} "
                         f"{cost * 1e3:8.3f}  {detail}")  # fmt: skip
        return "\n".join(lines)

    def summary(self) -> str:
        swapped = sum(e["bytes"] for e in self.of(SWAP))
        predicted, unoptimized, budget, moved = sizes(self.predicted_peak, self.unoptimized_peak, self.budget_bytes,
                                                      swapped)  # fmt: skip
        overlap = "" if self.transfer.get("overlap", True) else \
            f", which do not overlap compute on {self.transfer.get('device') or 'this device'}"  # fmt: skip
        return (f"swap {len(self.of(SWAP))} activations ({moved}), recompute {len(self.of(RECOMPUTE))}, "
                f"keep {self.kept}: predicted peak {predicted} (unoptimized {unoptimized}, budget "
                f"{budget_text(self.budget, budget)}), "
                f"predicted {self.predicted_seconds * 1e3:.1f} ms per iteration against {self.base_seconds * 1e3:.1f} "
                f"ms unoptimized (+{self.recompute_seconds * 1e3:.2f} ms recompute, +{self.stall_seconds * 1e3:.2f} ms "
                f"stalled on copies{overlap})")  # fmt: skip

    def csv(self) -> str:
        out = io.StringIO()
        columns = ["action", "storage", "node", "op", "bytes", "prefetch_before", "release_before", "d2h_seconds",
                   "h2d_seconds",
                   "stall_seconds", "recompute_count", "seconds", "inactive_seconds"]  # fmt: skip
        writer = csv.DictWriter(out, columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(self.entries)
        return out.getvalue()


@dataclass
class Evaluation:
    """A plan applied to a copy of the graph and simulated exactly, in memory and time."""

    chosen: list[SwapCandidate]
    simulation: MemorySimulation
    projected: torch.Tensor  #: the memory curve on the original ranks (inserted nodes count at the next one)
    timeline: GraphTimeline
    rewrite: SwapRewrite
    graph: Graph  #: the rewritten copy


def evaluate(graph: Graph, liveness: Liveness, sites: dict[StorageKey, SwapSite], chosen: list[SwapCandidate],
             workspace: dict[int, int], seconds: Callable[[Node], float],
             transfer: TransferModel, mask_replay: bool = False) -> Evaluation:  # fmt: skip
    """Rewrite a copy of ``graph`` for ``chosen`` and simulate it: the predictions of the plan
    (``mask_replay``: for a compiled backend, which recomputes dropouts from their masks and
    cannot replay a generator state: a plan that needs one is :class:`NotRecomputable`)."""
    rewritten = graph.copy()
    nodes = graph.nodes
    placements = [Placement(sites[c.key], nodes[c.prompt].id) for c in chosen if c.action == SWAP]
    result = rewrite(rewritten, liveness, placements, [c.key for c in chosen if c.action == RECOMPUTE],
                     mask_replay=mask_replay)  # fmt: skip
    if mask_replay and any(node.target is rng_state for node in rewritten):
        raise NotRecomputable("it recomputes a random op through a swapped-out tensor, which needs the generator "
                              "state this backend cannot replay")  # fmt: skip
    clone_workspace = dict(workspace)
    clone_workspace.update({n.id: workspace[n.origin] for n in rewritten if n.origin in workspace})
    simulation = simulate(rewritten, workspace=clone_workspace)
    projected = torch.zeros(len(nodes), dtype=torch.int64)
    pending = 0  # the highest value among inserted nodes waiting for the original node they precede
    for node, value in zip(rewritten, simulation.curve, strict=True):
        rank = liveness.rank.get(node.id) if node.origin is None else None
        if rank is None:
            pending = max(pending, value)
        else:
            projected[rank], pending = max(value, pending), 0
    return Evaluation(list(chosen), simulation, projected, graph_timeline(rewritten, seconds, transfer), result,
                      rewritten)  # fmt: skip


@dataclass(frozen=True)
class SelectSwapPass(Pass):
    """Choose, for every activation, to keep it, recompute it or swap it to host memory (μ-TWO).

    The scheduler of the paper (Algorithm B): at the simulated peak, the activation idle longest is
    priced as a swap (the stall its copies add to the copy streams, with the prefetch issued as
    late as the copy in can still be hidden) and the one with the highest recompute ratio as a
    recomputation (its total recompute time); the cheaper is chosen, recompute sources, counts
    and times are updated as in the paper, and memory and time are re-simulated. The plan is
    checked by applying it to a copy of the graph and simulating that exactly: those are its
    predictions. Host-device bandwidth and latency come from the runtime's measurement (or the
    bandwidth option); tensors whose copy would take mostly latency are not swapped. Budget as
    for select. Writes swap_plan.json, swap_plan.csv (not for a plan that misses its budget: the
    failure says the lowest peak it reached), transfer.json. See docs/swap.md.
    """

    name = "select-swap"
    requires = ("profile",)
    profile_needs = ("contention",)
    provides = ("swap-plan", "transfer")
    budget: str | None = option(None, "0.5, 6GiB or min (default: --budget, else the device's memory)")
    allow: str = option("swap,recompute", "what it may choose for an activation: swap, recompute, or both")
    bandwidth: float | None = option(None, "host-device GB/s (both directions, no latency) instead of measuring it")
    keep_faster: bool = option(True, "with swap and recompute allowed, also plan recompute only and keep whichever "
                                     "plan is predicted faster at the budget (the plan records the other)")  # fmt: skip
    fused: bool = option(False, FUSED_OPTION)
    contention: float | None = option(None, "how much longer compute runs while a copy is in flight, e.g. 0.1 for "
                                            "10% (default: as the profile measured it on this graph on CUDA, else "
                                            "0.1, the H100's for ResNet-152; 0 where copies do not overlap compute); "
                                            "0 prices copies beside compute as free")  # fmt: skip
    min_gain: float = option(0.01, "with keep_faster, keep a plan with swaps only when it is predicted at least "
                                   "this fraction faster than recompute only (default 1%: smaller gains are within "
                                   "the measured spread between runs; copies cost pinned memory and HBM bandwidth)")
    duplex: bool = option(False, "let copies out run on into the backward pass, beside the copies in (CUDA): on the "
                                 "H100 copies in then ran 17-29% slower than alone, which the copy model does not "
                                 "price, and a BERT-base plan that did stalled 51 ms over its prediction")  # fmt: skip
    offload_window: float = option(0.8, "without duplex, the fraction of the forward pass's profiled time by which "
                                        "copies out must have ended (a compiled forward runs faster than its eager "
                                        "profile: on the H100 BERT-base's 8.2 GB of copies out, 80% of its forward, "
                                        "ran 2.5% over its prediction; 10.2 GB, all of it, 5.1% over)")  # fmt: skip
    refine: int = option(32, "with swap allowed, then try turning this many of the plan's costliest recomputations "
                             "into swaps, one at a time, keeping each that the exact simulation predicts faster "
                             "within the budget (0: off)")  # fmt: skip

    def __post_init__(self) -> None:
        if self.budget is not None:
            parse_budget(self.budget)  # a bad budget is a usage error when the pipeline is built
        actions = [a.strip() for a in self.allow.split(",") if a.strip()]
        if not actions or any(a not in ACTIONS for a in actions):
            raise ValueError(f"allow must list swap and/or recompute, got {self.allow!r}")
        if self.bandwidth is not None and not self.bandwidth > 0:
            raise ValueError(f"bandwidth must be a positive number of GB/s, got {self.bandwidth}")
        if self.contention is not None and not 0 <= self.contention < 10:
            raise ValueError(f"contention must be a fraction of compute time from 0 (e.g. 0.1), got {self.contention}")
        if not 0 <= self.min_gain < 1:
            raise ValueError(f"min_gain must be a fraction from 0 to below 1 (e.g. 0.01 for 1%), got {self.min_gain}")
        if not 0 < self.offload_window <= 1:
            raise ValueError(f"offload_window must be a fraction of the forward pass above 0 and at most 1 (e.g. 0.8), "
                             f"got {self.offload_window}")  # fmt: skip
        if self.refine < 0:
            raise ValueError(f"refine must be a number of recomputations to try, 0 or more, got {self.refine}")

    def run(self, graph: Graph, ctx: PassContext) -> SwapPlan:
        begin = start(graph, ctx, self.budget, "select-swap: no budget and no device limit (CPU): nothing needs to "
                      "leave memory")  # fmt: skip
        profile, liveness, base = begin.profile, begin.liveness, begin.base
        budget, budget_bytes = begin.budget, begin.budget_bytes
        transfer = self._contended(self._transfer(ctx, base.device), profile, ctx)
        seconds = recompute_time_model(graph, profile, ctx, self.name, self.fused)
        allowed = {a.strip() for a in self.allow.split(",") if a.strip()}
        # A compiled backend replays dropouts from their masks and no random op from a generator
        # state (as select plans for it).
        replay_random, mask_replay = bool(ctx.services.get("replay_random", True)), replays_from_masks(ctx)
        candidates, sites = self._candidates(graph, liveness, seconds, transfer, base.device, allowed,
                                             replay_random, mask_replay)  # fmt: skip
        unoptimized_text, budget_size = sizes(base.peak_bytes, budget_bytes)
        ctx.log(f"select-swap: {len(candidates)} candidates ({sum(c.swappable for c in candidates)} swappable, "
                f"{sum(c.recomputable for c in candidates)} recomputable); unoptimized peak {unoptimized_text}, "
                f"budget {budget_text(str(budget), budget_size)}; copies "
                f"{transfer.d2h_bytes_per_second / 1e9:.1f} GB/s out, {transfer.h2d_bytes_per_second / 1e9:.1f} GB/s "
                "in")  # fmt: skip
        # μ-TWO's scheduler prices one activation at a time; the whole recompute-only plan, on the
        # same time model, may still be faster (at the same budget, never slower is the goal). Its
        # candidates are fresh copies made before the scheduler updates the ones it prices.
        compare = self.keep_faster and allowed == set(ACTIONS)
        only = [replace(c, swappable=False, sources=set(c.sources)) for c in candidates if c.recomputable] \
            if compare else []  # fmt: skip
        best = self._greedy(graph, liveness, begin.workspace, seconds, transfer, base, budget_bytes, candidates, sites,
                            mask_replay)  # fmt: skip
        swap_sites = sites
        alternative = None
        recompute_only: Evaluation | None = None
        only_sites: dict[StorageKey, SwapSite] = {}
        if compare:
            other = recompute_only = self._greedy(graph, liveness, begin.workspace, seconds, transfer, base,
                                                  budget_bytes, only, only_sites, mask_replay)  # fmt: skip
            if self._better(other, best, budget_bytes, budget.minimum):
                ctx.log(f"select-swap: recompute only is predicted faster at this budget "
                        f"({other.timeline.seconds * 1e3:.1f} ms against {best.timeline.seconds * 1e3:.1f} ms with "
                        "swaps): keeping it (select-swap{keep_faster=false} keeps the swaps)")  # fmt: skip
                alternative = self._summary("swap,recompute", best, budget_bytes)
                best, candidates, sites = other, only, only_sites
            else:
                alternative = self._summary("recompute", other, budget_bytes)
        met = best.simulation.peak_bytes <= budget_bytes
        if self.refine and "swap" in allowed and (met or budget.minimum):
            limit = best.simulation.peak_bytes if budget.minimum else budget_bytes
            refined = self._refine(graph, liveness, begin.workspace, seconds, transfer, limit, best, swap_sites,
                                   mask_replay)  # fmt: skip
            if refined is not best:
                turned = sum(c.action == SWAP for c in refined.chosen) - sum(c.action == SWAP for c in best.chosen)
                ctx.log(f"select-swap: refined: {turned} recomputations turned into swaps, predicted "
                        f"{best.timeline.seconds * 1e3:.1f} -> {refined.timeline.seconds * 1e3:.1f} ms")  # fmt: skip
                best, sites = refined, swap_sites
        if recompute_only is not None and best is not recompute_only and \
                self._gain_too_small(recompute_only, best, budget_bytes, budget.minimum):
            ctx.log(f"select-swap: the plan with swaps is predicted {best.timeline.seconds * 1e3:.1f} ms against "
                    f"recompute only's {recompute_only.timeline.seconds * 1e3:.1f} ms, less than min_gain "
                    f"{self.min_gain * 100:g}% faster: keeping recompute only")  # fmt: skip
            alternative = self._summary("swap,recompute", best, budget_bytes)
            best, candidates, sites = recompute_only, only, only_sites
        plan = self._plan(graph, budget, budget_bytes, base, best, candidates, sites, seconds, transfer)
        plan.alternative = alternative
        begin.within_ceiling(plan, ctx, "select-swap")
        plan.publish(ctx, "swap-plan", "swap_plan", "select-swap")
        # A caller that measures both compiled plans (``measure_choice`` among the services) needs no hint.
        if plan.of(SWAP) and ctx.services.get("fused_recompute", False) and not ctx.services.get("measure_choice"):
            ctx.log("select-swap: under Inductor, swaps and recomputes are priced with eager node times and the "
                    "measured copy model; compiled recomputes may run faster than priced (ResNet-152-cl: the "
                    "recompute-only plan ran 15% under its prediction, a plan with swaps 17% slower than it, while "
                    "BERT-base's swap plans ran 6% faster than recompute only; docs/swap.md): --measure-choice "
                    "(measure_choice=True) measures both compiled plans and keeps the faster")
        if not plan.met:  # named by the budget asked, not the lower one the first plan aimed at
            budget, budget_bytes = begin.asked(), begin.ceiling_bytes
            budget_size, lowest, unoptimized = sizes(budget_bytes, plan.predicted_peak, base.peak_bytes)
            raise UnreachableBudget(f"budget {budget} ({budget_size}) is unreachable: the lowest peak select-swap "
                                    f"reaches with {self.allow} is {lowest} "
                                    f"({100 * plan.predicted_peak / base.peak_bytes:.0f}% of the unoptimized "
                                    f"{unoptimized}), at %{plan.predicted_peak_node} in the "
                                    f"{plan.predicted_peak_phase} phase", plan.predicted_peak, base.peak_bytes,
                                    lowest)  # fmt: skip
        return plan

    @staticmethod
    def _better(other: Evaluation, best: Evaluation, budget_bytes: int, minimum: bool) -> bool:
        """Whether ``other`` is the better plan: at ``min`` the lower peak (then the faster);
        otherwise one that meets the budget over one that does not, then the faster."""
        if minimum:
            return (other.simulation.peak_bytes, other.timeline.seconds) < \
                (best.simulation.peak_bytes, best.timeline.seconds)  # fmt: skip
        meets = [e.simulation.peak_bytes <= budget_bytes for e in (other, best)]
        if meets[0] != meets[1]:
            return meets[0]
        return other.timeline.seconds < best.timeline.seconds

    def _gain_too_small(self, recompute_only: Evaluation, best: Evaluation, budget_bytes: int, minimum: bool) -> bool:
        """Whether ``best`` swaps for less than ``min_gain`` of recompute only's predicted time, where
        recompute only reaches as low (``min``) or meets the budget too."""
        if not any(c.action == SWAP for c in best.chosen):
            return False
        peak = recompute_only.simulation.peak_bytes
        if peak > (best.simulation.peak_bytes if minimum else budget_bytes):
            return False
        return best.timeline.seconds > (1 - self.min_gain) * recompute_only.timeline.seconds

    @staticmethod
    def _summary(allow: str, evaluation: Evaluation, budget_bytes: int) -> dict[str, Any]:
        """What the plan not kept would have done: the record of the choice."""
        return {"allow": allow, "predicted_seconds": evaluation.timeline.seconds,
                "predicted_peak": evaluation.simulation.peak_bytes,
                "met": evaluation.simulation.peak_bytes <= budget_bytes,
                "swapped": sum(c.action == SWAP for c in evaluation.chosen),
                "recomputed": sum(c.action == RECOMPUTE for c in evaluation.chosen)}  # fmt: skip

    def _greedy(self, graph: Graph, liveness: Liveness, workspace: dict[int, int], seconds: Callable[[Node], float],
                transfer: TransferModel, base: MemorySimulation, budget_bytes: int, candidates: list[SwapCandidate],
                sites: dict[StorageKey, SwapSite], mask_replay: bool = False) -> Evaluation:  # fmt: skip
        """The scheduler's search over ``candidates`` down to ``budget_bytes``: the lowest-peak
        evaluation it reached."""
        durations = [seconds(n) for n in graph]
        forward = sum(d for d, n in zip(durations, graph, strict=True) if n.phase is Phase.FORWARD)
        timeline = Timeline(durations, transfer.overlap, ceiling=forward, compute_slowdown=transfer.compute_slowdown,
                            offload_deadline=self._deadline(forward, transfer))  # fmt: skip
        curve = torch.tensor(base.curve, dtype=torch.int64)

        def peak_after(candidate: SwapCandidate) -> tuple[int, int]:
            end = candidate.prompt if candidate.action == SWAP else candidate.first_backward_use
            curve[candidate.inactive_start + 1:end] -= candidate.memory
            rank = int(torch.argmax(curve))
            return int(curve[rank]), rank

        def exact() -> Evaluation:
            try:
                return evaluate(graph, liveness, sites, state.chosen, workspace, seconds, transfer, mask_replay)
            except (NotRecomputable, NotSwappable) as error:
                raise PassFailure(f"select-swap chose a plan that cannot be realised: {error}") from None

        state = GreedyResult()
        remaining = list(candidates)
        best = exact()

        def grow(target: int, max_steps: int | None) -> bool:
            nonlocal best
            rank = int(torch.argmax(curve))
            grew = schedule(remaining, timeline, target, peak_after, (int(curve[rank]), rank), state, max_steps)
            if grew:
                evaluation = exact()
                curve.copy_(evaluation.projected)
                if evaluation.simulation.peak_bytes < best.simulation.peak_bytes:
                    best = evaluation
            return grew

        search(budget_bytes, max(4, len(candidates) // 8), grow, lambda: best.simulation.peak_bytes)
        return best

    def _refine(self, graph: Graph, liveness: Liveness, workspace: dict[int, int], seconds: Callable[[Node], float],
                transfer: TransferModel, limit: int, best: Evaluation,
                sites: dict[StorageKey, SwapSite], mask_replay: bool = False) -> Evaluation:  # fmt: skip
        """Turn recomputations of ``best`` into swaps, costliest first, while each turn keeps the
        exact peak within ``limit`` and the predicted time (stalls counted with STALL_MARGIN) drops.

        The scheduler assembles its mixed plan one greedy choice at a time, and a swap chosen early
        changes what later recomputations cost, so its plan can be slower than recompute only while
        single recomputations of that plan could still leave by copy behind the forward pass (the
        recompute-only plan of ResNet-152 b128 on the H100, docs/benchmarks.md). Each turn issues
        the prefetch as the scheduler would (Algorithm C at the plan's peak) and is kept only when
        the rewritten graph, simulated exactly, is predicted faster.
        """
        durations = [seconds(n) for n in graph]
        forward = sum(d for d, n in zip(durations, graph, strict=True) if n.phase is Phase.FORWARD)

        def cost(evaluation: Evaluation) -> float:
            return evaluation.timeline.seconds + STALL_MARGIN * evaluation.timeline.stall

        order = sorted((c for c in best.chosen if c.action == RECOMPUTE and c.key in sites),
                       key=lambda c: c.total_recompute_time, reverse=True)  # fmt: skip
        for candidate in order[:self.refine]:
            timeline = Timeline(durations, transfer.overlap, ceiling=forward,
                                compute_slowdown=transfer.compute_slowdown,
                                recomps=[c for c in best.chosen if c.action == RECOMPUTE and c is not candidate],
                                swaps=[c for c in best.chosen if c.action == SWAP],
                                offload_deadline=self._deadline(forward, transfer))  # fmt: skip
            swap = replace(candidate, action=SWAP, swappable=True)
            overhead, swap.prompt = swap_overhead(timeline, swap, int(torch.argmax(best.projected)))
            if not math.isfinite(overhead):
                continue  # its copy out would end after the forward pass
            try:
                trial = evaluate(graph, liveness, sites, [swap if c is candidate else c for c in best.chosen],
                                 workspace, seconds, transfer, mask_replay)  # fmt: skip
            except (NotRecomputable, NotSwappable):
                continue  # a recomputation that reads it outside its swapped-in window, say
            if trial.simulation.peak_bytes <= limit and cost(trial) < cost(best):
                best = trial
        return best

    def _contended(self, transfer: TransferModel, profile: Any, ctx: PassContext) -> TransferModel:
        """``transfer`` with the contention its copies are priced at: the option, else what the
        profile measured on this graph (mutwo.runtime.measurement.copy_contention), else the machine model's."""
        if self.contention is not None:
            return replace(transfer, compute_slowdown=self.contention)
        if not transfer.overlap:
            return transfer  # copies on the compute timeline already cost their whole time
        measured = profile.meta.get("copy_contention")
        if measured is None:
            ctx.log(f"select-swap: the profile did not measure how much copies slow this graph (a profile from "
                    f"before mutwo measured it, one made out of core, or profile{{contention=false}}): copies beside "
                    f"compute are priced at {transfer.compute_slowdown * 100:g}%, the H100's for "
                    "ResNet-152")  # fmt: skip
            return transfer
        ctx.log(f"select-swap: copies beside compute are priced at {measured['slowdown'] * 100:.1f}%, measured on "
                f"this graph")  # fmt: skip
        return replace(transfer, compute_slowdown=float(measured["slowdown"]))

    def _deadline(self, forward_seconds: float, transfer: TransferModel) -> float:
        """When every copy out must have ended: ``offload_window`` of the forward pass, unless
        ``duplex`` or the copies run on the compute timeline (where the two directions never overlap)."""
        return math.inf if self.duplex or not transfer.overlap else self.offload_window * forward_seconds

    def _transfer(self, ctx: PassContext, device: str) -> TransferModel:
        if self.bandwidth is not None:
            rate = self.bandwidth * 1e9
            cuda = device.startswith("cuda")
            return TransferModel(rate, rate, 0.0, overlap=cuda, device=device,
                                 compute_slowdown=CUDA_COMPUTE_SLOWDOWN if cuda else 0.0)  # fmt: skip
        model = ctx.artifacts.get("transfer")
        if model is None:
            measure = ctx.services.get("transfer")
            if measure is None:
                raise PassFailure("select-swap needs the runtime's transfer measurement; run it through mutwo-opt, "
                                  "put one in ctx.services['transfer'], or give the bandwidth option")  # fmt: skip
            model = measure()
            ctx.artifacts["transfer"] = model
            ctx.save_json("transfer.json", model.to_json())
        return model

    def _candidates(self, graph: Graph, liveness: Liveness, seconds: TimeModel, transfer: TransferModel,
                    device: str, allowed: set[str], replay_random: bool = True, mask_replay: bool = False,
                    ) -> tuple[list[SwapCandidate], dict[StorageKey, SwapSite]]:  # fmt: skip
        recompute, swaps = Recompute(graph, liveness, mask_replay=mask_replay), SwapAnalysis(graph, liveness)
        # A dropout replayed from its mask reads the mask where the backward does: a swapped-out
        # mask is not there, so under mask replay masks stay on the device (a quarter of the
        # dropout's output, in bool).
        masks = {holder.tensors[0].storage for holder in map(mask_holder, graph) if holder is not None} \
            if mask_replay else set()  # fmt: skip
        elapsed = elapsed_seconds(graph, seconds.node_seconds)
        min_swap_bytes = transfer.latency_seconds * min(transfer.d2h_bytes_per_second, transfer.h2d_bytes_per_second)
        candidates: list[SwapCandidate] = []
        sites: dict[StorageKey, SwapSite] = {}
        for record in liveness.activations():
            if record.device != device or record.bytes == 0:
                continue
            block = site = None
            if "recompute" in allowed:
                try:
                    block = recompute.plan_block(record.key, set(), {})
                except NotRecomputable:
                    pass
                if block is not None and block.generator_replays(graph) and not replay_random:
                    block = None
            # A copy that takes mostly latency (batch-norm statistics, say) frees next to nothing
            # for what it occupies the copy streams: only tensors whose copy is mostly bytes swap.
            if "swap" in allowed and record.bytes >= min_swap_bytes and record.key not in masks:
                try:
                    site = sites[record.key] = swaps.site(record.key)
                except NotSwappable:
                    pass
            if block is None and site is None:
                continue
            assert record.first_backward_use is not None
            candidates.append(SwapCandidate(
                key=record.key, memory=allocation_size(record.bytes, device),
                sources=set() if block is None else {t.storage for s in block.sources for t in graph.node(s).tensors
                                                     if t is not None},
                recompute_time=float("inf") if block is None else seconds.block_seconds(block),
                inactive_start=record.last_forward_use if record.last_forward_use is not None else record.created,
                first_backward_use=record.first_backward_use,
                last_backward_use=record.last_backward_use or record.first_backward_use,
                inactive_time=idle_seconds(record, elapsed), swappable=site is not None,
                d2h_seconds=transfer.d2h_seconds(record.bytes), h2d_seconds=transfer.h2d_seconds(record.bytes),
            ))  # fmt: skip
        return candidates, sites

    def _plan(self, graph: Graph, budget: Budget, budget_bytes: int, base: MemorySimulation,
              best: Evaluation, candidates: list[SwapCandidate], sites: dict[StorageKey, SwapSite],
              seconds: TimeModel, transfer: TransferModel) -> SwapPlan:  # fmt: skip
        nodes = graph.nodes
        stalls = {s["tag"]: s["stall"] for s in best.timeline.swaps}
        # Release points name nodes of this graph (the rewrite's own nodes get other ids each time).
        releases = release_points(best.graph, best.timeline, allowed=lambda node: graph.has_node(node.id))
        entries = []
        for candidate in best.chosen:
            creator = graph.node(candidate.key.creator)
            entry: dict[str, Any] = {
                "action": candidate.action, "storage": str(candidate.key), "storage_creator": candidate.key.creator,
                "storage_output": candidate.key.output, "node": creator.id, "op": creator.op_name,
                "bytes": candidate.memory, "inactive_seconds": candidate.inactive_time,
                "overhead_seconds": candidate.overhead,
            }  # fmt: skip
            if candidate.action == SWAP:
                site = sites[candidate.key]
                assert candidate.prompt is not None
                prefetch_before = nodes[candidate.prompt].id
                release_before = releases.get(site.base)
                entry.update(prefetch_before=prefetch_before, offload_after=nodes[site.last_forward_use].id,
                             release_before=prefetch_before if release_before is None else release_before,
                             wait_before=site.wait_before, d2h_seconds=candidate.d2h_seconds,
                             h2d_seconds=candidate.h2d_seconds, stall_seconds=stalls.get(site.base, 0.0))  # fmt: skip
            else:
                entry.update(recompute_count=candidate.recompute_count, seconds=candidate.recompute_time,
                             total_seconds=candidate.total_recompute_time,
                             sources=sorted(k.creator for k in candidate.sources))  # fmt: skip
            entries.append(entry)
        clones = {clone for copies in best.rewrite.clones.values() for clone in copies}
        added = sum(seconds(best.graph.node(clone)) for clone in clones)
        iteration = seconds.iteration_seconds()
        exact = best.simulation
        met = exact.peak_bytes <= budget_bytes or budget.minimum
        return SwapPlan(fingerprint(graph), str(budget), budget_bytes, base.peak_bytes, exact.peak_bytes,
                        exact.peak_node, exact.peak_phase, iteration, met, best.timeline.seconds, added,
                        best.timeline.stall, seconds.scale, transfer.to_json(), entries,
                        len(candidates) - len(entries))  # fmt: skip
