"""The environment a training step is traced in, and readable errors when tracing fails."""

from __future__ import annotations

import contextlib
import importlib.util
import linecache
import os
import traceback
from collections.abc import Iterator

import torch

_TORCH_DIR = os.path.dirname(torch.__file__)
# mutwo's own sub-packages, wherever they are installed (the source folders in an editable install,
# site-packages/mutwo/... from a wheel): frames there are never the user's.
_OWN_DIRS = tuple(os.path.dirname(importlib.util.find_spec(f"mutwo.{name}").origin) + os.sep  # type: ignore[union-attr,arg-type]
                  for name in ("ir", "passes", "runtime", "tools"))  # fmt: skip


class CaptureError(RuntimeError):
    """Tracing the training iteration failed; the message is one sentence for the user."""


@contextlib.contextmanager
def compiler_tracing() -> Iterator[None]:
    """Make ``torch.compiler.is_compiling()`` answer True while the step is traced.

    Libraries guard data-dependent Python checks (transformers' ``torch.all(mask == 1)`` shortcut
    for attention masks, its padding warning that reads ``input_ids``) behind this flag, because
    torch.compile cannot trace them either; make_fx cannot, for the same reason. Setting it
    gives every such library the code path it already keeps for graph capture, instead of
    patching one model's helpers.
    """
    original = torch.compiler.is_compiling
    torch.compiler.is_compiling = lambda: True  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.compiler.is_compiling = original  # type: ignore[assignment]


def _data_dependent_errors() -> tuple[type[BaseException], ...]:
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    return (DataDependentOutputException, DynamicOutputShapeException, GuardOnDataDependentSymNode)


def is_data_dependent(error: BaseException) -> bool:
    """True when ``error`` comes from Python code reading a tensor's value during tracing."""
    return isinstance(error, _data_dependent_errors())


def user_frame(error: BaseException) -> str:
    """``file:line in function: code`` of the innermost frame outside torch and mutwo."""
    frames = traceback.extract_tb(error.__traceback__)
    for frame in reversed(frames):
        path = os.path.abspath(frame.filename)
        if path.startswith(_TORCH_DIR) or path.startswith(_OWN_DIRS) or "<" in frame.filename:
            continue
        code = (frame.line or linecache.getline(frame.filename, frame.lineno or 0)).strip()
        return f"{frame.filename}:{frame.lineno} in {frame.name}: {code}"
    return "an unknown line (no frame outside torch and mutwo)"


def explain_capture_failure(error: BaseException) -> CaptureError:
    """Turn an exception raised while tracing into one clear sentence."""
    where = user_frame(error)
    if is_data_dependent(error):
        return CaptureError(
            "the model's forward has data-dependent control flow (it reads a tensor's value in "
            f"Python), which a graph cannot capture: {where}; compute that branch with tensor ops "
            "(torch.where) or move it out of the training step"
        )
    first_line = (str(error).strip().splitlines() or [""])[0]
    return CaptureError(f"capturing the training step failed at {where}: {type(error).__name__}: {first_line}")


_IS_COMPILING = torch.compiler.is_compiling


@contextlib.contextmanager
def not_compiling() -> Iterator[None]:
    """Inside :func:`compiler_tracing`, give code its eager paths back: torch.optim reads its step
    counts with ``.item()`` (which :mod:`mutwo.runtime.host_scalars` keeps symbolic) only when it
    believes it is not being compiled."""
    patched = torch.compiler.is_compiling
    torch.compiler.is_compiling = _IS_COMPILING  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.compiler.is_compiling = patched  # type: ignore[assignment]
