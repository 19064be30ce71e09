"""Python numbers that a traced function computes from tensors, kept symbolic in the graph.

torch.optim computes its step sizes on the host: it reads the step count with ``.item()`` and the
learning rate from ``param_groups``, does Python ``float`` arithmetic on them (``lr / (1 - beta1 **
step)``) and passes the result to tensor ops as a Python number (``addcdiv_(..., value=-step_size)``).
Traced naively, those numbers become constants of the graph and the graph is only right for the
step it was traced at.

While :class:`HostScalarMode` is active, ``tensor.item()`` returns a :class:`HostScalar`: an
expression over the tensors read, which Python arithmetic extends (``1 - 0.9 ** step`` is still a
:class:`HostScalar`). A tensor op that receives one is recorded as one of three custom ops,
``mutwo::host_call`` (out of place), ``mutwo::host_call_`` (in place on a list) or
``mutwo::host_call_one_`` (in place on one tensor, returning it). Their arguments are the tensors
of the call, the tensors the numbers are read from, and a text description of the call with each
number's expression.

A multi-tensor call (``torch._foreach_addcdiv_(params, exp_avgs, denoms, step_sizes)``, one step
size per parameter) is recorded position by position instead, so that the optimizer passes can
split it by parameter (:mod:`mutwo.ir.multi_tensor`): each number becomes a 0-dim CPU tensor made
by ``mutwo::host_scalar`` from the tensors it reads (one per parameter: its own step count and the
learning rate), and the call becomes ``mutwo::foreach_host_call_`` (or ``foreach_host_call``)
whose every argument is a list with one entry per position; its text says which list feeds which
argument of the torch function. When the graph runs, the op reads those
tensors with ``.item()``, evaluates each expression with Python numbers — the very operations eager
torch.optim performs, in the same order, so the result is identical bit for bit — and calls the
original function. Step counts, learning rates, momentum and betas
(:data:`mutwo.runtime.capture.optim.SCHEDULED`) stay graph inputs, and a step count on the CPU costs no
device synchronisation (eager torch.optim reads it the same way).

A branch on such a number (``if rho_t > 5``: RAdam) is decided with the values the tensors hold
while tracing and recorded as a guard (:mod:`mutwo.runtime.capture.guards`); the step
checks its guards before every run and is captured again when one no longer holds. Converting
one to a Python ``float`` (``math.sqrt(x)``) cannot stay symbolic and is refused.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from mutwo.runtime.capture.host_call_ops import FOREACH_LISTS, encode_call, fake_call, function_name, written_by
from mutwo.runtime.capture.host_expressions import ACTIVE_MODES, HostScalar, Number, active_mode, checked_number
from mutwo.runtime.capture.tracing import CaptureError


def record_call(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Record ``func(*args, **kwargs)``, whose arguments hold :class:`HostScalar` s, as a lifted op;
    return what ``func`` would return to its caller."""
    if function_name(func).startswith("torch._foreach_"):
        return _record_foreach_call(func, args, kwargs)
    call = encode_call(func, args, kwargs)
    if not call.mutated:
        results = torch.ops.mutwo.host_call(call.text, call.tensors, call.sources)
        # The structure of the results, from the call on stand-in numbers, untraced: recorded, it
        # would stay in the graph, dead but run every step (resnet18's Adam on the CPU: one
        # parameter-sized division per parameter, 9% of the step).
        with disable_proxy_modes_tracing():
            fake = fake_call(call.text, [], call.tensors)
        _, spec = pytree.tree_flatten(fake)
        return pytree.tree_unflatten(list(results), spec)
    written = written_by(function_name(func), args, kwargs)
    if isinstance(written, torch.Tensor):
        torch.ops.mutwo.host_call_one_(written, call.text, call.tensors, call.sources)
    else:
        torch.ops.mutwo.host_call_(call.mutated, call.text, call.tensors, call.sources)
    # In-place tensor methods return the tensor they wrote; foreach functions return None.
    return written if isinstance(written, torch.Tensor) and function_name(func).startswith("Tensor.") else None


def _record_foreach_call(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Record a multi-tensor call position by position (see the module docstring)."""
    name = function_name(func)
    first = args[0] if args else None
    if not isinstance(first, (list, tuple)) or not first:
        raise CaptureError(f"the optimizer calls {name} with numbers computed from tensors and no list of "
                           "tensors first, which mutwo cannot record; please report it")  # fmt: skip
    positions = len(first)
    written = written_by(name, args, kwargs)
    lists: list[list[torch.Tensor]] = []

    def position_list(entries: list[torch.Tensor], kind: str) -> dict[str, int]:
        if len(lists) == FOREACH_LISTS:
            raise CaptureError(f"the optimizer calls {name} with more than {FOREACH_LISTS} lists, which mutwo "
                               "cannot record; please report it")  # fmt: skip
        lists.append(entries)
        return {kind: len(lists) - 1}

    def entry(value: Any) -> dict[str, Any]:
        if written is not None and value is written:
            return {"written": True}
        if isinstance(value, (list, tuple)) and len(value) == positions:
            if all(isinstance(v, torch.Tensor) for v in value):
                return position_list(list(value), "list")
            if all(isinstance(v, (HostScalar, int, float)) for v in value):
                return position_list([_scalar_tensor(v) for v in value], "scalars")
        if isinstance(value, HostScalar):
            return position_list([_scalar_tensor(value)] * positions, "scalar")
        if isinstance(value, torch.Tensor):
            return position_list([value] * positions, "one")
        if value is None or isinstance(value, (bool, int, float, str)):
            return {"value": checked_number(value) if isinstance(value, float) else value}
        raise CaptureError(f"the optimizer passes {type(value).__name__} to {name} together with numbers computed "
                           "from tensors, which mutwo cannot record; please report it")  # fmt: skip

    text = json.dumps({"func": name, "args": [entry(a) for a in args],
                       "kwargs": {k: entry(v) for k, v in kwargs.items()}}, separators=(",", ":"))  # fmt: skip
    padded = lists + [[] for _ in range(FOREACH_LISTS - len(lists))]
    if written is not None:
        torch.ops.mutwo.foreach_host_call_(list(written), text, *padded)
        return None
    return list(torch.ops.mutwo.foreach_host_call(text, *padded))


def _scalar_tensor(value: HostScalar | Number) -> torch.Tensor:
    """A number of a multi-tensor call as the 0-dim CPU tensor ``mutwo::host_scalar`` makes."""
    if isinstance(value, HostScalar):
        sources = value.sources()
        encoded, kind = value.encode({id(t): i for i, t in enumerate(sources)}), value.kind
    else:
        sources, encoded, kind = [], checked_number(value), type(value)
    expression = json.dumps({"scalar": encoded, "kind": kind.__name__}, separators=(",", ":"))
    return torch.ops.mutwo.host_scalar(expression, sources)


# -- the mode ---------------------------------------------------------------------------------------
_READS = frozenset({torch.Tensor.item, torch.Tensor.__bool__})


class HostScalarMode(TorchFunctionMode):
    """While active, ``tensor.item()`` on a one-element tensor returns a
    :class:`HostScalar`, and calls receiving one are recorded with :func:`record_call`.

    ``decide(condition)`` returns the value a :class:`HostScalar` condition has while tracing (and
    records it as a guard of the capture); a branch on one fails without it.
    """

    def __init__(self, decide: Callable[[HostScalar], bool] | None = None) -> None:
        super().__init__()
        self.decide = decide

    def __enter__(self) -> HostScalarMode:
        ACTIVE_MODES.append(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        ACTIVE_MODES.pop()
        super().__exit__(*exc)

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:  # fmt: skip
        kwargs = kwargs or {}
        if func in _READS and isinstance(args[0], torch.Tensor) and args[0].numel() == 1:
            value = HostScalar.read(args[0])
            if func is torch.Tensor.__bool__:
                return bool(value)
            return value
        if any(isinstance(leaf, HostScalar) for leaf in pytree.tree_leaves((args, kwargs))):
            return record_call(func, args, kwargs)
        return func(*args, **kwargs)


# HostScalars are accepted wherever torch expects a number because they define __torch_function__:
# the argument parser lets such objects through and the mode above then handles the call.
def _host_scalar_torch_function(cls: type, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                                kwargs: dict[str, Any] | None = None) -> Any:  # fmt: skip
    if active_mode() is None:
        raise CaptureError(f"{func!r} received a number computed from tensors outside a traced optimizer step")
    return record_call(func, args, kwargs or {})


HostScalar.__torch_function__ = classmethod(_host_scalar_torch_function)  # type: ignore[attr-defined]
