"""Python's garbage collector during setup (mutwo.runtime.planning.collector): what existed before
is left out of its passes and given back after, what setup makes is still collected, and
``optimize()`` leaves the collector as it found it, also when it fails."""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Iterator

import pytest
import torch

import mutwo
from mutwo.runtime.planning.collector import (
    DEFERRED_THRESHOLD,
    collection_paused,
    full_collections_deferred,
    older_heap_frozen,
)
from tests import models


class _Cyclic:
    """An object that refers to itself: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


def _garbage_cycle() -> weakref.ref[_Cyclic]:
    """A cycle no one else holds, as a weak reference (dead once collected)."""
    return weakref.ref(_Cyclic())


@pytest.fixture(autouse=True)
def _collector_as_found() -> Iterator[None]:
    enabled, frozen, thresholds = gc.isenabled(), gc.get_freeze_count(), gc.get_threshold()
    yield
    gc.unfreeze() if not frozen else None
    gc.enable() if enabled else gc.disable()
    gc.set_threshold(*thresholds)


def test_older_cycles_wait_until_setup_ends_and_new_ones_are_collected() -> None:
    older = _garbage_cycle()
    with older_heap_frozen():
        assert gc.get_freeze_count() > 0
        newer = _garbage_cycle()
        gc.collect()
        assert newer() is None  # what setup makes is collected as before
        assert older() is not None  # the frozen heap is not walked
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert older() is None


def _walked(thing: object) -> bool:
    """Whether the collector walks ``thing``: it is in a generation, not frozen."""
    return any(o is thing for o in gc.get_objects())


def test_objects_the_user_froze_stay_frozen() -> None:
    """Told apart object by object: the count of frozen objects drops whenever one of them is freed,
    by any thread (pytest-xdist's own, in CI)."""
    users = [[]]
    gc.freeze()
    made_after = [[]]
    with older_heap_frozen():
        assert not _walked(users) and _walked(made_after)  # nothing unfrozen, nothing more frozen
    assert not _walked(users) and _walked(made_after) and gc.get_freeze_count() > 0


def test_collection_pauses_and_comes_back_as_it_was() -> None:
    with collection_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    with collection_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()  # the user's choice, kept


def test_garbage_from_before_setup_is_freed_when_setup_ends() -> None:
    """As a step dropped for a new capture may be: setup's last collection sees the whole heap."""
    holder = _Cyclic()
    holder.tensor = torch.zeros(1024)  # type: ignore[attr-defined]
    older = weakref.ref(holder)
    gc.collect()  # alive: it moves to the oldest generation
    del holder
    workload = models.mlp()
    optimizer = torch.optim.SGD(workload.model.parameters(), lr=0.1)
    mutwo.optimize(workload.model, optimizer, workload.batch, workload.loss_fn, cache=False)
    assert older() is None


@pytest.mark.parametrize("budget", [None, 1e-6])
def test_optimize_leaves_the_collector_as_it_found_it(budget: float | None) -> None:
    """Whether setup ends with a step or with an error (a budget out of reach)."""
    workload = models.mlp()
    optimizer = torch.optim.SGD(workload.model.parameters(), lr=0.1)
    arguments = (workload.model, optimizer, workload.batch, workload.loss_fn)
    if budget is None:
        mutwo.optimize(*arguments, cache=False)
    else:
        with pytest.raises(Exception, match="budget"):
            mutwo.optimize(*arguments, budget=budget, cache=False)
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_deferred_full_collections_leave_the_young_ones_and_come_back() -> None:
    """In a heap frozen as setup freezes it: young cycles are still collected on their own; a
    cycle that reached the oldest generation waits while objects pile up there, as a compile's
    do; once the thresholds are back the collector's own rule collects it."""
    gc.collect()
    gc.freeze()
    gc.collect()  # what is left to walk: next to nothing
    thresholds = gc.get_threshold()
    with full_collections_deferred():
        assert gc.get_threshold() == (thresholds[0], thresholds[1], DEFERRED_THRESHOLD)
        young = _garbage_cycle()
        for _ in range(20 * thresholds[0]):  # allocations enough for young collections to run
            _Cyclic()
        assert young() is None
        kept = [_Cyclic() for _ in range(10 * thresholds[0])]  # alive, as a compile's objects are
        old = _Cyclic()
        gc.collect(1)  # both survive a young collection: in the oldest generation
        held = weakref.ref(old)
        del old  # now garbage, in the oldest generation
        for _ in range(50 * thresholds[0] * thresholds[1]):  # past the oldest generation's usual threshold
            _Cyclic()
        assert gc.get_count()[2] > thresholds[2] and held() is not None  # no full collection ran
    assert gc.get_threshold() == thresholds
    for _ in range(20 * thresholds[0]):
        _Cyclic()
    assert held() is None and len(kept) == 10 * thresholds[0]  # the full collection that waited ran


@pytest.mark.parametrize("state", ["disabled", "threshold 0"])
def test_full_collections_are_left_alone_where_the_collector_does_not_run_on_its_own(state: str) -> None:
    gc.disable() if state == "disabled" else gc.set_threshold(0)
    thresholds = gc.get_threshold()
    with full_collections_deferred():
        assert gc.get_threshold() == thresholds
    assert gc.get_threshold() == thresholds


@pytest.mark.parametrize("fails", [False, True])
def test_a_compile_defers_full_collections(monkeypatch: pytest.MonkeyPatch, fails: bool) -> None:
    """optimize()'s compile stage runs with full collections deferred, and the thresholds are back
    after it, also when the compile fails."""
    from mutwo.runtime.execution.step import GraphStep

    seen: list[int] = []
    real = GraphStep.compile

    def compile(self: GraphStep, inputs: list[torch.Tensor]) -> object:
        seen.append(gc.get_threshold()[2])
        if fails:
            raise RuntimeError("compile failed")
        return real(self, inputs)

    monkeypatch.setattr(GraphStep, "compile", compile)
    thresholds = gc.get_threshold()
    workload = models.mlp()
    optimizer = torch.optim.SGD(workload.model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="compile failed") if fails else contextlib.nullcontext():
        mutwo.optimize(workload.model, optimizer, workload.batch, workload.loss_fn, cache=False)
    assert seen == [DEFERRED_THRESHOLD]
    assert gc.get_threshold() == thresholds
