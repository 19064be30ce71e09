"""The deterministic text form of the IR: one line per node.

    %12 activation forward f32[2,64,8,8] 32768B = aten.relu.default(%11)
    %13 other forward f32[2,64,8,8] alias(%12) = aten.alias.default(%12)
    %40 other backward f32[2,64,8,8] 32768B clone-of(%12) = aten.relu.default(%39)

Fields: id, kind, phase, the value's type (``f32[2,64,8,8]``, a tuple as ``(f32[8], f32[8])``,
``-`` for non-tensors), the bytes the node allocates or ``alias(%owner)`` when its storage belongs
to another node (``@host`` after the bytes of a copy swapped out to host memory),
``clone-of(%id)`` for recompute clones, then the op and its operands.
Placeholders show their label: ``= placeholder "fc.weight"``.
"""

from __future__ import annotations

import hashlib
import io
from typing import Any

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
    operands = [format_operand(a) for a in node.args]
    operands += [f"{k}={format_operand(v)}" for k, v in node.kwargs.items()]
    return f"{head} = {node.op_name}({', '.join(operands)})"


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
