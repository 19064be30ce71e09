"""The μ-TWO bookkeeping on hand-built candidates (no torch): counts, sources, times, ratios.

The chain of the paper's running example: W, x -> a -> b -> c (forward order), so the backward
needs c first, then b, then a. Times are 1 s each unless said otherwise; sizes make the ratios
easy to follow.
"""

from __future__ import annotations

import pytest

from mutwo.passes.mu_two import Candidate, GreedyResult, greedy, update_candidates, update_existing_recomps


def chain() -> dict[str, Candidate]:
    return {
        "a": Candidate("a", memory=100, sources={"W", "x"}, recompute_time=1.0, inactive_start=1,
                       first_backward_use=10, last_backward_use=12),
        "b": Candidate("b", memory=400, sources={"a"}, recompute_time=1.0, inactive_start=2,
                       first_backward_use=8, last_backward_use=9),
        "c": Candidate("c", memory=50, sources={"b"}, recompute_time=1.0, inactive_start=3,
                       first_backward_use=6, last_backward_use=7),
    }  # fmt: skip


def choose(recomps: list[Candidate], remaining: list[Candidate], chosen: Candidate) -> int:
    remaining.remove(chosen)
    recomps.append(chosen)
    count = update_existing_recomps(recomps, chosen)
    update_candidates(recomps, chosen, count, remaining)
    return count


def test_initial_ratios_are_memory_over_total_recompute_time() -> None:
    c = chain()
    assert (c["a"].ratio, c["b"].ratio, c["c"].ratio) == (100.0, 400.0, 50.0)
    assert all(x.recompute_count == 1 and x.total_recompute_time == 1.0 for x in c.values())


def test_choosing_b_then_a_recomputes_a_twice_and_moves_c_sources() -> None:
    c = chain()
    recomps: list[Candidate] = []
    remaining = list(c.values())
    # b first: c planned to recompute from b, so c inherits b's sources and b's time.
    assert choose(recomps, remaining, c["b"]) == 1
    assert c["c"].sources == {"a"} and c["c"].recompute_time == 2.0
    # a is a source of b: its total recompute time is scaled by b's count (1).
    assert c["a"].total_recompute_time == 1.0
    # then a: b (already chosen) recomputes a as well, so a is recomputed twice.
    assert choose(recomps, remaining, c["a"]) == 2
    assert c["a"].recompute_count == 2 and c["a"].total_recompute_time == 2.0
    assert c["b"].sources == {"W", "x"} and c["b"].recompute_time == 2.0
    # c moves to a's sources too and pays a's time: 1 (c) + 1 (b) + 1 (a).
    assert c["c"].sources == {"W", "x"} and c["c"].recompute_time == 3.0
    assert c["c"].ratio == pytest.approx(50 / 3.0)


def test_a_source_live_again_in_backward_is_not_inherited() -> None:
    c = chain()
    # Make a's recomputed copy live when b is needed: a is recomputed at 7 and used until 12.
    c["a"].first_backward_use, c["a"].last_backward_use = 7, 12
    recomps: list[Candidate] = []
    remaining = list(c.values())
    choose(recomps, remaining, c["b"])
    count = choose(recomps, remaining, c["a"])
    assert count == 1  # b reads a's live copy instead of recomputing a again
    assert c["b"].sources == {"a"} and c["b"].recompute_time == 1.0


def test_candidate_that_is_a_source_of_a_chosen_tensor_pays_its_count() -> None:
    c = chain()
    recomps: list[Candidate] = []
    remaining = list(c.values())
    choose(recomps, remaining, c["c"])  # c's sources: {b}
    assert c["b"].total_recompute_time == 1.0  # count of c is 1
    # Now b is chosen: c inherits a; b's count is 2 (itself and for c).
    assert choose(recomps, remaining, c["b"]) == 2
    assert c["c"].sources == {"a"} and c["c"].recompute_time == 2.0
    assert c["b"].recompute_count == 2 and c["b"].total_recompute_time == 2.0


def test_greedy_takes_the_best_ratio_among_candidates_idle_at_the_peak_and_stops_at_the_budget() -> None:
    c = chain()
    peaks = iter([(900, 5), (850, 5)])
    state = GreedyResult()
    remaining = list(c.values())
    grew = greedy(remaining, 900, lambda cand: next(peaks), (1000, 5), state)
    assert grew and [x.key for x in state.chosen] == ["b"]  # b has the best ratio; all are idle at rank 5
    assert state.peak == 900 and state.steps == 1
    grew = greedy(remaining, 860, lambda cand: next(peaks), (900, 5), state)
    assert [x.key for x in state.chosen] == ["b", "a"] and state.peak == 850


def test_greedy_stops_when_no_candidate_is_idle_at_the_peak() -> None:
    c = chain()
    state = GreedyResult()
    # Rank 11 lies after every inactive interval (they end at 6, 8, 10): nothing lowers it.
    assert not greedy(list(c.values()), 0, lambda cand: (0, 0), (1000, 11), state)
    assert state.chosen == [] and state.peak == 1000
