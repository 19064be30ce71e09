"""AOTAutograd's cache for steps that replay a batch norm or a dropout: mutwo's replay functions
marked cacheable, keyed by their source.

A recompute block replays a batch norm from its saved statistics
(:func:`~mutwo.ir.replay.batch_norm_from_stats`) and, under a compiled backend, a dropout from the
mask it drew (:func:`~mutwo.ir.mask_replay.dropout_from_mask`). Both are Python functions in the
graph handed to ``compile_fx``. AOTAutograd's cache accepts only torch's own functions and ops
there, so it bypassed every such graph ("Unsupported call_function target dropout_from_mask") and
re-traced the whole step at each start: about 13 s of the 22.9 s a restart of BERT-base b64 took on
the H100 (docs/plan-cache.md), where a plan without recompute through dropout hit the cache.

torch's ``unsafe_marked_cacheable_functions`` lets a function into that cache under a key the
caller gives. The key here is a digest of the source of the modules that define the functions and
the decomposition Inductor applies to their CUDA form (``batch_norm_elemt_decomposition``), so a
mutwo whose replay arithmetic changed never reads code compiled for the old one. Whether that
decomposition is installed (``backends.batch_norm_elemt_decomposed``: not where torch has its own)
follows torch's version, which the cache keys already. Without the source (an install of compiled
files only), mutwo's version stands in for it.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from types import ModuleType
from typing import Any

import mutwo.ir.mask_replay
import mutwo.ir.replay

#: The functions a planned graph may call that are not torch's, with the modules whose source
#: decides what they compute.
REPLAY_FUNCTIONS: tuple[tuple[Callable[..., Any], tuple[ModuleType, ...]], ...] = (
    (mutwo.ir.mask_replay.dropout_from_mask, (mutwo.ir.mask_replay,)),
    (mutwo.ir.replay.batch_norm_from_stats, (mutwo.ir.replay,)),
)


def qualified_name(function: Callable[..., Any]) -> str:
    """The name AOTAutograd's cache looks ``function`` up by: its module, a dot, its name."""
    return f"{function.__module__}.{function.__name__}"


@functools.cache
def replay_cache_keys() -> dict[str, str]:
    """``unsafe_marked_cacheable_functions`` entries for :data:`REPLAY_FUNCTIONS`: each function's
    qualified name to a digest of its modules' source (computed once per process)."""
    keys: dict[str, str] = {}
    for function, modules in REPLAY_FUNCTIONS:
        digest = hashlib.sha256()
        for module in modules:
            digest.update(_source(module).encode())
        keys[qualified_name(function)] = f"mutwo-replay-{digest.hexdigest()[:16]}"
    return keys


def _source(module: ModuleType) -> str:
    try:
        return inspect.getsource(module)
    except (OSError, TypeError):  # no source installed
        try:
            release = version("mutwo")
        except PackageNotFoundError:
            release = "unknown"
        return f"{module.__name__} of mutwo {release}"
