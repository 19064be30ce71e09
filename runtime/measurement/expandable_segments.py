"""The CUDA caching allocator's expandable segments, which mutwo turns on for the steps it plans.

What a planned step makes the process hold is its allocated peak plus what the allocator keeps
around it: blocks of cached segments that no request fits, and, under a CUDA-graph backend, the
slack of the recording's private pool. Calibration meets the budget in held memory, so every MiB
of that slack is paid for in recomputation. With ``expandable_segments:True`` the allocator maps
pages into one growing segment per stream instead of allocating a segment per request size,
and the slack mostly goes: GPT-2 small b8 planned at per-layer checkpointing's held memory under
``inductor-cudagraphs`` (H200, torch 2.11, ``bench/h100_campaign.sh pool-excess``,
``bench/results/session27_gpus/``) held 576 MiB over its allocated peak with the default
allocator and 99 MiB with expandable segments, at the same step time (182.7 and 182.1 ms); the
same model's checkpointed eager step held 1,000 MiB less with them too. torchtitan's launch script
sets the same option.

The setting is process-wide, so mutwo leaves it alone when the user configured the allocator:
``PYTORCH_CUDA_ALLOC_CONF`` or ``PYTORCH_ALLOC_CONF`` set, whatever it says (an explicit
``expandable_segments:False`` is how to keep the default allocator), or settings given at run time,
or another allocator backend. ``max_split_size_mb`` together with expandable segments makes torch's
cache grow without bound (pytorch/pytorch#123548).
It applies to segments created after it is set: what the model and optimizer already hold stays
where it is.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

#: The environment variables torch reads its allocator settings from (the second is torch 2.9+'s name).
ALLOCATOR_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
_OPTION = "expandable_segments"
#: The benchmarks' ``--allocator`` choices: the settings every variant's process gets, so that
#: held memory is compared at equal allocators (expandable: as mutwo sets them in its own process).
ALLOCATORS = {"expandable": f"{_OPTION}:True", "default": f"{_OPTION}:False"}
#: What :func:`use_expandable_segments` says when it switched them on: a change to the whole process.
SWITCHED_ON = ("allocator: expandable segments on (new memory is mapped into growing segments, so the step holds "
               "little over what it allocates); PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False keeps the default")


def user_allocator_settings() -> str | None:
    """``NAME=value`` of the allocator settings the user gave in the environment; None when none."""
    for name in ALLOCATOR_VARIABLES:
        value = os.environ.get(name, "").strip()
        if value:
            return f"{name}={value}"
    return None


def _native() -> bool:
    """Whether torch's own caching allocator serves CUDA (not cudaMallocAsync, not a pluggable one)."""
    return torch.cuda.memory.get_allocator_backend() == "native"


def _snapshot_settings() -> dict[str, Any]:
    """The allocator settings a memory snapshot reports (torch 2.11 has no getter for them); {}
    where none can be taken: no CUDA in use, or an allocator that refuses snapshots."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized() and _native()):
        return {}
    try:
        return dict(torch.cuda.memory._snapshot().get("allocator_settings", {}))
    except RuntimeError:
        return {}


def current_settings() -> str:
    """The allocator settings last given to this process, as torch reports them ('' where it cannot):
    the environment's at start, or those set at run time since."""
    get = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if get is not None:
        return str(get())
    # torch 2.11 and 2.12 have no getter; a memory snapshot reports the settings last given
    # (measured on an H200 with torch 2.11).
    reported = _snapshot_settings().get("PYTORCH_CUDA_ALLOC_CONF")
    if reported is not None:
        return str(reported)
    given = user_allocator_settings()
    return given.split("=", 1)[1] if given is not None else ""


def expandable_segments_on() -> bool:
    """Whether the caching allocator maps new memory in expandable segments: the flag in force
    where a snapshot reports it (settings given later without the option leave it on, torch's
    parser never resets it), else the last word on it in the settings last given."""
    live = _snapshot_settings().get(_OPTION)
    if isinstance(live, bool):
        return live
    value = False
    for option in current_settings().split(","):
        key, _, setting = option.partition(":")
        if key.strip() == _OPTION:
            value = setting.strip().lower() == "true"
    return value


def apply_settings(settings: str) -> None:
    """Give torch's allocator ``settings`` at run time (the options they name; others stay)."""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is not None:
        setter(settings)
        return
    with warnings.catch_warnings():  # deprecated in favour of the one above, which older torch lacks
        warnings.simplefilter("ignore", FutureWarning)
        torch.cuda.memory._set_allocator_settings(settings)


def use_expandable_segments(device: torch.device) -> str | None:
    """On CUDA, turn on expandable segments unless the user configured the allocator (in the
    environment or at run time); a line for the log saying what was done (None when nothing was,
    or nothing needs saying: the CPU, or expandable segments already on)."""
    if device.type != "cuda":
        return None
    backend = torch.cuda.memory.get_allocator_backend()
    if backend != "native":  # cudaMallocAsync, or a pluggable allocator: torch's caching allocator is not in use
        return f"allocator: {backend}, left as it is (expandable segments are the native allocator's)"
    if expandable_segments_on():
        return None
    current = current_settings()
    given = user_allocator_settings() or (f"set at run time: {current}" if current else None)
    if given is not None:  # max_split_size_mb with them grows the cache without bound (pytorch#123548)
        return (f"allocator: left as configured ({given}); expandable_segments:True would let the step hold "
                "less over what it allocates")  # fmt: skip
    apply_settings(ALLOCATORS["expandable"])
    return SWITCHED_ON
