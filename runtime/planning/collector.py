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
collected as before, so the device memory of profiling or calibration that only a collection frees
is freed as before. Garbage that existed before setup waits until it ends, when setup's last
collection sees the whole heap. :func:`collection_paused` keeps the collector from running on its
own in stages that allocate no device memory. With both, the same restart spent 0.8-1.0 s in two
full collections, one of them setup's last.

A first start's compile is the longest stage of its setup, and there the heap grows: Inductor
keeps what it builds for a whole-iteration graph alive until the compile ends, and each full
collection walks all of it again. On an H200, ResNet-152-cl b128's first start spent 35.0 s of its
362.7 s in 21 full collections (``session31_h200/``); the first starts of ``session32_h200/``
place most of their full collections in the compile (``full_at``).
:func:`full_collections_deferred` leaves the young generations collected as always and holds the
full collections back until the compile ends. One Inductor compile of that step's captured graph
on this repository's 2-core CPU spent 9.9 s in 18 full collections; deferred, none, and 0.5 s more
in the one after it, with the process's peak 54 MiB (2%) higher (``bench/compile_collector.py``,
``bench/results/session32_cpu/``).
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


#: What the oldest generation's threshold is raised to while full collections are deferred: the
#: number of young collections before a full one, more than a compile makes (a ResNet-152 compile:
#: about 1,200).
DEFERRED_THRESHOLD = 1 << 30


@contextmanager
def full_collections_deferred() -> Iterator[None]:
    """While open, the collector collects the young generations as always, and none in full (its
    oldest generation's threshold, :func:`gc.set_threshold`, is raised); when it closes the
    thresholds are as they were, and at its next young collection the collector's own rule runs the
    full one that waited, once the objects that reached the oldest generation meanwhile are over a
    quarter of those it last walked, as after a first start's compile. For a compile: it allocates
    no device memory (autotuning's buffers are freed as they go out of use), and the objects it keeps
    alive until it ends are what each full collection walked again. Nothing changes where the
    collector is off or does not run on its own (a first threshold of 0), nor on a Python whose
    collector does not read the third threshold."""
    thresholds = gc.get_threshold()
    if not gc.isenabled() or thresholds[0] == 0:
        yield
        return
    gc.set_threshold(thresholds[0], thresholds[1], DEFERRED_THRESHOLD)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
