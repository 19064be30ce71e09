"""How much memory the process may hold on a device, and capping it as a smaller card would.

``torch.cuda.set_per_process_memory_fraction`` makes the caching allocator refuse (with an
out-of-memory error) any allocation that would take what the process has reserved past the
fraction of the card: the same failure a card of that size gives. mutwo's memory limit
(``memory_limit=`` of the API, ``--memory-limit`` of mutwo-opt) sets it, so that a user can
rehearse a smaller card on a larger one, and planning reads it back, so that a cap set by the
user's own code is honoured too.
"""

from __future__ import annotations

import gc

import torch

from mutwo.ir.budget import readable_bytes


class MemoryLimitError(ValueError):
    """A memory limit that cannot be applied; the message says why."""


def _indexed(device: torch.device) -> torch.device:
    """``cuda`` as ``cuda:N`` (the current device): the allocator's settings are per device index."""
    return torch.device("cuda", torch.cuda.current_device()) if device.index is None else device


def device_capacity(device: torch.device) -> int | None:
    """The bytes the process may hold on ``device``: the card's memory times the per-process
    fraction in force (1 unless someone capped it). None on the CPU, which has no such cap."""
    if device.type != "cuda":
        return None
    device = _indexed(device)
    return int(torch.cuda.get_device_properties(device).total_memory * _fraction(device))


def process_cap(device: torch.device) -> int | None:
    """The bytes the process is capped at on ``device`` when a per-process fraction under 1 is in
    force (a memory limit, or the user's own ``set_per_process_memory_fraction``); None otherwise."""
    if device.type != "cuda" or _fraction(_indexed(device)) >= 1:
        return None
    return device_capacity(device)


def _fraction(device: torch.device) -> float:
    """The per-process memory fraction in force on ``device`` (1 where torch cannot say)."""
    return getattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 1.0)(device)


def apply_memory_limit(device: torch.device, limit: int) -> str:
    """Cap what the process may hold on ``device`` at ``limit`` bytes; a line for the log saying what
    was done. On the CPU nothing can be capped: the limit then bounds planning only."""
    if limit <= 0:
        raise MemoryLimitError(f"the memory limit must be a positive amount of bytes, like 16GiB; got {limit}")
    if device.type != "cuda":
        return (f"memory limit {readable_bytes(limit)}: on the CPU the process cannot be capped; planning stays "
                "within it")  # fmt: skip
    device = _indexed(device)
    total = torch.cuda.get_device_properties(device).total_memory
    if limit > total:
        raise MemoryLimitError(f"the memory limit {readable_bytes(limit)} is more than the {readable_bytes(total)} "
                               f"{torch.cuda.get_device_name(device)} has; give at most that")  # fmt: skip
    torch.cuda.set_per_process_memory_fraction(limit / total, device)
    return (f"memory limit {readable_bytes(limit)}: the process may hold at most that on {device} "
            f"({100 * limit / total:.1f}% of its {readable_bytes(total)}), as a card of that size would")


def lift_memory_limit(device: torch.device) -> None:
    """Undo :func:`apply_memory_limit`: the process may hold the whole card again."""
    if device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(1.0, _indexed(device))


def free_planning_leftovers(device: torch.device) -> None:
    """Collect what planning left and, on CUDA, give the allocator's cached blocks back, so that the
    process holds what the step needs, not what profiling, calibration or the check once did (on
    the H100, BERT-base b64's in-memory profile left 38 GB reserved under a 14 GB step)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        # The page-locked homes of an out-of-core profile, which torch caches rounded up to a power
        # of two (a private function; absent in some builds, where the cache is kept).
        host_empty_cache = getattr(torch._C, "_host_emptyCache", None)
        if host_empty_cache is not None:
            host_empty_cache()
