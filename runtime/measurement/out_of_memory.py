"""Out-of-memory errors that say where mutwo was and what the process held.

torch's ``OutOfMemoryError`` says how much one allocation asked for; it does not say which of
mutwo's stages ran out (capturing the step, a planning pass, compiling, calibration, the check,
a training step), under which budget and memory limit, nor which setting to change. Every
``torch.OutOfMemoryError`` mutwo lets through gets one note (PEP 678) that says so: the stage,
the budget and memory limit, what the process held when it ran out (the allocator's allocated
and reserved bytes, and the per-process cap when one is in force) and the one fix that applies.
The exception keeps its type, so that ``except torch.OutOfMemoryError`` goes on catching it; the
innermost stage writes the note, once. mutwo-opt prints the note as its one-line error
(:func:`one_line`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from mutwo.ir.budget import Budget, readable_bytes
from mutwo.ir.pass_manager import PipelineFailure
from mutwo.runtime.measurement.device_memory import process_cap

#: How every note of this module begins (and how a noted error is recognised).
NOTE_PREFIX = "mutwo: out of device memory"


def add_note(error: BaseException, note: str) -> None:
    """``error.add_note(note)``; before Python 3.11, which shows no notes, ``__notes__`` as PEP 678
    defines it (the ``exceptiongroup`` backport and pytest show them)."""
    if hasattr(error, "add_note"):
        error.add_note(note)
    else:
        error.__notes__ = [*getattr(error, "__notes__", []), note]  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Stage:
    """What mutwo was doing when the device ran out of memory, in words that follow "out of
    device memory" (``doing``). ``runs_plan``: the planned step was running, so a lower budget
    makes it hold less; ``fix``: the fix, where it does not follow from the settings."""

    doing: str
    runs_plan: bool = False
    fix: str | None = None


CAPTURE = Stage("while capturing the step (creating the optimizer's state and the step's inputs)")
COMPILE = Stage("while compiling the step")
CALIBRATION = Stage("while calibrating the plan's peak (running the compiled step)", runs_plan=True)
CHOICE = Stage("while measuring the plans of the measured choice", runs_plan=True)
MEASURE = Stage("while measuring whole iterations of the planned step", runs_plan=True)
CHECK = Stage("while checking the optimized step against the captured one",
              fix="drop the check, which runs the captured step whole: check on a larger card")  # fmt: skip


def planning_pass(name: str) -> Stage:
    """The stage of the planning pass ``name`` (``profile`` runs the step to time it)."""
    return Stage(f"in the planning pass '{name}'")


def training_step(where: str) -> Stage:
    """A training step that ran out ``where`` (``in the backward``, ``during the step``...)."""
    return Stage(f"in a training step, {where}", runs_plan=True)


@dataclass(frozen=True)
class MemorySettings:
    """What a note names besides the stage: the device and the run's budget and memory limit."""

    device: torch.device
    budget: Budget | None = None
    memory_limit: int | None = None


def noted(error: BaseException) -> bool:
    """Whether ``error`` has this module's note already."""
    return any(str(note).startswith(NOTE_PREFIX) for note in getattr(error, "__notes__", []))


def note_out_of_memory(error: torch.OutOfMemoryError, stage: Stage, settings: MemorySettings) -> None:
    """Add the note (:func:`describe`) to ``error`` unless a stage inside this one has."""
    if not noted(error):
        add_note(error, describe(error, stage, settings))


@contextmanager
def stage_noted(stage: Stage, settings: MemorySettings) -> Iterator[None]:
    """A ``torch.OutOfMemoryError`` raised inside goes on with the note of ``stage``."""
    try:
        yield
    except torch.OutOfMemoryError as error:
        note_out_of_memory(error, stage, settings)
        raise


@contextmanager
def passes_noted(settings: MemorySettings) -> Iterator[None]:
    """Running planning passes: the pass manager reports a pass's exception as a
    :class:`PipelineFailure`; one that ran out of memory goes on as the ``torch.OutOfMemoryError``
    itself, noted with the pass's name (:func:`out_of_memory_in`)."""
    try:
        yield
    except PipelineFailure as failure:
        error = out_of_memory_in(failure, settings)
        if error is None:
            raise
        raise error from None


def out_of_memory_in(failure: PipelineFailure, settings: MemorySettings) -> torch.OutOfMemoryError | None:
    """The ``torch.OutOfMemoryError`` a pass raised, noted with its stage; None when ``failure``
    is not one."""
    if not isinstance(failure.cause, torch.OutOfMemoryError):
        return None
    note_out_of_memory(failure.cause, planning_pass(failure.pass_name), settings)
    return failure.cause


def describe(error: BaseException, stage: Stage, settings: MemorySettings) -> str:
    """The note, one line: ``mutwo: out of device memory <stage> (asking for 3.73 GiB more), at
    budget 0.5 of the unoptimized peak and memory limit 16,384.0 MiB; the process held 15,020.0 MiB
    allocated and 16,300.0 MiB reserved on cuda:0, capped at 16,384.0 MiB: lower the budget``."""
    asked = re.search(r"Tried to allocate ([0-9.]+ [KMGT]?i?B)", str(error))
    more = f" (asking for {asked.group(1)} more)" if asked else ""
    limit = settings.memory_limit
    limit_text = f"memory limit {readable_bytes(limit)}" if limit is not None else "no memory limit"
    return (f"{NOTE_PREFIX} {stage.doing}{more}, at {_budget_text(settings.budget)} and {limit_text}; "
            f"{_held_text(settings.device)}: {_fix(stage, settings)}")  # fmt: skip


def one_line(error: BaseException) -> str:
    """What mutwo-opt prints for ``error``, a ``torch.OutOfMemoryError``: its note without the
    ``mutwo:`` prefix, or torch's first line when no stage noted it."""
    note = next((str(n) for n in getattr(error, "__notes__", []) if str(n).startswith(NOTE_PREFIX)), None)
    if note is not None:
        return note.removeprefix("mutwo: ")
    first = (str(error).strip().splitlines() or [""])[0]
    return f"out of device memory: {first}" if first else "out of device memory"


def _budget_text(budget: Budget | None) -> str:
    if budget is None:
        return "no budget (planned for the device's memory)"
    if budget.minimum:
        return "budget min"
    if budget.fraction is not None:
        return f"budget {budget.fraction:g} of the unoptimized peak"
    assert budget.bytes is not None
    return f"budget {readable_bytes(budget.bytes)}"


def _held_text(device: torch.device) -> str:
    """What the process held on ``device`` just now, from the caching allocator."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"the step runs on {device}, whose allocator keeps no count of what the process holds"
    cap = process_cap(device)
    capped = f", capped at {readable_bytes(cap)}" if cap is not None else ", with no per-process cap"
    return (f"the process held {readable_bytes(torch.cuda.memory_allocated(device))} allocated and "
            f"{readable_bytes(torch.cuda.memory_reserved(device))} reserved on {device}{capped}")  # fmt: skip


def _fix(stage: Stage, settings: MemorySettings) -> str:
    """The one fix for running out at ``stage``: where the planned step ran, a lower budget (a
    smaller batch once it is ``min``); before it runs, what the model, its state, the batch and the
    compiler need must fit: a higher memory limit where one is set, else a smaller batch."""
    if stage.fix is not None:
        return stage.fix
    budget = settings.budget
    if stage.runs_plan:
        if budget is None:
            return "give a budget under the device's memory (budget=, --budget)"
        if not budget.minimum:
            return "lower the budget (budget=, --budget)"
        return "use a smaller batch: the budget is already min, the lowest peak recomputation reaches"
    if settings.memory_limit is not None:
        return "raise the memory limit (memory_limit=, --memory-limit)"
    return "use a smaller batch"
