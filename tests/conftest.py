"""Shared pytest configuration: CUDA tests are skipped on machines without a GPU; ``one_rank``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
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
