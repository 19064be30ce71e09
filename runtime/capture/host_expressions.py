"""The numbers a traced optimizer computes on the host from tensors' values, as expressions:
:class:`HostScalar` (built by Python arithmetic on ``tensor.item()`` while tracing), and their
encoding as JSON and evaluation with Python numbers when the graph runs. How they are recorded
is :mod:`mutwo.runtime.capture.host_scalars`'s; the ops that carry them,
:mod:`mutwo.runtime.capture.host_call_ops`'."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from mutwo.runtime.capture.tracing import CaptureError

Number = int | float | bool

_BINARY: dict[str, Callable[[Any, Any], Any]] = {
    "add": operator.add, "sub": operator.sub, "mul": operator.mul, "truediv": operator.truediv,
    "floordiv": operator.floordiv, "mod": operator.mod, "pow": operator.pow,
    "lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge, "eq": operator.eq,
    "ne": operator.ne,
}  # fmt: skip
_UNARY: dict[str, Callable[[Any], Any]] = {"neg": operator.neg, "pos": operator.pos, "abs": operator.abs}
_COMPARISONS = frozenset({"lt", "le", "gt", "ge", "eq", "ne"})


class Decider(Protocol):
    """A recording mode as a branch sees it: ``decide(condition)`` is the value a condition has while
    tracing (recorded as a guard), or None where branches are refused."""

    decide: Callable[[HostScalar], bool] | None


#: The recording modes entered, innermost last (:class:`~mutwo.runtime.capture.host_scalars.HostScalarMode`
#: pushes and pops itself): a branch on a :class:`HostScalar` asks the innermost one to decide it.
ACTIVE_MODES: list[Decider] = []


def active_mode() -> Decider | None:
    """The innermost recording mode, or None outside a traced optimizer step."""
    return ACTIVE_MODES[-1] if ACTIVE_MODES else None


class HostScalar:
    """A Python number computed on the host from tensors' values, as an expression.

    ``op`` is ``"src"`` (the value of ``args[0]``, a tensor, read with ``.item()``) or an operator
    of ``_BINARY`` / ``_UNARY`` applied to ``args``.
    ``kind`` is the Python type the expression evaluates to (``float``, ``int`` or ``bool``).
    """

    __slots__ = ("op", "args", "kind")

    def __init__(self, op: str, args: tuple[Any, ...], kind: type) -> None:
        self.op, self.args, self.kind = op, args, kind

    @classmethod
    def read(cls, tensor: torch.Tensor) -> HostScalar:
        kind = float if tensor.is_floating_point() else bool if tensor.dtype == torch.bool else int
        return cls("src", (tensor,), kind)

    # -- arithmetic keeps the expression symbolic ------------------------------------------------
    def _binary(self, op: str, other: Any, reverse: bool = False) -> HostScalar:
        if isinstance(other, torch.Tensor):
            return NotImplemented  # the tensor's reflected operator runs, through HostScalarMode
        if not isinstance(other, (HostScalar, int, float)):
            return NotImplemented
        left, right = (other, self) if reverse else (self, other)
        return HostScalar(op, (left, right), _result_kind(op, _kind_of(left), _kind_of(right)))

    def __add__(self, other: Any) -> HostScalar: return self._binary("add", other)
    def __radd__(self, other: Any) -> HostScalar: return self._binary("add", other, True)
    def __sub__(self, other: Any) -> HostScalar: return self._binary("sub", other)
    def __rsub__(self, other: Any) -> HostScalar: return self._binary("sub", other, True)
    def __mul__(self, other: Any) -> HostScalar: return self._binary("mul", other)
    def __rmul__(self, other: Any) -> HostScalar: return self._binary("mul", other, True)
    def __truediv__(self, other: Any) -> HostScalar: return self._binary("truediv", other)
    def __rtruediv__(self, other: Any) -> HostScalar: return self._binary("truediv", other, True)
    def __floordiv__(self, other: Any) -> HostScalar: return self._binary("floordiv", other)
    def __rfloordiv__(self, other: Any) -> HostScalar: return self._binary("floordiv", other, True)
    def __mod__(self, other: Any) -> HostScalar: return self._binary("mod", other)
    def __rmod__(self, other: Any) -> HostScalar: return self._binary("mod", other, True)
    def __pow__(self, other: Any) -> HostScalar: return self._binary("pow", other)
    def __rpow__(self, other: Any) -> HostScalar: return self._binary("pow", other, True)
    def __lt__(self, other: Any) -> HostScalar: return self._binary("lt", other)
    def __le__(self, other: Any) -> HostScalar: return self._binary("le", other)
    def __gt__(self, other: Any) -> HostScalar: return self._binary("gt", other)
    def __ge__(self, other: Any) -> HostScalar: return self._binary("ge", other)
    def __eq__(self, other: Any) -> HostScalar: return self._binary("eq", other)  # type: ignore[override]
    def __ne__(self, other: Any) -> HostScalar: return self._binary("ne", other)  # type: ignore[override]
    def __neg__(self) -> HostScalar: return HostScalar("neg", (self,), self.kind)
    def __pos__(self) -> HostScalar: return HostScalar("pos", (self,), self.kind)
    def __abs__(self) -> HostScalar: return HostScalar("abs", (self,), self.kind)

    __hash__ = None  # type: ignore[assignment]

    def __bool__(self) -> bool:
        """A Python branch on the value: decided now, recorded as a guard of the capture."""
        tracer = active_mode()
        if tracer is None or tracer.decide is None:
            raise CaptureError(f"Python code branches on {self.describe()}, a number computed from tensors, "
                               "outside a traced optimizer step")  # fmt: skip
        return bool(tracer.decide(self if self.kind is bool else self._binary("ne", 0)))

    def _refuse(self, *_: Any) -> Any:
        raise CaptureError(
            f"the optimizer converts {self.describe()}, a number computed from tensors (step count, learning "
            "rate), to a Python number (float(), int(), math.*), which cannot follow it from step to step; "
            "construct the optimizer with foreach=False, or capturable=True on a GPU"
        )

    __float__ = __int__ = __index__ = __complex__ = __round__ = __trunc__ = __floor__ = __ceil__ = _refuse

    def __repr__(self) -> str:
        return f"HostScalar({self.describe()})"

    # -- views of the expression ------------------------------------------------------------------
    def sources(self) -> list[torch.Tensor]:
        """The tensors read, each once, in order of first appearance."""
        found: dict[int, torch.Tensor] = {}
        for leaf in self._leaves():
            found.setdefault(id(leaf), leaf)
        return list(found.values())

    def _leaves(self) -> list[torch.Tensor]:
        if self.op == "src":
            return [self.args[0]]
        return [t for arg in self.args if isinstance(arg, HostScalar) for t in arg._leaves()]

    def encode(self, index_of: dict[int, int]) -> Any:
        """JSON form: ``["src", i]`` for source ``i``, a number, or ``[op, operand, ...]``."""
        if self.op == "src":
            return ["src", index_of[id(self.args[0])]]
        return [self.op, *(a.encode(index_of) if isinstance(a, HostScalar) else checked_number(a) for a in self.args)]

    def describe(self) -> str:
        names: dict[int, str] = {}
        return describe_encoded(self.encode({id(t): names.setdefault(id(t), len(names)) for t in self.sources()}))

    def placeholder(self) -> Number:
        """A stand-in of the right Python type for computing the shapes of a call's results."""
        return self.kind(1)


def _kind_of(value: Any) -> type:
    return value.kind if isinstance(value, HostScalar) else type(value)


def _result_kind(op: str, left: type, right: type) -> type:
    if op in _COMPARISONS:
        return bool
    if op == "truediv" or float in (left, right):
        return float
    return int


def checked_number(value: Number) -> Number:
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        raise CaptureError(f"the optimizer computes with the number {value}, which cannot be written into the graph")
    return value


def describe_encoded(encoded: Any) -> str:
    """An encoded expression as text: ``((1 sub (0.9 pow t0.item())) gt 0)``."""
    if not isinstance(encoded, list):
        return repr(encoded)
    if encoded[0] == "src":
        return f"t{encoded[1]}.item()"
    if len(encoded) == 2:
        return f"{encoded[0]}({describe_encoded(encoded[1])})"
    return f"({describe_encoded(encoded[1])} {encoded[0]} {describe_encoded(encoded[2])})"


def evaluate(encoded: Any, values: Sequence[Number]) -> Any:
    """Evaluate an encoded expression with Python numbers, as eager code would."""
    if not isinstance(encoded, list):
        return encoded
    op = encoded[0]
    if op == "src":
        return values[encoded[1]]
    if op in _UNARY:
        return _UNARY[op](evaluate(encoded[1], values))
    return _BINARY[op](evaluate(encoded[1], values), evaluate(encoded[2], values))
