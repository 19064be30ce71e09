"""What the backends raise: kept apart from :mod:`mutwo.runtime.execution.backends` so that the
modules it builds on (CUDA-graph recording, swap release points) can raise them without importing it."""

from __future__ import annotations


class BackendError(ValueError):
    """A backend cannot run this step; the message says why and what to do instead."""


class CompileError(BackendError):
    """Inductor failed on a step the backend accepted."""
