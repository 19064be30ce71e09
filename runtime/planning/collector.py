"""Python's cyclic garbage collector during a step's setup: the heap that was there before is left
out of its passes.

Setup (capturing the step with fake tensors, lowering it, the passes, loading the compiled step)
creates many short-lived Python objects, so the collector runs its full collection a few
times, and each walks every object the process holds: torch, transformers, the model (a
ResNet-152 restart from the plan cache: five full collections and 1.6-1.7 s of ``optimize()`` on
this repository's 2-core CPU, ``garbage_collector_in_optimize`` of
``bench/stock_optimizer_and_restart.py start``; ``bench/results/session31_cpu/``).
:func:`older_heap_frozen` moves the older objects out of the collector's sight (:func:`gc.freeze`)
for the length of setup and back afterwards (:func:`gc.unfreeze`); what setup creates is still
collected as before, so the device memory of profiling or calibration that only a collection
frees is freed as before. Garbage that
existed before setup waits until it ends, when setup's last collection sees the whole heap.
:func:`collection_paused` keeps the collector from running on its own in stages that allocate no
device memory. With both, the same restart spent 0.8-1.0 s in two full collections, one of them
setup's last.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def older_heap_frozen() -> Iterator[None]:
    """While open, the objects that existed when it opened are not traversed by the collector.

    It does nothing where the collector is off, or where objects are frozen already (by the user,
    or by an enclosing setup): :func:`gc.unfreeze` cannot give back only what this froze."""
    if not gc.isenabled() or gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextmanager
def collection_paused() -> Iterator[None]:
    """While open, the collector does not run on its own (:func:`gc.disable`); it runs again as before
    when it closes. For stages that allocate no device memory (capturing with fake tensors, passes
    that only rewrite the IR): their full collections found next to no garbage, and device memory
    that only a collection frees must not wait (a profile or an autotuning compile keeps it on)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
