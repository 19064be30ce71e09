"""Shared pytest configuration: CUDA tests are skipped on machines without a GPU; the plan cache
is off unless a test gives it a folder; one thread per test worker; ``one_rank``; ``evenly_timed``."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed as dist


def pytest_configure(config: pytest.Config) -> None:
    # mutwo.optimize and mutwo-opt keep plans in ~/.cache/mutwo by default: a test must neither
    # reuse a plan an earlier test or run kept (one made from a patched profile, say) nor write
    # there, and subprocesses inherit this. The plan cache's own tests give it a folder.
    os.environ["MUTWO_CACHE"] = "off"
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # `make test` runs one worker per core: with torch's default of a thread per core in each
        # worker (and in the ranks and tools they start), the threads outnumber the cores and
        # every test slows (test_rewrite.py and test_capture.py: 189 s, 155 s with one thread).
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The longest tests first: with one thread per worker, a long test left for last runs on one
    # core while the other idles (the suite's last minutes), so they start while others remain.
    items.sort(key=lambda item: "slow" not in item.keywords)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def one_rank() -> Iterator[None]:
    """A gloo process group of one rank in this process."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def evenly_timed(monkeypatch: pytest.MonkeyPatch) -> Callable[[ModuleType], None]:
    """``evenly_timed(module)``: the ``profile_graph`` that ``module`` calls prices every node at
    1 ms, so that a plan follows from the graph alone, not from how loaded the machine measuring
    it is (its memory readings stay measured)."""

    def patch(module: ModuleType) -> None:
        measured = module.profile_graph

        def evenly(*args: Any, **kwargs: Any) -> Any:
            profile = measured(*args, **kwargs)
            for node in profile.nodes.values():
                node.seconds = 1e-3
            return profile

        monkeypatch.setattr(module, "profile_graph", evenly)

    return patch
