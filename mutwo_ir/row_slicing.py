"""Rewriting a row region (:mod:`mutwo.ir.row_region`) to run in k slices of rows.

The region's nodes, forward and backward, are replaced by ordinary aten ops placed at the end of
the forward pass:

* before the slices: the backward nodes the region reads (the loss's gradient seed, which
  ``ones_like(loss)`` becomes ``full([], 1)`` for, as only the loss's shape was read), and each
  loss's total weight, the count of targets it does not ignore (``sum(target != ignore_index)``,
  exact in fp32 up to 2^24 targets);
* each slice ``[a, b)`` of the N rows: the region's nodes in graph order on ``slice(x, 0, a, b)``
  of its inputs with rows (the hidden state, the targets), so the logits, log-probabilities and
  their gradients of one slice are freed before the next slice starts; the loss over the slice is
  a sum (reduction 2) and its gradient uses the whole loss's total weight, so that every element
  of the gradient is the one the whole op computes;
* after the slices: sums over the rows accumulated slice by slice (the loss's sum, divided by the
  total weight for a mean; the weight gradient as ``addmm`` into the running sum; the bias
  gradient as an ``add``), and values with rows that the rest of the graph reads (the hidden
  state's gradient) concatenated.

The forward nodes that read what the slices compute (the loss and what is made of it) move after
them; backward readers read the new values, and the region's original nodes are erased. Only
those sums change the order in which floats are added: ``SLICED_META`` in the graph's meta names
the values computed from them (the loss, the gradients of the parameters they feed), which the
equivalence check compares within a tolerance; everything else is computed by the same ops on the
same rows.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from mutwo.ir.classify import classify
from mutwo.ir.graph import Graph
from mutwo.ir.node import Node, NodeKind, Phase, StorageKey, TensorMeta
from mutwo.ir.recompute import follow_storage
from mutwo.ir.row_region import SHAPE_ONLY, SLICED_META, Region, SliceContext, find_regions

aten = torch.ops.aten

#: The fill value of the ``full`` that replaces a hoisted shape-only op (``ones_like(loss)``).
_FILL = {aten.ones_like.default: 1, aten.zeros_like.default: 0, aten.empty_like.default: 0}


@dataclass
class SlicedRegion:
    """What slicing one region did, as recorded in the graph's meta and the pass's report."""

    logits: int  #: id of the logits matmul the region started at (erased)
    rows: int
    width: int
    slices: int
    nodes: list[int]  #: ids of the nodes the rewrite added
    #: what the slices' sums feed: "loss", and the labels of the parameters whose gradients they are
    summed: list[str]
    #: added node id -> (the id of the node it computes a slice of, or moved, and the share of its
    #: rows): how a profile of the graph before prices it
    derived: dict[int, tuple[int, float]] = field(default_factory=dict)
    #: the ids of the nodes each slice added, slice by slice (a slice's running sums included):
    #: what a compiler must not fuse across, or the slices' working sets are alive together
    per_slice: list[list[int]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {key: value for key, value in self.__dict__.items() if key != "derived"}


def bounds(rows: int, slices: int) -> list[tuple[int, int]]:
    """``slices`` consecutive row ranges covering ``rows``, their sizes differing by at most one."""
    size, extra = divmod(rows, slices)
    starts = [i * size + min(i, extra) for i in range(slices + 1)]
    return list(zip(starts[:-1], starts[1:], strict=True))


def slice_region(graph: Graph, region: Region, slices: int) -> SlicedRegion:
    """Rewrite ``region`` of ``graph`` to run in ``slices`` slices of rows (see the module docstring)."""
    if not 1 <= slices <= region.rows:
        raise ValueError(f"cannot cut {region.rows} rows into {slices} slices")
    anchor = next(n for n in graph if n.phase is not Phase.FORWARD)
    emitter = _Emitter(graph, region, anchor)
    emitter.before_slices()
    parts: dict[Node, list[Node]] = {node: [] for node in region.exits}
    sums: dict[Node, Node] = {}
    for index, (start, end) in enumerate(bounds(region.rows, slices)):
        emitter.start_slice(index, start, end)
        for node, rule in region.rules.items():
            if rule.whole == "fixed":
                emitter.values[node] = emitter.total_weight[rule.loss]
                continue
            emitter.name, emitter.source = f"{node.name}_slice{index}", node
            if rule.accumulate and node in sums:  # add this slice's product into the running sum
                args, _ = emitter.args(node)
                value = emitter.call(aten.addmm.default, (sums[node], *args))
            else:
                value = rule.emit(emitter)
            emitter.values[node] = value
            if node not in parts:
                continue
            if rule.whole is None:
                parts[node].append(value)
            elif node not in sums or rule.accumulate:
                sums[node] = value
            else:
                sums[node] = emitter.call(aten.add.Tensor, (sums[node], value))
    emitter.end_slices()
    replacements = {node: emitter.whole_value(node, parts[node], sums.get(node)) for node in region.exits}
    _reorder(graph, region)
    for node, replacement in replacements.items():
        readers = [u for u in node.users if u not in region.rules]
        for user in readers:
            user.set_operands(*pytree.tree_map(lambda leaf, n=node, r=replacement: r if leaf is n else leaf,
                                               (user.args, user.kwargs)))  # fmt: skip
        follow_storage(node, replacement, readers)  # views of the old value now view the new one
    for node in reversed(list(region.rules)):
        graph.erase(node)
    for node in reversed(region.hoisted):
        if not node.users:
            graph.erase(node)
    classify(graph)
    summed = _summed(graph, [replacements[n] for n in region.exits if region.rules[n].whole in ("sum", "mean")])
    per_slice = [[n.id for n in nodes if n.graph is graph] for nodes in emitter.per_slice]
    record = SlicedRegion(region.logits.id, region.rows, region.width, slices, [n.id for n in emitter.created], summed,
                          emitter.derived, per_slice)  # fmt: skip
    graph.meta.setdefault(SLICED_META, []).append(record.to_json())
    return record


def slice_regions(graph: Graph, slices: int) -> list[SlicedRegion]:
    """Slice every sliceable region of ``graph`` (:func:`mutwo.ir.row_region.find_regions`) into
    ``slices`` slices, or as many as it has rows; each region is found again after the one
    before it is sliced, as slicing moves and erases nodes."""
    records: list[SlicedRegion] = []
    while True:
        regions, _ = find_regions(graph)
        if not regions:
            return records
        records.append(slice_region(graph, regions[0], min(slices, regions[0].rows)))


def _reorder(graph: Graph, region: Region) -> None:
    """Move the forward nodes that read what the slices compute after them (the slices were
    inserted at the end of the forward pass)."""
    late = set(region.late)
    forward = [n for n in graph if n.phase is Phase.FORWARD]
    rest = [n for n in graph if n.phase is not Phase.FORWARD]
    graph.reorder([n for n in forward if n not in late] + region.late + rest)


def _summed(graph: Graph, sums: list[Node]) -> list[str]:
    """What the slices' sums feed: the loss (the output's first value) and the gradients the step
    returns or updates parameters with, by label."""
    reached: set[Node] = set()
    stack = list(sums)
    while stack:
        node = stack.pop()
        if node in reached:
            continue
        reached.add(node)
        stack.extend(node.users)
    output = graph.output
    loss = output.args[0][0] if output.args and output.args[0] else None
    labels = ["loss"] if loss in reached else []
    return labels + sorted({n.label for n in reached if n.kind is NodeKind.GRADIENT and n.label})


class _Emitter(SliceContext):
    """Adds the slices' nodes before ``anchor`` (the first backward node), computing each new
    node's tensors by running its op on meta tensors."""

    def __init__(self, graph: Graph, region: Region, anchor: Node) -> None:
        self.graph, self.region, self.anchor = graph, region, anchor
        self.created: list[Node] = []
        self.moved: dict[Node, Node] = {}  #: hoisted backward nodes -> their copies before the slices
        self.prepared: dict[Node, Node] = {}  #: inputs with rows, as [N, *trailing] matrices
        self.total_weight: dict[Node, Node] = {}  #: nll_loss_forward -> its total weight
        self.values: dict[Node, Node] = {}  #: region nodes -> this slice's values
        self.cut: dict[Node, Node] = {}  #: inputs -> this slice of them
        self.fake: dict[Node, Any] = {}
        self.derived: dict[int, tuple[int, float]] = {}
        self.per_slice: list[list[Node]] = []  #: the nodes each slice added, while ``slicing``
        self.slicing = False
        self.source: Node | None = None  #: the region node the nodes being added compute a slice of
        self.name = "sliced"
        self.rows = region.rows
        self.start = self.end = self.index = 0

    # -- before, during and after the slices ------------------------------------------------
    def before_slices(self) -> None:
        region = self.region
        for node in region.hoisted:
            self.name = node.name
            if node in region.shape_only:
                self.moved[node] = self._full_like(node)
            else:
                self.moved[node] = self.graph.copy_node(node, self.moved, before=self.anchor, phase=Phase.FORWARD,
                                                        kind=NodeKind.OTHER, clone=False)  # fmt: skip
                self.created.append(self.moved[node])
                self.derived[self.moved[node].id] = (node.id, 1.0)
        for node in region.rules:
            if node.target is aten.nll_loss_forward.default and any(
                    region.rules[u].whole in ("fixed", "mean") for u in node.users):  # fmt: skip
                self.name = f"{node.name}_total_weight"
                target, ignore_index = self.whole(node.args[1]), node.args[4] if len(node.args) > 4 else -100
                counted = self.call(aten.ne.Scalar, (target, ignore_index))
                self.total_weight[node] = self.call(aten.sum.default, (counted,), {"dtype": node.args[0].tensor.dtype})
        for node, layout in region.inputs.items():
            value = self.whole(node)
            meta = node.tensor
            if layout.kind == "rows" and layout.lead > 1 and meta is not None:
                self.name = f"{node.name}_rows"
                value = self.call(aten.view.default, (value, [region.rows, *layout.trailing(meta.shape)]))
            self.prepared[node] = value

    def start_slice(self, index: int, start: int, end: int) -> None:
        self.values, self.cut = {}, {}
        self.start, self.end, self.rows = start, end, end - start
        self.index = index
        self.slicing = True
        self.per_slice.append([])

    def end_slices(self) -> None:
        """What is added from here on joins the slices' values and belongs to none of them."""
        self.name, self.source, self.slicing = "sliced", None, False

    def whole_value(self, node: Node, parts: list[Node], total: Node | None) -> Node:
        """The whole value of an exit: its slices concatenated, or the sum over the slices."""
        rule = self.region.rules[node]
        self.name = f"{node.name}_whole"
        if rule.whole == "fixed":
            return self.total_weight[rule.loss]
        if rule.whole == "mean":
            assert total is not None
            return self.call(aten.div.Tensor, (total, self.total_weight[rule.loss]))
        if rule.whole == "sum":
            assert total is not None
            return total
        value = parts[0] if len(parts) == 1 else self.call(aten.cat.default, (parts, 0))
        shape = node.tensor.shape if node.tensor is not None else None
        if shape is not None and self._shape(value) != shape:
            value = self.call(aten.view.default, (value, list(shape)))
        return value

    # -- SliceContext -----------------------------------------------------------------------
    def value(self, node: Node) -> Node:
        if node in self.values:
            return self.values[node]
        layout = self.region.inputs.get(node)
        if layout is None or layout.kind == "whole":
            return self.whole(node)
        if node not in self.cut:
            dim = 1 if layout.kind == "cols" else 0
            self.cut[node] = self.call(aten.slice.Tensor, (self.prepared[node], dim, self.start, self.end),
                                       name=f"{node.name}_rows{self.index}")  # fmt: skip
        return self.cut[node]

    def whole(self, node: Node) -> Node:
        """An input that is not sliced: itself, or its copy before the slices if it was hoisted."""
        return self.moved.get(node, node)

    def args(self, node: Node) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return pytree.tree_map(lambda leaf: self.value(leaf) if isinstance(leaf, Node) else leaf,
                               (node.args, node.kwargs))  # fmt: skip

    def call(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None, *,
             name: str | None = None) -> Node:  # fmt: skip
        kwargs = kwargs or {}
        result = target(*pytree.tree_map(self._fake, args), **pytree.tree_map(self._fake, kwargs))
        values = result if isinstance(result, (tuple, list)) else (result,)
        device = self._device(args, kwargs)
        tensors = tuple(self._meta(target, args, kwargs, index, value, device) if isinstance(value, torch.Tensor)
                        else None for index, value in enumerate(values))  # fmt: skip
        node = self.graph.create_node("call_function", target, args, kwargs, name=name or self.name,
                                      kind=NodeKind.OTHER, phase=Phase.FORWARD, tensors=tensors,
                                      is_tuple=isinstance(result, (tuple, list)), before=self.anchor)  # fmt: skip
        self.fake[node] = result
        self.created.append(node)
        if self.slicing:
            self.per_slice[-1].append(node)
        if self.source is not None:
            self.derived[node.id] = (self.source.id, self.rows / self.region.rows)
        return node

    # -- tensors of new nodes ---------------------------------------------------------------
    def _device(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        """The device of a new node's outputs: the one its arguments name (``full``'s), else its
        operands' (a device's over a CPU scalar's), else the logits'. A node read as on the CPU
        would not count in the device's simulated memory: the loss's gradient seed (a ``full``)
        once made every slice's backward look like host memory."""
        if isinstance(kwargs.get("device"), torch.device):
            return str(kwargs["device"])
        devices = [t.device for leaf in pytree.tree_leaves((args, kwargs)) if isinstance(leaf, Node)
                   for t in leaf.tensors if t is not None]  # fmt: skip
        logits = self.region.logits.tensor
        fallback = logits.device if logits is not None else "cpu"
        return next((d for d in devices if d != "cpu"), devices[0] if devices else fallback)

    def _fake(self, leaf: Any) -> Any:
        """The meta tensor standing for a node (created from its shape for a node made elsewhere);
        a device argument (``full``'s) becomes the meta device, so that nothing is allocated."""
        if isinstance(leaf, torch.device):
            return torch.device("meta")
        if not isinstance(leaf, Node):
            return leaf
        if leaf not in self.fake:
            metas = [None if t is None else torch.empty(t.shape, dtype=t.dtype, device="meta") for t in leaf.tensors]
            self.fake[leaf] = tuple(metas) if leaf.is_tuple else metas[0]
        return self.fake[leaf]

    @staticmethod
    def _meta(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any], index: int, value: torch.Tensor,
              device: str) -> TensorMeta:  # fmt: skip
        """The TensorMeta of output ``index``: the storage of the operand it aliases (a view, a
        getitem, an in-place result), else a storage of its own."""
        shape = tuple(int(s) for s in value.shape)
        aliased = _aliased(target, args, kwargs, index)
        if aliased is not None:
            return TensorMeta(shape, value.dtype, aliased.device, aliased.storage, aliased.storage_bytes)
        return TensorMeta(shape, value.dtype, device, StorageKey(-1, index), int(value.untyped_storage().nbytes()))

    def _shape(self, node: Node) -> tuple[int, ...] | None:
        return node.tensor.shape if node.tensor is not None else None

    def _full_like(self, node: Node) -> Node:
        """``ones_like(loss)`` before the loss exists: ``full`` of the loss's shape, dtype and device."""
        like = node.args[0].tensor
        assert like is not None and node.target in SHAPE_ONLY
        fill = node.args[1] if node.target is aten.full_like.default else _FILL[node.target]
        kwargs = {"dtype": node.kwargs.get("dtype") or like.dtype, "layout": torch.strided,
                  "device": torch.device(like.device), "pin_memory": False}  # fmt: skip
        return self.call(aten.full.default, (list(like.shape), fill), kwargs)


def _aliased(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any], index: int) -> TensorMeta | None:
    """The tensor whose storage output ``index`` of ``target(*args, **kwargs)`` shares, if any
    (the schema's alias annotations; a getitem shares its tuple element's)."""
    if target is operator.getitem:
        return args[0].tensors[args[1]]
    schema = target._schema
    alias = schema.returns[index].alias_info if index < len(schema.returns) else None
    if alias is None:
        return None
    for position, argument in enumerate(schema.arguments):
        if argument.alias_info is not None and argument.alias_info.before_set & alias.before_set:
            operand = args[position] if position < len(args) else kwargs.get(argument.name)
            return operand.tensor if isinstance(operand, Node) else None
    return None

