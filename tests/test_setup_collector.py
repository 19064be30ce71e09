"""Python's garbage collector during setup (mutwo.runtime.planning.collector): what existed before
is left out of its passes and given back after, what setup makes is still collected, and
``optimize()`` leaves the collector as it found it, also when it fails."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest
import torch

import mutwo
from mutwo.runtime.planning.collector import collection_paused, older_heap_frozen
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
    enabled, frozen = gc.isenabled(), gc.get_freeze_count()
    yield
    gc.unfreeze() if not frozen else None
    gc.enable() if enabled else gc.disable()


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


def test_objects_the_user_froze_stay_frozen() -> None:
    gc.freeze()
    frozen = gc.get_freeze_count()
    with older_heap_frozen():
        assert gc.get_freeze_count() == frozen
    assert gc.get_freeze_count() == frozen


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
