"""The deterministic text form of the IR: one line per node.

    %12 activation forward f32[2,64,8,8] 32768B = aten.relu.default(%11)
    %13 other forward f32[2,64,8,8] alias(%12) = aten.alias.default(%12)
    %40 other backward f32[2,64,8,8] 32768B clone-of(%12) = aten.relu.default(%39)

Fields: id, kind, phase, the value's type (``f32[2,64,8,8]``, a tuple as ``(f32[8], f32[8])``,
``-`` for non-tensors), the bytes the node allocates or ``alias(%owner)`` when its storage belongs
to another node (``@host`` after the bytes of a copy swapped out to host memory),
``clone-of(%id)`` for recompute clones, then the op and its operands.
Placeholders show their label: ``= placeholder "fc.weight"``.

A torch.optim call recorded with numbers computed from tensors (``mutwo::host_call*``, see
:mod:`mutwo.runtime.capture.host_scalars`) shows the call it runs, each number as its expression over the
0-dim tensors it reads: ``= mutwo.host_call_one_ Tensor.add_(%0, %21, alpha=-%2)`` (``%2`` being
the learning rate); ``mutwo::host_scalar`` shows its expression: ``= mutwo.host_scalar(1 - %25)``.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
from typing import Any

from torch.utils import _pytree as pytree

from mutwo.ir.graph import Graph
from mutwo.ir.node import HOST, Node, TensorMeta


def _type(meta: TensorMeta | None) -> str:
    if meta is None:
        return "-"
    return f"{meta.dtype_name}[{','.join(str(s) for s in meta.shape)}]"


def _value_type(node: Node) -> str:
    if node.is_tuple:
        return "(" + ", ".join(_type(t) for t in node.tensors) + ")"
    return _type(node.tensor) if node.tensors else "-"


def _memory(node: Node) -> str:
    if node.owned_storages() or not node.tensors:
        # Host memory (a swapped-out copy, see mutwo.ir.swap) is not the device's.
        host = any(t is not None and t.device == HOST for t in node.owned_storages())
        return f"{node.owned_bytes}B" + ("@host" if host else "")
    owners = sorted({t.storage for t in node.tensors if t is not None and t.storage.creator != node.id})
    return "alias(" + ",".join(str(k) for k in owners) + ")"


def format_operand(value: Any) -> str:
    """An operand as text: nodes as ``%id``, containers recursively, scalars with repr."""
    if isinstance(value, Node):
        return f"%{value.id}"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(format_operand(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {format_operand(v)}" for k, v in value.items()) + "}"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def format_node(node: Node) -> str:
    """One node as one line of text."""
    head = f"%{node.id} {node.kind.value} {node.phase.value} {_value_type(node)} {_memory(node)}"
    if node.origin is not None:
        head += f" clone-of(%{node.origin})"
    if node.op == "placeholder":
        return f'{head} = placeholder "{node.label}"'
    recorded = _recorded_call(node)
    if recorded is not None:
        return f"{head} = {recorded}"
    operands = [format_operand(a) for a in node.args]
    operands += [f"{k}={format_operand(v)}" for k, v in node.kwargs.items()]
    return f"{head} = {node.op_name}({', '.join(operands)})"


# -- torch.optim calls recorded with numbers computed from tensors --------------------------------
# mutwo.runtime.capture.host_scalars defines these ops and the JSON text each carries; the IR does not
# import the runtime, so the text is read here, for printing only. Each op's operands, in order:
# host_call(call, tensors, sources), host_call_(mutated list, call, tensors, sources),
# host_call_one_(mutated, call, tensors, sources), host_scalar(expression, sources),
# foreach_host_call(call, t0..t4) and foreach_host_call_(written list, call, t0..t4).
_BINARY = {"add": "+", "sub": "-", "mul": "*", "truediv": "/", "floordiv": "//", "mod": "%", "pow": "**",
           "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}  # fmt: skip
_UNARY = {"neg": "-", "pos": "+"}


def _recorded_call(node: Node) -> str | None:
    """A ``mutwo::host_call*``, ``foreach_host_call*`` or ``host_scalar`` node as the call it runs
    (None for any other node, or one whose text cannot be read: it then prints as any op)."""
    name = node.op_name.removesuffix(".default")
    if not name.startswith("mutwo.") or "host_" not in name:
        return None
    args = node.args
    try:
        if name == "mutwo.host_scalar":
            return f"{name}({_expression(json.loads(args[0])['scalar'], args[1])})"
        if name in ("mutwo.host_call", "mutwo.host_call_", "mutwo.host_call_one_"):
            mutated = [] if name == "mutwo.host_call" else list(args[0]) if name == "mutwo.host_call_" else [args[0]]
            call, tensors, sources = args[len(args) - 3:]
            return f"{name} {_host_call(json.loads(call), mutated, tensors, sources)}"
        if name in ("mutwo.foreach_host_call", "mutwo.foreach_host_call_"):
            written = args[0] if name.endswith("_") else None
            call = json.loads(args[1] if written is not None else args[0])
            lists = args[2:] if written is not None else args[1:]
            return f"{name} {_foreach_call(call, written, lists)}"
    except (LookupError, TypeError, ValueError):
        return None
    return None


def _expression(encoded: Any, sources: list[Any], outer: bool = True) -> str:
    """An encoded number (``["neg", ["src", 0]]``) as Python text over its sources: ``-%2``."""
    if not isinstance(encoded, list):
        return repr(encoded)
    op = encoded[0]
    if op == "src":
        return format_operand(sources[encoded[1]])
    if len(encoded) == 2:
        inner = _expression(encoded[1], sources, outer=False)
        return f"abs({inner})" if op == "abs" else f"{_UNARY[op]}{inner}"
    text = f"{_expression(encoded[1], sources, False)} {_BINARY[op]} {_expression(encoded[2], sources, False)}"
    return text if outer else f"({text})"


@functools.lru_cache(maxsize=256)
def _treespec(text: str) -> Any:
    return pytree.treespec_loads(text)


def _host_call(call: dict[str, Any], mutated: list[Any], tensors: list[Any], sources: list[Any]) -> str:
    """``Tensor.add_(%0, %21, alpha=-%2)``: the function with its arguments put back."""
    leaves = []
    for leaf in call["leaves"]:
        if "scalar" in leaf:
            leaves.append(_expression(leaf["scalar"], sources))
        elif "mutated" in leaf:
            leaves.append(format_operand(mutated[leaf["mutated"]]))
        elif "tensor" in leaf:
            leaves.append(format_operand(tensors[leaf["tensor"]]))
        elif "torch" in leaf:
            leaves.append(f"torch.{leaf['torch']}")
        else:
            leaves.append(repr(leaf["value"]))
    args, kwargs = pytree.tree_unflatten(leaves, _treespec(call["spec"]))
    return _arguments(call["func"], args, kwargs)


def _foreach_call(call: dict[str, Any], written: Any, lists: tuple[Any, ...]) -> str:
    """``torch._foreach_lerp_([%7, %10], [%67, %68], %71)``: each argument from the lists it names."""

    def value(entry: dict[str, Any]) -> Any:
        if "written" in entry:
            return written
        if "list" in entry or "scalars" in entry:
            return lists[entry.get("list", entry.get("scalars"))]
        if "one" in entry or "scalar" in entry:  # one tensor or number, the same at every position
            return lists[entry.get("one", entry.get("scalar"))][0]
        return repr(entry["value"])

    return _arguments(call["func"], [value(a) for a in call["args"]], {k: value(v) for k, v in call["kwargs"].items()})


def _arguments(func: str, args: list[Any], kwargs: dict[str, Any]) -> str:
    operands = [format_operand(a) for a in args] + [f"{k}={format_operand(v)}" for k, v in kwargs.items()]
    return f"{func}({', '.join(operands)})"


def print_graph(graph: Graph) -> str:
    """The whole graph as text, one line per node, ending with a newline."""
    out = io.StringIO()
    for node in graph:
        out.write(format_node(node))
        out.write("\n")
    return out.getvalue()


def fingerprint(graph: Graph) -> str:
    """A hash of every node's id, op and type: equal exactly when a profile or plan applies to the graph."""
    digest = hashlib.sha256()
    for node in graph:
        digest.update(f"{node.id} {node.op_name} {_value_type(node)}\n".encode())
    return digest.hexdigest()[:16]
