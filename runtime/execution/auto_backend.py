"""``backend="auto"``: the fastest backend that runs the step, chosen before anything is compiled.

The default of ``mutwo.optimize`` and ``mutwo-opt``. On the CPU it is ``eager``: bitwise equal to
the captured step, with no compile to wait for. On CUDA, fastest first (docs/backends.md):
``inductor-cudagraphs`` when a CUDA graph can record the step; ``inductor`` when it cannot;
``cudagraphs`` when the step can be recorded but Inductor cannot draw its random numbers as eager
does; else ``eager``. A data-parallel step is chosen for the same way (its steps are checked
against eager DDP and FSDP2 under every backend on two GPUs, docs/data-parallel.md): a CUDA graph
records its collectives where torch allows it, NCCL's, and where it does not (gloo) the refusal
says why (:func:`mutwo.runtime.parallel.distributed.backend_refusal`). A plan that swaps runs
under every backend (docs/swap.md), so swapping changes nothing here.

The choice is made from what the backends themselves check before compiling
(:func:`~mutwo.runtime.execution.cuda_graphs.refuse_uncapturable`,
:func:`~mutwo.runtime.execution.compiled_random.undrawable`, and a capture for CUDA graphs that
refuses an optimizer it cannot record: :mod:`mutwo.runtime.planning.auto_capture`), and said in one
line with why. It is no fallback: when the chosen backend then fails (a compile error, a plan it
refuses), the error is the one that backend named explicitly raises.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mutwo.ir.graph import Graph
from mutwo.ir.to_fx import to_fx
from mutwo.runtime.execution.backends import BACKENDS, BackendError
from mutwo.runtime.execution.compiled_random import undrawable
from mutwo.runtime.execution.cuda_graphs import refuse_uncapturable
from mutwo.runtime.measurement.iterations import device_of

AUTO = "auto"
#: What ``backend=`` and ``--backend`` accept: a backend, or ``auto`` (the default) to choose one.
BACKEND_CHOICES = (AUTO, *BACKENDS)


def check_backend_choice(name: str) -> str:
    """``name`` if it is a backend or ``auto``, else :class:`BackendError` naming the choices."""
    if name not in BACKEND_CHOICES:
        raise BackendError(f"unknown backend '{name}'; choose one of {', '.join(BACKEND_CHOICES)}")
    return name


@dataclass(frozen=True)
class StepFacts:
    """What the choice reads of a step: its ``device`` type, why a CUDA graph cannot record it
    (``unrecordable``) and why Inductor cannot draw its random numbers as eager does
    (``undrawable``): each None when they can."""

    device: str
    unrecordable: str | None = None
    undrawable: str | None = None


@dataclass(frozen=True)
class Choice:
    """The backend ``auto`` chose, and why (a phrase)."""

    backend: str
    why: str

    def sentence(self) -> str:
        """The line the log gets: ``backend auto: inductor-cudagraphs (CUDA, the step can be recorded)``."""
        return f"backend auto: {self.backend} ({self.why})"


def choose_backend(facts: StepFacts) -> Choice:
    """The fastest backend that runs a step with these ``facts`` (see the module docstring)."""
    if facts.device != "cuda":
        return Choice("eager", facts.device.upper())
    recorded = "CUDA, the step can be recorded" if facts.unrecordable is None \
        else f"CUDA; {_first_clause(facts.unrecordable)}"  # fmt: skip
    if facts.undrawable is None:
        return Choice("inductor-cudagraphs" if facts.unrecordable is None else "inductor", recorded)
    drawn = _first_clause(facts.undrawable)
    return Choice("cudagraphs" if facts.unrecordable is None else "eager", f"{recorded}; {drawn}")


def early_choice(device: torch.device) -> Choice | None:
    """The choice when the step's device decides it (not CUDA), before anything is captured; None
    when it depends on the captured step (:func:`step_facts`)."""
    if device.type == "cuda":
        return None
    return choose_backend(StepFacts(device.type))


def step_facts(graph: Graph, inputs: Sequence[torch.Tensor], unrecordable: str | None = None) -> StepFacts:
    """The facts of a captured step (``graph`` and its ``inputs``); ``unrecordable``: why a CUDA
    graph cannot record it when that is known already (its capture for one refused the optimizer,
    or its collectives run where a recording cannot go)."""
    device = device_of(list(inputs))
    if device.type != "cuda":
        return StepFacts(device.type)
    if unrecordable is None:
        try:
            refuse_uncapturable(graph, inputs)
        except BackendError as refusal:
            unrecordable = str(refusal)
    return StepFacts("cuda", unrecordable, undrawable(to_fx(graph), graph, "inductor"))


def _first_clause(reason: str) -> str:
    """A backend's refusal without its advice (what follows its first semicolon)."""
    return reason.split("; ")[0]
