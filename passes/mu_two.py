"""The μ-TWO recomputation policy as pure functions over plain data (no torch, no graph).

Purandare et al., "μ-TWO: 3× Faster Multi-Model Training with Orchestration and Memory
Optimization" (MLSys 2023), recompute path of the scheduling algorithm, with the recompute
overhead and update procedures it adapts from Capuchin (Peng et al., ASPLOS 2020):

* every candidate activation has a size, recompute *sources* (the retained tensors its lineage
  starts from), a recompute time (its lineage's profiled time), a recompute count, a total
  recompute time and a recompute ratio = size / total recompute time;
* the greedy loop takes the candidate with the highest ratio, then
  - ``update_existing_recomps``: already chosen recomputations that used the new choice as a
    source inherit its sources and its recompute time, and each one adds to its recompute count;
  - ``update_candidates``: remaining candidates that used it as a source inherit likewise; those
    that are a source of it have their total recompute time scaled by its recompute count;
  - a source whose recomputed copy is live again in the backward pass when the dependent tensor
    is needed is not inherited: the dependent tensor reads the copy.

One deliberate refinement: the loop only takes candidates that are idle at the current simulated
peak (their inactive interval covers it), because only those lower it; the peak is re-simulated
after every choice by the caller.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field


@dataclass
class Candidate:
    """One activation that may be recomputed; times in seconds, positions in ranks."""

    key: Hashable
    memory: int
    sources: set[Hashable]
    recompute_time: float
    inactive_start: int  #: last forward use
    first_backward_use: int
    last_backward_use: int
    recompute_count: int = 1
    total_recompute_time: float = 0.0
    inactive_time: float = 0.0
    ratio: float = 0.0

    def __post_init__(self) -> None:
        if not self.total_recompute_time:
            self.total_recompute_time = self.recompute_time
        self.update_ratio()

    def update_ratio(self) -> None:
        self.ratio = self.memory / max(self.total_recompute_time, 1e-12)

    def idle_at(self, rank: int) -> bool:
        """Whether dropping it lowers memory at ``rank`` (it sits idle there)."""
        return self.inactive_start < rank < self.first_backward_use

    def live_again_when(self, other: Candidate) -> bool:
        """Whether this tensor's recomputed copy is live when ``other`` is recomputed."""
        return self.first_backward_use <= other.first_backward_use <= self.last_backward_use


def update_existing_recomps(recomps: list[Candidate], chosen: Candidate) -> int:
    """Chosen recomputations that planned to read ``chosen`` now recompute it: they inherit its
    sources and time. Returns ``chosen``'s recompute count (1 + one per such recomputation)."""
    count = 1
    for recomp in recomps:
        if recomp is chosen or chosen.key not in recomp.sources or chosen.live_again_when(recomp):
            continue
        recomp.sources.discard(chosen.key)
        recomp.sources |= chosen.sources
        recomp.recompute_time += chosen.recompute_time
        recomp.total_recompute_time = recomp.recompute_count * recomp.recompute_time
        recomp.update_ratio()
        count += 1
    return count


def update_candidates(recomps: list[Candidate], chosen: Candidate, count: int, candidates: list[Candidate]) -> None:
    """Remaining candidates after ``chosen`` was taken with recompute count ``count``."""
    chosen.recompute_count = count
    chosen.total_recompute_time = count * chosen.recompute_time
    for candidate in candidates:
        if chosen.key in candidate.sources and not chosen.live_again_when(candidate):
            candidate.sources.discard(chosen.key)
            candidate.sources |= chosen.sources
            candidate.recompute_time += chosen.recompute_time
            candidate.total_recompute_time = candidate.recompute_time
            for recomp in recomps:
                if candidate.key in recomp.sources:
                    candidate.total_recompute_time += candidate.recompute_time
        if candidate.key in chosen.sources:
            candidate.total_recompute_time = count * candidate.recompute_time
        candidate.update_ratio()


@dataclass
class GreedyResult:
    chosen: list[Candidate] = field(default_factory=list)
    peak: int = 0
    steps: int = 0


def greedy(
    remaining: list[Candidate],
    budget: int,
    peak_after: Callable[[Candidate], tuple[int, int]],
    current_peak: tuple[int, int],
    state: GreedyResult,
    max_steps: int | None = None,
) -> bool:
    """Choose recomputations until the peak is at most ``budget``, nothing lowers it, or
    ``max_steps`` were taken.

    ``remaining`` loses the chosen candidates and ``state`` gains them, so a caller can go on
    with a lower budget. ``peak_after(candidate)`` records that the candidate is dropped and
    returns the new simulated (peak bytes, peak rank). Returns whether anything was chosen.
    """
    peak, peak_rank = current_peak
    state.peak = peak
    grew = False
    steps = 0
    while peak > budget and (max_steps is None or steps < max_steps):
        useful = [c for c in remaining if c.idle_at(peak_rank)]
        if not useful:
            break
        best = max(useful, key=lambda c: (c.ratio, c.memory))
        remaining.remove(best)
        state.chosen.append(best)
        count = update_existing_recomps(state.chosen, best)
        update_candidates(state.chosen, best, count, remaining)
        peak, peak_rank = peak_after(best)
        state.peak = peak
        state.steps += 1
        steps += 1
        grew = True
    return grew


def search(budget: int, chunk: int, grow: Callable[[int, int | None], bool], best_peak: Callable[[], int],
           lowest: bool = True) -> None:  # fmt: skip
    """The outer loop of selection: choose towards ``budget`` and, when that is out of reach, go on
    towards the lowest peak (target 0), ``chunk`` choices at a time, which a failure then reports.

    ``grow(target, max_steps)`` makes choices from the estimate, checks the plan by exact
    simulation and returns whether it chose anything; ``best_peak()`` is the lowest exactly
    simulated peak so far. Towards a budget the estimate leads and exact checks correct it (it
    ignores transients); towards the lowest peak an exact check every chunk finds where more
    choices stop paying off. With ``lowest=False`` it stops at the budget.

    Towards ``min`` (``budget`` 0) it first steps down through tenths of the starting peak as
    budgets, each exactly checked: heading straight for 0, ``chunk`` choices made from an estimate
    that drifts between checks ended higher than a fraction budget's search did (a tiny MLP: 251.5
    KB at ``min``, 246.5 KB at 0.9).
    """
    start = best_peak()
    steps = [start * tenths // 10 for tenths in range(9, 0, -1)] if budget == 0 and lowest else []
    for target in (*steps, budget, 0) if lowest else (budget,):
        for _attempt in range(8 if target else 64):
            grew = grow(target, None if target else chunk)
            if best_peak() <= target or not grew:
                break
        if best_peak() <= budget:
            break
