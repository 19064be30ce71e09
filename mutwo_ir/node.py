"""Nodes of the mutwo IR: what a value is (kind), when it runs (phase) and what memory it holds."""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx.immutable_collections import immutable_list
from torch.utils import _pytree as pytree


class NodeKind(str, enum.Enum):
    """What a node's value is in a training iteration."""

    PARAMETER = "parameter"
    BUFFER = "buffer"
    INPUT = "input"
    ACTIVATION = "activation"
    GRADIENT = "gradient"
    OPTIMIZER_STATE = "optimizer_state"
    COMMUNICATION = "communication"
    OTHER = "other"


class Phase(str, enum.Enum):
    """Which part of the iteration a node belongs to; nodes appear in this order."""

    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"


PHASE_ORDER = {Phase.FORWARD: 0, Phase.BACKWARD: 1, Phase.OPTIMIZER: 2}

#: The device name of swapped-out copies: host memory, a pool apart from the device's (pinned
#: buffers on CUDA; on CPU a separate buffer), see :mod:`mutwo.ir.swap`.
HOST = "host"

#: Kinds of persistent state: placeholders, or in-place updates of such a placeholder.
STATE_KINDS = frozenset({NodeKind.PARAMETER, NodeKind.BUFFER, NodeKind.INPUT, NodeKind.OPTIMIZER_STATE})


@dataclass(frozen=True, order=True)
class StorageKey:
    """Identity of one storage: the id of the node that allocated it and which of its outputs."""

    creator: int
    output: int = 0

    def __str__(self) -> str:
        return f"%{self.creator}" if self.output == 0 else f"%{self.creator}.{self.output}"


@dataclass(frozen=True)
class TensorMeta:
    """Shape, dtype and storage of one tensor a node holds.

    ``storage_bytes`` is the size of the whole storage, which a view shares with its base.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: str
    storage: StorageKey
    storage_bytes: int

    @property
    def dtype_name(self) -> str:
        return _DTYPE_NAMES.get(self.dtype, str(self.dtype).removeprefix("torch."))


_DTYPE_NAMES = {
    torch.float32: "f32",
    torch.float64: "f64",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "b8",
}


class Node:
    """One operation of the IR graph.

    ``op`` is ``placeholder`` (a graph input), ``call_function`` (an aten op or ``operator.getitem``)
    or ``output``. ``args``/``kwargs`` hold other nodes anywhere inside lists and tuples, as fx does.
    ``tensors`` describes the tensors of the value: one for a tensor, one per element (``None`` for
    non-tensors) for a tuple, none otherwise. Nodes are created and mutated only through
    :class:`mutwo.ir.graph.Graph`, which keeps ``users`` consistent.
    """

    __slots__ = (
        "id", "name", "op", "target", "_args", "_kwargs", "kind", "phase", "tensors",
        "is_tuple", "label", "origin", "users", "graph", "_operands",
    )  # fmt: skip

    def __init__(
        self,
        *,
        id: int,
        name: str,
        op: str,
        target: Any,
        kind: NodeKind,
        phase: Phase,
        tensors: tuple[TensorMeta | None, ...] = (),
        is_tuple: bool = False,
        label: str = "",
        origin: int | None = None,
    ) -> None:
        self.id = id
        self.name = name
        self.op = op
        self.target = target
        self._args: tuple[Any, ...] = ()
        self._kwargs: dict[str, Any] = {}
        self.kind = kind
        self.phase = phase
        self.tensors = tensors
        self.is_tuple = is_tuple
        self.label = label  #: for placeholders, the qualified name of the state or input
        self.origin = origin  #: for recompute clones, the id of the node they were copied from
        self.users: dict[Node, None] = {}  # ordered set
        self.graph: Any = None
        #: ``operands`` of the args and kwargs objects it was computed from: selection walks them
        #: hundreds of thousands of times, and flattening them each time dominated its run time
        self._operands: tuple[tuple[Any, ...], dict[str, Any], tuple[Node, ...]] | None = None

    # -- operands --------------------------------------------------------------------------
    @property
    def args(self) -> tuple[Any, ...]:
        return self._args

    @property
    def kwargs(self) -> dict[str, Any]:
        return self._kwargs

    def set_operands(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Replace args and kwargs, keeping the users of old and new operands consistent."""
        for old in self.operands:
            old.users.pop(self, None)
        self._args, self._kwargs = tuple(args), dict(kwargs)
        for new in self.operands:
            new.users[self] = None
        if self.graph is not None:
            self.graph.mark_changed()

    @property
    def operands(self) -> list[Node]:
        """The distinct nodes this node reads, in order of first appearance."""
        cached = self._operands
        if cached is not None and cached[0] is self._args and cached[1] is self._kwargs:
            return list(cached[2])
        seen = dict.fromkeys(iter_nodes((self._args, self._kwargs)))
        self._operands = (self._args, self._kwargs, tuple(seen))
        return list(seen)

    # -- facts -----------------------------------------------------------------------------
    @property
    def op_name(self) -> str:
        """A short, stable name of the target: ``aten.relu.default``, ``getitem``, ``placeholder``."""
        return target_name(self.target) if self.op == "call_function" else self.op

    @property
    def tensor(self) -> TensorMeta | None:
        """The tensor of a single-tensor value, else ``None``."""
        return self.tensors[0] if len(self.tensors) == 1 and not self.is_tuple else None

    def owned_storages(self) -> list[TensorMeta]:
        """Tensors whose storage this node allocated (not views or in-place results)."""
        seen: dict[StorageKey, TensorMeta] = {}
        for meta in self.tensors:
            if meta is not None and meta.storage.creator == self.id and meta.storage not in seen:
                seen[meta.storage] = meta
        return list(seen.values())

    @property
    def owned_bytes(self) -> int:
        """Bytes of the storages this node allocates; zero for views, getitems and in-place ops."""
        return sum(meta.storage_bytes for meta in self.owned_storages())

    @property
    def is_alias(self) -> bool:
        """True when every tensor of this value lives in a storage allocated by another node."""
        return bool(self.tensors) and not self.owned_storages() and any(t is not None for t in self.tensors)

    @property
    def mutated_operands(self) -> list[Node]:
        """Operands an aten op writes to in place: the schema's ``(a!)`` annotations, plus the
        running statistics that training-mode batch norms update without declaring it."""
        schema = getattr(self.target, "_schema", None)
        if schema is None:
            return []
        written: list[Node] = []
        hidden = _UNDECLARED_WRITES.get(schema.name)
        if hidden is not None:
            positions, training_position = hidden
            if training_position < len(self._args) and self._args[training_position] is True:
                written.extend(self._args[p] for p in positions
                               if p < len(self._args) and isinstance(self._args[p], Node))  # fmt: skip
        for index, argument in enumerate(schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = self._kwargs.get(argument.name, self._args[index] if index < len(self._args) else None)
            written.extend(iter_nodes(value))
        return written

    @property
    def has_undeclared_writes(self) -> bool:
        """A batch norm in training mode: it updates running statistics its schema does not mark."""
        schema = getattr(self.target, "_schema", None)
        return schema is not None and schema.name in _UNDECLARED_WRITES

    @property
    def is_random(self) -> bool:
        """True for ops that draw from the random number generator (dropout, bernoulli, rand...);
        attention kernels tagged so draw only with a non-zero ``dropout_p`` (as torch's
        partitioner decides, ``is_rng_op``)."""
        tags = getattr(self.target, "tags", ())
        if torch.Tag.nondeterministic_seeded not in tags:
            return False
        schema = self.target._schema
        for index, argument in enumerate(schema.arguments):
            if argument.name == "dropout_p":
                value = self._args[index] if index < len(self._args) else \
                    self._kwargs.get("dropout_p", argument.default_value)  # fmt: skip
                return not isinstance(value, (int, float)) or value != 0
        return True

    @property
    def is_collective(self) -> bool:
        """True for torch's functional collectives (``_c10d_functional``: all_reduce_, broadcast_,
        wait_tensor...): every rank must run them, in the same order, exactly once per iteration."""
        return isinstance(self.target, torch._ops.OpOverload) and self.target.namespace in COLLECTIVE_NAMESPACES

    @property
    def is_wait(self) -> bool:
        """A collective's ``wait_tensor``: at run time it returns its operand, once the communication is done."""
        return is_wait(self.target)

    def __repr__(self) -> str:
        return f"%{self.id}({self.name})"


#: Namespaces of torch's functional collectives (``torch.distributed._functional_collectives``).
COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "c10d_functional"})


def is_wait(target: Any) -> bool:
    """Whether ``target`` is a functional collective's ``wait_tensor``."""
    return (isinstance(target, torch._ops.OpOverload) and target.namespace in COLLECTIVE_NAMESPACES
            and target._schema.name.endswith("::wait_tensor"))  # fmt: skip


#: Ops that update some arguments in place although their schema does not say so:
#: schema name -> (positions of the written arguments, position of the ``training`` flag).
_UNDECLARED_WRITES: dict[str, tuple[tuple[int, ...], int]] = {
    "aten::native_batch_norm": ((3, 4), 5),
    "aten::cudnn_batch_norm": ((3, 4), 5),
    "aten::miopen_batch_norm": ((3, 4), 5),
    "aten::_batch_norm_impl_index": ((3, 4), 5),
}


def target_name(target: Callable[..., Any] | str) -> str:
    """Printable name of an fx call target: ``aten.add_.Tensor`` or the function's name."""
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._schema.name.split('::')[-1]}.{target._overloadname}"
    if isinstance(target, str):
        return target
    return getattr(target, "__name__", repr(target))


def iter_nodes(value: Any) -> Iterator[Node]:
    """Every node inside a nested args structure, in pytree's order of leaves."""
    kind = type(value)
    if kind is Node:
        yield value
    elif kind is tuple or kind is list or kind is immutable_list:
        for item in value:
            yield from iter_nodes(item)
    elif kind is dict:
        for item in value.values():
            yield from iter_nodes(item)
    elif _pytree_container(value):
        yield from (leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, Node))


def map_nodes(value: Any, replace: Callable[[Node], Any]) -> Any:
    """``value`` (a nested args structure) with every node replaced by ``replace(node)``, as
    ``pytree.tree_map`` would rebuild it. Plain tuples, lists and dicts, which are what an aten
    call's arguments hold, and fx's immutable lists are rebuilt here, other containers by pytree:
    its generic walk was most of the time of copying a graph, which a plan or a restart does
    several times, and of every pass's reading of a node's operands."""
    kind = type(value)
    if kind is Node:
        return replace(value)
    if kind is tuple:
        return tuple(map_nodes(item, replace) for item in value)
    if kind is list:
        return [map_nodes(item, replace) for item in value]
    if kind is immutable_list:  # what fx makes of a list argument
        return immutable_list(map_nodes(item, replace) for item in value)
    if kind is dict:
        return {key: map_nodes(item, replace) for key, item in value.items()}
    if _pytree_container(value):
        return pytree.tree_map(lambda leaf: replace(leaf) if isinstance(leaf, Node) else leaf, value)
    return value


def _pytree_container(value: Any) -> bool:
    """Whether pytree may walk into ``value``, or find a node in it: a type registered with pytree
    (a deque, a namedtuple, a registered dataclass...) or a subclass of the containers above."""
    return type(value) in pytree.SUPPORTED_NODES or isinstance(value, (tuple, list, dict, Node))
