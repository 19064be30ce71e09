"""μ-TWO's scheduler with both of its tools, swap and recompute, as pure functions (no graph).

Purandare et al. (MLSys 2023), Algorithm B: while the simulated peak is over the budget, take the
candidate with the longest inactive time as the swap candidate and the one with the highest
recompute ratio as the recompute candidate; price the swap with the swap calculator (Algorithm C)
and the recomputation with its total recompute time (Algorithm D); choose the cheaper, update
the recompute bookkeeping (Algorithms E and F, :mod:`mutwo.passes.mu_two`) and re-simulate.

The swap calculator here simulates the two copy streams (:func:`mutwo.ir.timeline.schedule_transfers`)
instead of the paper's case analysis: a swap's overhead is how much it adds to the stalls of
every swap chosen so far, which covers queueing behind earlier copies in either direction and
recomputation that lengthens the backward pass. Its prompt (the node where the prefetch is
issued) is the latest one whose compute before the first backward use hides the copy in, but
never before the current peak (the copy would bring the tensor back while memory is tightest);
when even the earliest allowed prompt cannot hide it, the earliest is taken, and both are priced.
With an offload deadline (on CUDA by default, select-swap's offload_window of the forward pass), a
swap whose copy out, or one it delays, would end after it is not taken: copies in ran 17-29%
slower on the H100 while copies out ran beside them, which the copy streams' model does not price.

Two refinements, as in ``select``: only candidates idle at the current peak are taken, and a
candidate that cannot be recomputed has an infinite recompute time (it can still be swapped).
A swapped tensor that a chosen recomputation reads outside the swapped-in window must be
recomputed inside that block (Algorithm F for swaps); when it cannot be, the swap is refused.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from mutwo.ir.timeline import StreamSchedule, Transfer, schedule_transfers
from mutwo.passes.mu_two import Candidate, GreedyResult, update_candidates, update_existing_recomps

KEEP, RECOMPUTE, SWAP = "keep", "recompute", "swap"


@dataclass
class SwapCandidate(Candidate):
    """A candidate activation with what swapping it costs; ``recompute_time`` is infinite when it
    cannot be recomputed."""

    swappable: bool = False
    d2h_seconds: float = 0.0
    h2d_seconds: float = 0.0
    action: str = KEEP
    prompt: int | None = None  #: for a swap, the position before which its prefetch is issued
    overhead: float = 0.0  #: the price it was chosen at

    @property
    def recomputable(self) -> bool:
        return math.isfinite(self.recompute_time)


@dataclass
class Timeline:
    """The estimate of time the scheduler keeps: profiled node times (per position), the
    recomputations and swaps chosen so far, and whether copies overlap compute."""

    durations: list[float]
    overlap: bool
    #: the most one recomputation can cost: replaying the whole forward pass once. Capuchin's
    #: bookkeeping adds inherited lineages up, counting shared ancestors once per path; through
    #: chains of swapped tensors in residual networks that sum grows exponentially.
    ceiling: float = math.inf
    recomps: list[SwapCandidate] = field(default_factory=list)
    swaps: list[SwapCandidate] = field(default_factory=list)
    compute_slowdown: float = 0.0  #: the transfer model's (mutwo.ir.timeline)
    #: when every copy out must have ended (the end of the forward pass; infinite: no bound), so
    #: that the two directions do not share the link, which the copy streams' model does not price
    offload_deadline: float = math.inf
    _clock: list[float] | None = None
    _base: StreamSchedule | None = None

    def changed(self) -> None:
        self._clock = self._base = None

    def clock(self) -> list[float]:
        """``clock[p]``: when the ops issued before position ``p`` run, recompute blocks included."""
        if self._clock is None:
            extra = list(self.durations)
            for recomp in self.recomps:  # a block runs right before its first backward use, after the waits there
                extra[recomp.first_backward_use] += recomp.recompute_time
            self._clock = list(itertools.accumulate(extra, initial=0.0))
        return self._clock

    def schedule(self, extra: tuple[SwapCandidate, int] | None = None) -> StreamSchedule:
        """The copy streams with the chosen swaps (and ``extra``, a candidate and its prompt)."""
        if extra is None and self._base is not None:
            return self._base
        pairs = [(s, s.prompt) for s in self.swaps] + ([extra] if extra else [])
        transfers = [Transfer(c.inactive_start + 1, prompt, c.first_backward_use, c.d2h_seconds, c.h2d_seconds)
                     for c, prompt in pairs if prompt is not None]  # fmt: skip
        result = schedule_transfers(self.clock(), transfers, self.overlap, self.compute_slowdown)
        if extra is None:
            self._base = result
        return result

    @property
    def cost(self) -> float:
        """What the chosen swaps add to the iteration: stalls and contention."""
        return self.schedule().cost


def swap_overhead(timeline: Timeline, candidate: SwapCandidate, peak_rank: int) -> tuple[float, int]:
    """Algorithm C: the stall ``candidate``'s swap adds, and its prompt (see the module docstring)."""
    clock = timeline.clock()
    # The prompt falls after the offload and no later than the wait, wherever ``peak_rank`` is:
    # refinement passes the whole plan's peak, which may lie outside the candidate's idle window
    # (after its first backward use in a plan that mostly recomputes; an unclamped prompt there put
    # the prefetch after its wait, ResNet-152 on the H100, 2026-11-24).
    latest = candidate.first_backward_use
    earliest = min(max(peak_rank, candidate.inactive_start) + 1, latest)
    if timeline.overlap:
        just_in_time = bisect.bisect_right(clock, clock[latest] - candidate.h2d_seconds) - 1
        prompts = sorted({min(max(just_in_time, earliest), latest), earliest}, reverse=True)
    else:  # copies run on the compute timeline: nothing hides them, so bring the tensor back last
        prompts = [latest]
    base = timeline.cost
    schedules = [(timeline.schedule((candidate, p)), p) for p in prompts]
    if any(end > timeline.offload_deadline for _, end in schedules[0][0].copy_out):
        return math.inf, schedules[0][1]  # its copy out, or one it delays, would end after the deadline
    priced = [(schedule.cost - base, p) for schedule, p in schedules]
    overhead, prompt = min(priced, key=lambda pair: pair[0])  # ties: the later prompt, listed first
    return max(0.0, overhead), prompt


def blocked(candidate: SwapCandidate, recomps: list[SwapCandidate]) -> bool:
    """Whether swapping ``candidate`` would break a chosen recomputation: one reads it outside its
    swapped-in window, so must recompute it, and it cannot be recomputed."""
    return not candidate.recomputable and any(
        candidate.key in r.sources and not candidate.live_again_when(r) for r in recomps)


def reads_dropped(candidate: SwapCandidate, swaps: list[SwapCandidate]) -> bool:
    """Whether recomputing ``candidate`` would read a chosen swap's tensor outside its swapped-in
    window, which it would then have to recompute too, and that tensor cannot be recomputed (the
    converse of :func:`blocked`: here the swap was chosen first)."""
    return any(s.key in candidate.sources and not s.recomputable and not s.live_again_when(candidate) for s in swaps)


def choose(remaining: list[SwapCandidate], timeline: Timeline, peak_rank: int) -> SwapCandidate | None:
    """One choice of Algorithm B at the peak ``peak_rank``: the cheaper of the best swap and the best
    recomputation among the candidates idle there (its ``action``, ``prompt`` and ``overhead`` set)."""
    useful = [c for c in remaining if c.idle_at(peak_rank)]
    recomps = [c for c in useful if c.recomputable and not reads_dropped(c, timeline.swaps)]
    recompute = max(recomps, key=lambda c: (c.ratio, c.memory), default=None)
    swap, swap_price = None, (math.inf, None)
    # The longest idle swap whose copy out ends by the deadline: one that misses it now misses it
    # for good (chosen swaps only lengthen the queue of copies out), so it is no longer swappable.
    for candidate in sorted((c for c in useful if c.swappable and not blocked(c, timeline.recomps)),
                            key=lambda c: (c.inactive_time, c.memory), reverse=True):  # fmt: skip
        price = swap_overhead(timeline, candidate, peak_rank)
        if math.isfinite(price[0]):
            swap, swap_price = candidate, price
            break
        candidate.swappable = False
    recompute_price = math.inf if recompute is None else recompute.total_recompute_time
    if swap is not None and swap_price[0] < recompute_price:
        swap.action, swap.prompt, swap.overhead = SWAP, swap_price[1], swap_price[0]
        return swap
    if recompute is not None:
        recompute.action, recompute.overhead = RECOMPUTE, recompute_price
        return recompute
    return None


def schedule(
    remaining: list[SwapCandidate],
    timeline: Timeline,
    budget: int,
    peak_after: Callable[[SwapCandidate], tuple[int, int]],
    current_peak: tuple[int, int],
    state: GreedyResult,
    max_steps: int | None = None,
) -> bool:
    """Choose swaps and recomputations until the peak is at most ``budget``, nothing lowers it, or
    ``max_steps`` were taken (like :func:`mutwo.passes.mu_two.greedy`, whose contract it keeps).

    ``peak_after(candidate)`` records the choice in the memory estimate (a swap frees its bytes
    from its last forward use to its prompt, a recomputation to its first backward use) and
    returns the new (peak bytes, peak rank). Returns whether anything was chosen.
    """
    peak, peak_rank = current_peak
    state.peak = peak
    steps = 0
    while peak > budget and (max_steps is None or steps < max_steps):
        best = choose(remaining, timeline, peak_rank)
        if best is None:
            break
        remaining.remove(best)
        state.chosen.append(best)
        if best.action == SWAP:
            timeline.swaps.append(best)
        else:
            timeline.recomps.append(best)
        count = update_existing_recomps(timeline.recomps, best)
        update_candidates(timeline.recomps, best, count, remaining)
        for candidate in remaining:
            if candidate.recomputable and candidate.recompute_time > timeline.ceiling:
                candidate.recompute_time = timeline.ceiling
                candidate.total_recompute_time = min(candidate.total_recompute_time,
                                                     candidate.recompute_count * timeline.ceiling)  # fmt: skip
                candidate.update_ratio()
        timeline.changed()
        peak, peak_rank = peak_after(best)
        state.peak = peak
        state.steps += 1
        steps += 1
    return steps > 0
