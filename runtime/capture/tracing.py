"""The environment a training step is traced in, and readable errors when tracing fails."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import logging
import os
from collections.abc import Iterator

import torch

from mutwo.ir.pass_manager import describe_frame, innermost_frame

_TORCH_DIR = os.path.dirname(torch.__file__)
# mutwo's capturing machinery, wherever it is installed (the source folders in an editable install,
# site-packages/mutwo/... from a wheel): frames there are never the user's. mutwo.tools is not in
# it: the models it builds (the zoo's, the config wrappers) are model code whose line is worth naming.
_OWN_DIRS = tuple(os.path.dirname(importlib.util.find_spec(f"mutwo.{name}").origin) + os.sep  # type: ignore[union-attr,arg-type]
                  for name in ("ir", "passes", "runtime"))  # fmt: skip


class CaptureError(RuntimeError):
    """Tracing the training iteration failed; the message is one sentence for the user."""


def debug_enabled() -> bool:
    """Whether ``MUTWO_DEBUG=1`` (or ``mutwo-opt --debug``) asks for the tracebacks behind errors."""
    return os.environ.get("MUTWO_DEBUG", "") not in ("", "0")


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


@contextlib.contextmanager
def quiet_torch_errors() -> Iterator[None]:
    """Keep torch's fake-tensor logger from printing a traceback when an op's meta function fails
    while tracing: the failure reaches mutwo, which explains it in one sentence (``MUTWO_DEBUG=1``
    keeps torch's log)."""
    with quiet_loggers("torch._subclasses.fake_tensor"):
        yield


@contextlib.contextmanager
def quiet_loggers(*names: str) -> Iterator[None]:
    """Silence torch's loggers ``names`` (but their critical records) while inside, unless
    ``MUTWO_DEBUG=1``: for messages that say nothing a mutwo user can act on."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    if not debug_enabled():
        for logger in loggers:
            logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def forbid_value_dependent_shapes() -> None:
    """Inside a fake-tensor trace: make ops whose output shape depends on tensor values (``nonzero``,
    boolean-mask indexing, ``unique``) fail where the model calls them, instead of giving the graph
    symbolic sizes that every later step (lowering, memory accounting) would trip over."""
    shape_env = getattr(torch._guards.detect_fake_mode(), "shape_env", None)
    if shape_env is not None and hasattr(shape_env, "settings"):
        shape_env.settings = dataclasses.replace(shape_env.settings, allow_dynamic_output_shape_ops=False)


def _data_dependent_errors() -> tuple[type[BaseException], ...]:
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    return (DataDependentOutputException, DynamicOutputShapeException, GuardOnDataDependentSymNode)


def is_data_dependent(error: BaseException) -> bool:
    """True when ``error`` comes from Python code reading a tensor's value during tracing."""
    return isinstance(error, _data_dependent_errors())


def user_frame(error: BaseException) -> str:
    """``file:line in function: code`` of the innermost frame outside torch and mutwo."""
    frame = innermost_frame(error, lambda path: path.startswith((_TORCH_DIR, *_OWN_DIRS)))
    return describe_frame(frame) if frame is not None else "an unknown line (no frame outside torch and mutwo)"


def explain_capture_failure(error: BaseException) -> CaptureError:
    """Turn an exception raised while tracing into one clear sentence."""
    from torch._subclasses.fake_tensor import DynamicOutputShapeException

    where = user_frame(error)
    if isinstance(error, DynamicOutputShapeException):
        return CaptureError(
            f"the model's forward makes a tensor whose shape depends on tensor values ({error.func}), which a "
            f"graph of fixed shapes cannot capture: {where}; keep shapes fixed (multiply by the mask, torch.where) "
            "or move it out of the training step"
        )
    if is_data_dependent(error):
        return CaptureError(
            "the model's forward has data-dependent control flow (it reads a tensor's value in "
            f"Python), which a graph cannot capture: {where}; compute that branch with tensor ops "
            "(torch.where) or move it out of the training step"
        )
    first_line = (str(error).strip().splitlines() or [""])[0]
    if "Cannot access data pointer of Tensor" in first_line:
        # cuDNN's recurrent layers (nn.LSTM/GRU/RNN on CUDA) pack their weights through raw pointers.
        return CaptureError(
            f"capturing the training step failed at {where}: a kernel there reads raw data pointers, which "
            "tracing over fake tensors cannot give (cuDNN's nn.LSTM/GRU/RNN do); mutwo cannot capture it on "
            "this device yet (recurrent layers capture on CPU)"
        )
    return CaptureError(f"capturing the training step failed at {where}: {type(error).__name__}: {first_line}")


_IS_COMPILING = torch.compiler.is_compiling


@contextlib.contextmanager
def not_compiling() -> Iterator[None]:
    """Inside :func:`compiler_tracing`, give code its eager paths back: torch.optim reads its step
    counts with ``.item()`` (which :mod:`mutwo.runtime.capture.host_scalars` keeps symbolic) only when it
    believes it is not being compiled."""
    patched = torch.compiler.is_compiling
    torch.compiler.is_compiling = _IS_COMPILING  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.compiler.is_compiling = patched  # type: ignore[assignment]
