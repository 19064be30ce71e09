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
(:data:`mutwo.runtime.optim.SCHEDULED`) stay graph inputs, and a step count on the CPU costs no
device synchronisation (eager torch.optim reads it the same way).

A branch on such a number (``if rho_t > 5``: RAdam) is decided with the values the tensors hold
while tracing and recorded as a guard (:mod:`mutwo.runtime.guards`); the step
checks its guards before every run and is captured again when one no longer holds. Converting
one to a Python ``float`` (``math.sqrt(x)``) cannot stay symbolic and is refused.
"""

from __future__ import annotations

import functools
import json
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from mutwo.runtime.tracing import CaptureError

Number = int | float | bool

_BINARY: dict[str, Callable[[Any, Any], Any]] = {
    "add": operator.add, "sub": operator.sub, "mul": operator.mul, "truediv": operator.truediv,
    "floordiv": operator.floordiv, "mod": operator.mod, "pow": operator.pow,
    "lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge, "eq": operator.eq,
    "ne": operator.ne,
}  # fmt: skip
_UNARY: dict[str, Callable[[Any], Any]] = {"neg": operator.neg, "pos": operator.pos, "abs": operator.abs}
_COMPARISONS = frozenset({"lt", "le", "gt", "ge", "eq", "ne"})


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
        tracer = _active_mode()
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
        return [self.op, *(a.encode(index_of) if isinstance(a, HostScalar) else _number(a) for a in self.args)]

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


def _number(value: Number) -> Number:
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


# -- the functions a lifted call may name -----------------------------------------------------------
_NAMESPACES: dict[str, Any] = {"Tensor": torch.Tensor, "torch": torch, "F": torch.nn.functional,
                               "linalg": torch.linalg, "special": torch.special}  # fmt: skip


def function_name(func: Callable[..., Any]) -> str:
    """``Tensor.addcdiv_``, ``torch._foreach_mul_``...: a name :func:`resolve` turns back into ``func``."""
    name = getattr(func, "__name__", None)
    for prefix, namespace in _NAMESPACES.items():
        if name is not None and getattr(namespace, name, None) is func:
            return f"{prefix}.{name}"
    raise CaptureError(f"the optimizer passes a number computed from tensors to {func!r}, which mutwo cannot "
                       "record; please report it")  # fmt: skip


@functools.cache
def resolve(name: str) -> Callable[..., Any]:
    prefix, attribute = name.split(".", 1)
    return getattr(_NAMESPACES[prefix], attribute)


def _mutated(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What a call writes in place: ``out=``, or the first argument of an in-place function
    (``Tensor.mul_``, ``torch._foreach_add_``, ``Tensor.__iadd__``)."""
    if "out" in kwargs:
        return kwargs["out"]
    short = name.split(".", 1)[1]
    in_place = (short.endswith("_") and not short.endswith("__")) or short in (
        "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__")  # fmt: skip
    return args[0] if in_place and args else None


# -- recording a call -------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Encoded:
    """A call with its tensors and numbers taken out: what the lifted op carries as text."""

    text: str
    mutated: list[torch.Tensor]
    tensors: list[torch.Tensor]
    sources: list[torch.Tensor]


def _encode_call(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Encoded:
    name = function_name(func)
    written = _mutated(name, args, kwargs)
    mutated = [t for t in pytree.tree_leaves(written) if isinstance(t, torch.Tensor)]
    mutated_ids = {id(t) for t in mutated}
    tensors: list[torch.Tensor] = []
    sources: list[torch.Tensor] = []
    source_index: dict[int, int] = {}
    for leaf in pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, HostScalar):
            for tensor in leaf.sources():
                if id(tensor) not in source_index:
                    source_index[id(tensor)] = len(sources)
                    sources.append(tensor)

    tensor_index: dict[int, int] = {}

    def encode(leaf: Any) -> Any:
        if isinstance(leaf, HostScalar):
            return {"scalar": leaf.encode(source_index), "kind": leaf.kind.__name__}
        if isinstance(leaf, torch.Tensor):
            if id(leaf) in mutated_ids:
                return {"mutated": next(i for i, t in enumerate(mutated) if t is leaf)}
            if id(leaf) not in tensor_index:
                tensor_index[id(leaf)] = len(tensors)
                tensors.append(leaf)
            return {"tensor": tensor_index[id(leaf)]}
        if isinstance(leaf, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
            return {"torch": str(leaf).removeprefix("torch.")}
        if leaf is None or isinstance(leaf, (bool, int, float, str)):
            return {"value": _number(leaf) if isinstance(leaf, float) else leaf}
        raise CaptureError(f"the optimizer passes {type(leaf).__name__} to {name} together with a number computed "
                           "from tensors, which mutwo cannot record; please report it")  # fmt: skip

    leaves, spec = pytree.tree_flatten((list(args), kwargs))
    text = json.dumps({"func": name, "spec": pytree.treespec_dumps(spec), "leaves": [encode(x) for x in leaves]},
                      separators=(",", ":"))  # fmt: skip
    return _Encoded(text, mutated, tensors, sources)


@functools.lru_cache(maxsize=4096)
def _decode(text: str) -> tuple[Callable[..., Any], pytree.TreeSpec, list[dict[str, Any]]]:
    call = json.loads(text)
    return resolve(call["func"]), pytree.treespec_loads(call["spec"]), call["leaves"]


def _rebuild(text: str, mutated: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor],
             scalar: Callable[[dict[str, Any]], Any]) -> tuple[Callable[..., Any], Any, Any]:  # fmt: skip
    func, spec, encoded = _decode(text)
    leaves: list[Any] = []
    for leaf in encoded:
        if "scalar" in leaf:
            leaves.append(scalar(leaf))
        elif "mutated" in leaf:
            leaves.append(mutated[leaf["mutated"]])
        elif "tensor" in leaf:
            leaves.append(tensors[leaf["tensor"]])
        elif "torch" in leaf:
            leaves.append(_torch_constant(leaf["torch"]))
        else:
            leaves.append(leaf["value"])
    args, kwargs = pytree.tree_unflatten(leaves, spec)
    return func, args, kwargs


def _torch_constant(text: str) -> Any:
    value = getattr(torch, text, None)
    return value if isinstance(value, (torch.dtype, torch.memory_format, torch.layout)) else torch.device(text)


def run_call(text: str, mutated: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor],
             sources: Sequence[torch.Tensor]) -> Any:  # fmt: skip
    """Run a recorded call: read the sources, evaluate the numbers, call the function."""
    values = [s.item() for s in sources]
    func, args, kwargs = _rebuild(text, mutated, tensors, lambda leaf: evaluate(leaf["scalar"], values))
    return func(*args, **kwargs)


def _fake_call(text: str, mutated: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor]) -> Any:
    """The call on fake tensors with stand-in numbers: its results' shapes, dtypes and devices."""
    kinds = {"float": float, "int": int, "bool": bool}
    func, args, kwargs = _rebuild(text, mutated, tensors, lambda leaf: kinds[leaf["kind"]](1))
    return func(*args, **kwargs)


# -- the custom ops ---------------------------------------------------------------------------------
_LIBRARY = torch.library.Library("mutwo", "FRAGMENT")
_LIBRARY.define("host_call(str call, Tensor[] tensors, Tensor[] sources) -> Tensor[]")
# The written tensors come first, as in aten's in-place ops.
_LIBRARY.define("host_call_(Tensor(a!)[] mutated, str call, Tensor[] tensors, Tensor[] sources) -> ()")
_LIBRARY.define("host_call_one_(Tensor(a!) mutated, str call, Tensor[] tensors, Tensor[] sources) -> Tensor(a!)")
_LIBRARY.define("host_scalar(str expression, Tensor[] sources) -> Tensor")
#: Position lists a recorded multi-tensor call may use besides the one it writes.
_FOREACH_LISTS = 5
_LISTS_SCHEMA = ", ".join(f"Tensor[] t{i}" for i in range(_FOREACH_LISTS))
_LIBRARY.define(f"foreach_host_call(str call, {_LISTS_SCHEMA}) -> Tensor[]")
_LIBRARY.define(f"foreach_host_call_(Tensor(a!)[] self, str call, {_LISTS_SCHEMA}) -> ()")


def _results(value: Any) -> list[torch.Tensor]:
    leaves = pytree.tree_leaves(value)
    if not all(isinstance(leaf, torch.Tensor) for leaf in leaves):
        raise CaptureError("a recorded call returned something other than tensors; please report it")
    return leaves


def _host_call(call: str, tensors: list[torch.Tensor], sources: list[torch.Tensor]) -> list[torch.Tensor]:
    return [r.clone() if any(r is t for t in tensors) else r for r in _results(run_call(call, [], tensors, sources))]


def _host_call_(mutated: list[torch.Tensor], call: str, tensors: list[torch.Tensor],
                sources: list[torch.Tensor]) -> None:  # fmt: skip
    run_call(call, mutated, tensors, sources)


def _host_call_one_(mutated: torch.Tensor, call: str, tensors: list[torch.Tensor],
                    sources: list[torch.Tensor]) -> torch.Tensor:  # fmt: skip
    run_call(call, [mutated], tensors, sources)
    return mutated


_SCALAR_DTYPES = {"float": torch.float64, "int": torch.int64, "bool": torch.bool}


def _host_scalar(expression: str, sources: list[torch.Tensor]) -> torch.Tensor:
    """The number as a 0-dim CPU tensor of a dtype that holds a Python number exactly."""
    encoded = _decode_scalar(expression)
    value = evaluate(encoded["scalar"], [s.item() for s in sources])
    return torch.tensor(value, dtype=_SCALAR_DTYPES[encoded["kind"]])


@functools.lru_cache(maxsize=4096)
def _decode_scalar(expression: str) -> dict[str, Any]:
    return json.loads(expression)


def _foreach_call(call: str, written: list[torch.Tensor] | None, lists: Sequence[list[torch.Tensor]],
                  fake: bool = False) -> Any:  # fmt: skip
    """Call the torch function a multi-tensor record names, with its arguments rebuilt from the lists."""
    func, arguments, keywords = _decode_foreach(call)

    def value(entry: dict[str, Any]) -> Any:
        if "written" in entry:
            return written
        if "list" in entry:
            return lists[entry["list"]]
        if "one" in entry:  # one tensor, repeated at every position
            return lists[entry["one"]][0]
        if "scalars" in entry:
            return [1.0 if fake else t.item() for t in lists[entry["scalars"]]]
        if "scalar" in entry:  # one number, repeated at every position
            return 1.0 if fake else lists[entry["scalar"]][0].item()
        return entry["value"]

    return func(*[value(a) for a in arguments], **{k: value(v) for k, v in keywords.items()})


@functools.lru_cache(maxsize=4096)
def _decode_foreach(call: str) -> tuple[Callable[..., Any], list[dict[str, Any]], dict[str, dict[str, Any]]]:
    decoded = json.loads(call)
    return resolve(decoded["func"]), decoded["args"], decoded["kwargs"]


def _foreach_host_call(call: str, *lists: list[torch.Tensor]) -> list[torch.Tensor]:
    inputs = {id(t) for entries in lists for t in entries}
    return [r.clone() if id(r) in inputs else r for r in _results(_foreach_call(call, None, lists))]


def _foreach_host_call_(written: list[torch.Tensor], call: str, *lists: list[torch.Tensor]) -> None:
    _foreach_call(call, written, lists)


_LIBRARY.impl("host_scalar", _host_scalar, "CompositeExplicitAutograd")
_LIBRARY.impl("foreach_host_call", _foreach_host_call, "CompositeExplicitAutograd")
_LIBRARY.impl("foreach_host_call_", _foreach_host_call_, "CompositeExplicitAutograd")
_LIBRARY.impl("host_call", _host_call, "CompositeExplicitAutograd")
_LIBRARY.impl("host_call_", _host_call_, "CompositeExplicitAutograd")
_LIBRARY.impl("host_call_one_", _host_call_one_, "CompositeExplicitAutograd")


@torch.library.register_fake("mutwo::host_call", lib=_LIBRARY)
def _host_call_fake(call: str, tensors: list[torch.Tensor], sources: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.empty_like(r) for r in _results(_fake_call(call, [], tensors))]


@torch.library.register_fake("mutwo::host_call_", lib=_LIBRARY)
def _host_call__fake(mutated: list[torch.Tensor], call: str, tensors: list[torch.Tensor],
                     sources: list[torch.Tensor]) -> None:  # fmt: skip
    return None


@torch.library.register_fake("mutwo::host_call_one_", lib=_LIBRARY)
def _host_call_one__fake(mutated: torch.Tensor, call: str, tensors: list[torch.Tensor],
                         sources: list[torch.Tensor]) -> torch.Tensor:  # fmt: skip
    return mutated


@torch.library.register_fake("mutwo::host_scalar", lib=_LIBRARY)
def _host_scalar_fake(expression: str, sources: list[torch.Tensor]) -> torch.Tensor:
    return torch.empty((), dtype=_SCALAR_DTYPES[_decode_scalar(expression)["kind"]], device="cpu")


@torch.library.register_fake("mutwo::foreach_host_call", lib=_LIBRARY)
def _foreach_host_call_fake(call: str, *lists: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.empty_like(r) for r in _results(_foreach_call(call, None, lists, fake=True))]


@torch.library.register_fake("mutwo::foreach_host_call_", lib=_LIBRARY)
def _foreach_host_call__fake(written: list[torch.Tensor], call: str, *lists: list[torch.Tensor]) -> None:
    return None


HOST_CALL_OPS = (torch.ops.mutwo.host_call.default, torch.ops.mutwo.host_call_.default,
                 torch.ops.mutwo.host_call_one_.default)  # fmt: skip


def record_call(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Record ``func(*args, **kwargs)``, whose arguments hold :class:`HostScalar` s, as a lifted op;
    return what ``func`` would return to its caller."""
    if function_name(func).startswith("torch._foreach_"):
        return _record_foreach_call(func, args, kwargs)
    call = _encode_call(func, args, kwargs)
    if not call.mutated:
        results = torch.ops.mutwo.host_call(call.text, call.tensors, call.sources)
        fake = _fake_call(call.text, [], call.tensors)  # the structure of the results
        _, spec = pytree.tree_flatten(fake)
        return pytree.tree_unflatten(list(results), spec)
    written = _mutated(function_name(func), args, kwargs)
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
    written = _mutated(name, args, kwargs)
    lists: list[list[torch.Tensor]] = []

    def position_list(entries: list[torch.Tensor], kind: str) -> dict[str, int]:
        if len(lists) == _FOREACH_LISTS:
            raise CaptureError(f"the optimizer calls {name} with more than {_FOREACH_LISTS} lists, which mutwo "
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
            return {"value": _number(value) if isinstance(value, float) else value}
        raise CaptureError(f"the optimizer passes {type(value).__name__} to {name} together with numbers computed "
                           "from tensors, which mutwo cannot record; please report it")  # fmt: skip

    text = json.dumps({"func": name, "args": [entry(a) for a in args],
                       "kwargs": {k: entry(v) for k, v in kwargs.items()}}, separators=(",", ":"))  # fmt: skip
    padded = lists + [[] for _ in range(_FOREACH_LISTS - len(lists))]
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
        sources, encoded, kind = [], _number(value), type(value)
    expression = json.dumps({"scalar": encoded, "kind": kind.__name__}, separators=(",", ":"))
    return torch.ops.mutwo.host_scalar(expression, sources)


# -- the mode ---------------------------------------------------------------------------------------
_READS = frozenset({torch.Tensor.item, torch.Tensor.__bool__})
_MODES: list[HostScalarMode] = []


def _active_mode() -> HostScalarMode | None:
    return _MODES[-1] if _MODES else None


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
        _MODES.append(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        _MODES.pop()
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
    if _active_mode() is None:
        raise CaptureError(f"{func!r} received a number computed from tensors outside a traced optimizer step")
    return record_call(func, args, kwargs or {})


HostScalar.__torch_function__ = classmethod(_host_scalar_torch_function)  # type: ignore[attr-defined]
