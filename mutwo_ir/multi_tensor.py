"""Multi-tensor (``foreach``) ops: recognising them and splitting them by list position.

A multi-tensor op applies the same computation to every position of its list arguments:
``_foreach_add_(params, grads, alpha=...)`` updates ``params[i]`` from ``grads[i]`` alone. Such
ops are recognised by torch's naming convention — aten's ``_foreach_*`` and ``_fused_*`` ops and
custom ops named ``foreach_*`` — together with their schema: every list argument of tensors or
numbers has the same length (or is empty, like ``_fused_adam_``'s unused ``max_exp_avg_sqs``),
and the op returns nothing or one list of that length. Positions are then independent, so the op
can be split into ops over subsets of its positions with the same numbers, element for element
(each position runs the same kernel arithmetic whatever else is in the list).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from mutwo.ir.graph import Graph
from mutwo.ir.node import Node, StorageKey, TensorMeta

#: Name prefixes of multi-tensor ops (aten's foreach and fused optimizer ops; custom foreach ops).
MULTI_TENSOR_PREFIXES = ("_foreach_", "_fused_", "foreach_")
#: Schema types of arguments that hold one entry per position.
POSITION_LIST_TYPES = frozenset({"List[Tensor]", "List[Optional[Tensor]]", "List[number]", "List[float]"})


@dataclass(frozen=True)
class MultiTensorLayout:
    """Where the positions of one multi-tensor op are: its list arguments and whether it returns a list."""

    positions: int
    list_arguments: tuple[tuple[str, int | None], ...]  #: (name, index in args, or None if a keyword)
    written: frozenset[str]  #: names of the arguments it writes in place
    returns_list: bool

    def elements(self, node: Node, position: int) -> list[Node]:
        """The nodes at ``position`` of the list arguments."""
        found = []
        for name, index in self.list_arguments:
            value = _argument(node, name, index)
            if value and isinstance(value[position], Node):
                found.append(value[position])
        return found

    def written_elements(self, node: Node, position: int) -> list[Node]:
        """The nodes at ``position`` of the list arguments written in place."""
        found = []
        for name, index in self.list_arguments:
            value = _argument(node, name, index)
            if name in self.written and value and isinstance(value[position], Node):
                found.append(value[position])
        return found

    def shared_operands(self, node: Node) -> list[Node]:
        """Operands outside the position lists: read by every position (a scalar, a learning rate)."""
        in_lists = {id(v) for name, index in self.list_arguments for v in (_argument(node, name, index) or ())}
        listed = {name for name, _ in self.list_arguments}
        shared: dict[Node, None] = {}
        schema = node.target._schema
        for position, argument in enumerate(schema.arguments):
            if argument.name in listed:
                continue
            value = _argument(node, argument.name, position)
            for leaf in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(leaf, Node) and id(leaf) not in in_lists:
                    shared[leaf] = None
        return list(shared)

    def writes_shared(self, node: Node) -> list[Node]:
        """Shared operands the op writes in place: positions then depend on each other through them."""
        listed = {name for name, _ in self.list_arguments}
        schema = node.target._schema
        written = []
        for position, argument in enumerate(schema.arguments):
            if argument.name in self.written and argument.name not in listed:
                value = _argument(node, argument.name, position)
                written += [leaf for leaf in (value if isinstance(value, (list, tuple)) else (value,))
                            if isinstance(leaf, Node)]  # fmt: skip
        return written


def _argument(node: Node, name: str, index: int | None) -> Any:
    if name in node.kwargs:
        return node.kwargs[name]
    if index is not None and index < len(node.args):
        return node.args[index]
    return None


def multi_tensor_layout(node: Node) -> MultiTensorLayout | None:
    """The layout of ``node`` if it is a multi-tensor op (see the module docstring), else ``None``."""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    if schema is None or not schema.name.split("::")[-1].startswith(MULTI_TENSOR_PREFIXES):
        return None
    lists: list[tuple[str, int | None]] = []
    lengths: set[int] = set()
    written: set[str] = set()
    for index, argument in enumerate(schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            written.add(argument.name)
        if str(argument.type) not in POSITION_LIST_TYPES:
            continue
        value = _argument(node, argument.name, index)
        if not isinstance(value, (list, tuple)):
            continue
        lists.append((argument.name, None if argument.name in node.kwargs else index))
        if value:
            lengths.add(len(value))
    returns = [str(r.type) for r in schema.returns]
    if len(lengths) != 1 or returns not in ([], ["List[Tensor]"]):
        return None
    positions = lengths.pop()
    if returns and (not node.is_tuple or len(node.tensors) != positions):
        return None
    return MultiTensorLayout(positions, tuple(lists), frozenset(written), bool(returns))


def list_getitems(node: Node) -> dict[int, list[Node]]:
    """The ``getitem`` users of a list-returning op, by position."""
    found: dict[int, list[Node]] = {}
    for user in node.users:
        if user.op == "call_function" and user.target is operator.getitem and user.args[0] is node:
            found.setdefault(int(user.args[1]), []).append(user)
    return found


def split_multi_tensor(graph: Graph, node: Node, layout: MultiTensorLayout, positions: Sequence[int],
                       renamed: dict[StorageKey, StorageKey]) -> Node:  # fmt: skip
    """A new op doing ``node``'s work at ``positions`` only; the getitems of those positions now
    read it. The storages the new op allocates are recorded in ``renamed`` (old key -> new key):
    call :func:`rename_storages` once every split is done, then erase ``node`` when it has no users.
    """
    chosen = list(positions)

    def sliced(name: str, index: int | None) -> Any:
        value = _argument(node, name, index)
        return type(value)(value[p] for p in chosen) if value else value

    args = list(node.args)
    kwargs = dict(node.kwargs)
    for name, index in layout.list_arguments:
        if index is None:
            kwargs[name] = sliced(name, index)
        else:
            args[index] = sliced(name, index)
    tensors: tuple[TensorMeta | None, ...] = ()
    if layout.returns_list:
        tensors = tuple(_fresh(node.tensors[p], node.id, j) for j, p in enumerate(chosen))
    part = graph.create_node("call_function", node.target, tuple(args), kwargs, name=node.name, kind=node.kind,
                             phase=node.phase, tensors=tensors, is_tuple=node.is_tuple, after=node)  # fmt: skip
    if layout.returns_list:
        getitems = list_getitems(node)
        for j, p in enumerate(chosen):
            old = node.tensors[p]
            if old is not None and old.storage.creator == node.id:
                renamed[old.storage] = StorageKey(part.id, j)
            for getitem in getitems.get(p, []):
                getitem.set_operands((part, j), {})
    return part


def _fresh(meta: TensorMeta | None, creator: int, output: int) -> TensorMeta | None:
    """A list element's metadata in the new op: its own storage if the old op allocated it."""
    if meta is None or meta.storage.creator != creator:
        return meta
    return TensorMeta(meta.shape, meta.dtype, meta.device, StorageKey(-1, output), meta.storage_bytes)


def rename_storages(nodes: Iterable[Node], renamed: dict[StorageKey, StorageKey]) -> None:
    """Point every tensor that held a renamed storage at its new key (getitems, in-place results)."""
    if not renamed:
        return
    for node in nodes:
        if any(t is not None and t.storage in renamed for t in node.tensors):
            node.tensors = tuple(
                t if t is None or t.storage not in renamed
                else TensorMeta(t.shape, t.dtype, t.device, renamed[t.storage], t.storage_bytes)
                for t in node.tensors
            )  # fmt: skip
