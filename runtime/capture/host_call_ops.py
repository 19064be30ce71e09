"""The custom ops a traced optimizer's host arithmetic is recorded as (``mutwo::host_call``,
``host_call_``, ``host_call_one_``, ``host_scalar``, ``foreach_host_call`` and
``foreach_host_call_``): a call's encoding as text with its tensors and numbers taken out, the
kernels that rebuild and run it from the values the tensors hold at run time, and their fake
forms for tracing. :mod:`mutwo.runtime.capture.host_scalars` says what is recorded and why."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from mutwo.runtime.capture.host_expressions import HostScalar, checked_number, evaluate
from mutwo.runtime.capture.tracing import CaptureError

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


def written_by(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
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


def encode_call(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Encoded:
    name = function_name(func)
    written = written_by(name, args, kwargs)
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
            return {"value": checked_number(leaf) if isinstance(leaf, float) else leaf}
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


def fake_call(text: str, mutated: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor]) -> Any:
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
FOREACH_LISTS = 5
_LISTS_SCHEMA = ", ".join(f"Tensor[] t{i}" for i in range(FOREACH_LISTS))
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
    return [torch.empty_like(r) for r in _results(fake_call(call, [], tensors))]


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
