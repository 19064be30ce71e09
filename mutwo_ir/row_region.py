"""Regions of a whole-iteration graph that can run in slices of rows: a language-model head.

A language model's head computes logits ``[N × V]`` (N tokens, V the vocabulary) with a matmul,
then a log-softmax and a loss, and its backward holds two more ``[N × V]`` tensors. Every token's
row is computed alone, except where the loss and the weight gradient sum over the tokens. Such a
*region* can run in slices of rows, each slice's forward and backward before the next (what
:mod:`mutwo.ir.row_slicing` emits), so that its working set is that of one slice.

:func:`find_regions` starts from each forward ``_log_softmax`` fed by a matmul whose output is
wider than its input and grows the region over the nodes that read one of its *wide* values (a
value with V or more elements per row), forward and backward. Each node of the region gets a
:class:`Rule`: how its value lies along the rows (:class:`Layout`) and how one slice of it is
computed from slices of its operands. A node that reads a wide value and has no rule, or a
region that would need, before a slice runs, a value that the slices compute (a gradient seed
that depends on the loss's value, a cross-slice sum read inside the region) is refused with one
sentence naming the node (:class:`NotSliceable`).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from mutwo.ir.graph import Graph
from mutwo.ir.node import Node, NodeKind, Phase, iter_nodes
from mutwo.ir.time_model import is_pointwise

aten = torch.ops.aten

#: The graph's meta key under which :mod:`mutwo.ir.row_slicing` records each sliced region (what
#: the equivalence check compares within a tolerance).
SLICED_META = "sliced_regions"


class NotSliceable(Exception):
    """A region that cannot run in slices; the message is one sentence naming the node and why."""

    def __init__(self, node: Node, why: str) -> None:
        super().__init__(f"%{node.id} ({node.op_name}) {why}")
        self.node = node


@dataclass(frozen=True)
class Layout:
    """How a value lies along the region's N rows.

    ``rows``: its first ``lead`` dimensions together index the rows (``[B, S, V]`` with B×S = N
    has lead 2); a slice holds rows ``[a, b)`` as ``[b - a, *trailing]``. ``cols``: a 2-D value
    whose second dimension is the rows (a transposed one), sliced as ``[X, b - a]``. ``whole``:
    no row dimension (a weight, a scalar, a sum over the rows). ``tuple``: a tuple of values,
    each described by the rule of its ``getitem``.
    """

    kind: str
    lead: int = 0

    def trailing(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The dimensions of a ``rows`` value after its row dimensions."""
        return shape[self.lead:]


ROWS = Layout("rows", 1)
COLS = Layout("cols")
WHOLE = Layout("whole")
TUPLE = Layout("tuple")


class SliceContext:
    """What a rule needs to build one slice's op: the sliced values of its operands, the slice's
    row count, and a way to add nodes (implemented by :mod:`mutwo.ir.row_slicing`)."""

    rows: int

    def value(self, node: Node) -> Node:
        """The slice of a region node or a sliced input; a ``whole`` input itself."""
        raise NotImplementedError

    def call(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> Node:
        """Add a node computing ``target(*args, **kwargs)`` to the slice; returns it."""
        raise NotImplementedError

    def args(self, node: Node) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``node``'s args and kwargs with every operand replaced by its :meth:`value`."""
        raise NotImplementedError


#: How one slice of a region node is computed: the node it makes (or an operand's, for a view
#: that changes nothing on a slice).
Emit = Callable[[SliceContext], Node]


@dataclass(frozen=True)
class Rule:
    """How a region node runs in slices.

    ``whole`` says, for a value without rows, how the slices' values make the whole one: ``sum``
    (each slice computes its part of a sum over the rows), ``mean`` (a sum, divided by the count of
    targets the loss counts), ``fixed`` (known before any slice runs: the loss's total weight).
    ``operands`` gives the layout each operand outside the region must have; ``loss`` is the
    ``nll_loss_forward`` a ``mean`` divides by the total weight of.
    """

    layout: Layout
    emit: Emit
    operands: dict[Node, Layout] = field(default_factory=dict)
    whole: str | None = None
    loss: Node | None = None
    accumulate: bool = False  #: a matmul over the rows: slices after the first add into the sum (addmm)


@dataclass
class Region:
    """A sliceable region: its nodes with their rules, in graph order, and how it meets the rest.

    ``inputs`` are the nodes outside it that it reads, with their layouts; ``exits`` the region
    nodes read outside it; ``hoisted`` the backward nodes the slices need (the loss's gradient
    seed and what it is computed from), which run before the slices; ``late`` the forward nodes
    that read what the slices compute, which run after them.
    """

    logits: Node
    rows: int
    width: int
    rules: dict[Node, Rule]
    inputs: dict[Node, Layout]
    exits: list[Node]
    hoisted: list[Node]
    late: list[Node]
    #: hoisted nodes that read a value the slices compute only for its shape (``ones_like(loss)``)
    shape_only: set[Node]

    def describe(self) -> str:
        return (f"%{self.logits.id} ({self.logits.op_name}) [{self.rows} x {self.width}] logits and "
                f"{len(self.rules)} nodes reading them")  # fmt: skip


# -- finding regions -------------------------------------------------------------------------

#: Ops that only read their first operand's shape, dtype and device (the gradient seed
#: ``ones_like(loss)``): a hoisted one does not need the loss computed.
SHAPE_ONLY = frozenset({aten.ones_like.default, aten.zeros_like.default, aten.empty_like.default,
                        aten.full_like.default})  # fmt: skip
#: Ops between the logits matmul and the log-softmax that keep every row's values where they are.
_PASS_THROUGH = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.alias.default,
                           aten.detach.default, aten._to_copy.default, aten.clone.default})  # fmt: skip


def find_regions(graph: Graph) -> tuple[list[Region], list[NotSliceable]]:
    """Every language-model head of ``graph`` that can run in slices, and the refusals of those
    that cannot (one sentence each). Heads already sliced (their slices, which the graph's
    :data:`SLICED_META` lists) are not found again."""
    regions: list[Region] = []
    refusals: list[NotSliceable] = []
    taken: set[Node] = set()
    sliced = {node_id for record in graph.meta.get(SLICED_META, ()) for node_id in record["nodes"]}
    for node in graph:
        if (node.target is not aten._log_softmax.default or node.phase is not Phase.FORWARD or node in taken
                or node.id in sliced):  # fmt: skip
            continue
        logits = _logits_matmul(node)
        if logits is None:
            continue
        try:
            region = region_of(graph, logits)
        except NotSliceable as refusal:
            refusals.append(refusal)
            continue
        regions.append(region)
        taken.update(region.rules)
    return regions, refusals


def _logits_matmul(log_softmax: Node) -> Node | None:
    """The matmul whose output ``log_softmax`` normalizes (through views and casts), if its rows
    are wider than the matmul's input's (a vocabulary wider than the hidden state)."""
    value = log_softmax.args[0]
    while isinstance(value, Node) and value.target in _PASS_THROUGH:
        value = value.args[0]
    if not isinstance(value, Node) or value.target not in (aten.mm.default, aten.addmm.default):
        return None
    hidden = value.args[0] if value.target is aten.mm.default else value.args[1]
    if value.tensor is None or hidden.tensor is None or len(hidden.tensor.shape) != 2:
        return None
    return value if value.tensor.shape[1] > hidden.tensor.shape[1] else None


def region_of(graph: Graph, logits: Node) -> Region:
    """The region that starts at the ``logits`` matmul: every later node reading one of its wide
    values (or taking an element of one of its tuples), with their rules; NotSliceable otherwise."""
    assert logits.tensor is not None
    rows, width = logits.tensor.shape
    hidden = logits.args[0] if logits.target is aten.mm.default else logits.args[1]
    known: dict[Node, Layout] = {hidden: ROWS}  # the matmul's input: its rows are the tokens
    rules: dict[Node, Rule] = {}
    inputs: dict[Node, Layout] = {hidden: ROWS}
    for node in graph.nodes[graph.position(logits):]:
        if node is not logits and not _joins(node, rules, known, width):
            continue
        if node.op != "call_function":
            raise NotSliceable(node, f"reads the [{rows} x {width}] logits' value %{_wide_operand(node, rules).id}")
        _check_reads(node, rules)
        rule = rule_for(node, known, rows)
        rules[node] = rule
        known[node] = rule.layout
        for operand, layout in rule.operands.items():
            if inputs.setdefault(operand, layout) != layout:
                raise NotSliceable(operand, "is read by the region both as rows and as a whole")
    exits = _exits(rules, known, width)
    hoisted, shape_only = _hoisted(graph, rules, inputs)
    _check_no_write_between(graph, [n for n in rules if n.phase is not Phase.FORWARD] + hoisted)
    late = _late(graph, rules, inputs, hoisted, shape_only)
    return Region(logits, rows, width, rules, inputs, exits, hoisted, late, shape_only)


def _joins(node: Node, rules: dict[Node, Rule], known: dict[Node, Layout], width: int) -> bool:
    """Whether ``node`` belongs to the region: it takes an element of a region tuple, or reads a
    wide region value (nodes reading only narrow ones read the whole value after the slices)."""
    if node.target is operator.getitem:
        return node.args[0] in rules
    return any(operand in rules and is_wide(operand, known[operand], width) for operand in node.operands)


def _wide_operand(node: Node, rules: dict[Node, Rule]) -> Node:
    return next(operand for operand in node.operands if operand in rules)


def is_wide(node: Node, layout: Layout, width: int) -> bool:
    """A value with ``width`` or more elements per row: what slicing exists to keep small."""
    meta = node.tensor
    if meta is None or layout.kind not in ("rows", "cols"):
        return False
    per_row = math.prod(layout.trailing(meta.shape)) if layout.kind == "rows" else meta.shape[0]
    return per_row >= width


def _check_reads(node: Node, rules: dict[Node, Rule]) -> None:
    """A slice can read a region value that is a sum over every row only when it is known
    before the slices run (the loss's total weight)."""
    for operand in node.operands:
        read = rules.get(operand)
        if read is not None and read.whole in ("sum", "mean"):
            raise NotSliceable(node, f"reads %{operand.id}, a sum over every row, which is known only after "
                                     "the last slice")  # fmt: skip
        if node.target is not operator.getitem and read is not None and read.layout is TUPLE:
            raise NotSliceable(node, f"reads the tuple %{operand.id} whole")


def _exits(rules: dict[Node, Rule], known: dict[Node, Layout], width: int) -> list[Node]:
    """Region nodes read outside the region: each must be whole or narrow (the slices' values
    are put back together), never a wide value or a gradient the step returns."""
    exits = []
    for node, rule in rules.items():
        outside = [user for user in node.users if user not in rules]
        if not outside:
            continue
        if rule.layout is TUPLE or rule.layout.kind == "cols" or is_wide(node, rule.layout, width):
            shape = " x ".join(map(str, node.tensor.shape)) if node.tensor is not None else "tuple"
            raise NotSliceable(outside[0], f"reads the region's [{shape}] value %{node.id} outside its slices")
        if node.kind is NodeKind.GRADIENT:
            raise NotSliceable(node, "is a gradient the step returns, computed inside the region")
        exits.append(node)
    return exits


def value_operands(node: Node) -> list[Node]:
    """The operands whose values ``node`` reads (not those it reads only the shape of)."""
    if node.target in SHAPE_ONLY:
        return list(iter_nodes((node.args[1:], node.kwargs)))
    return node.operands


def _dependents(graph: Graph, rules: dict[Node, Rule]) -> set[Node]:
    """Nodes outside the region whose values depend on a value the region computes."""
    dependent: set[Node] = set()
    for node in graph:
        if node not in rules and any(o in rules or o in dependent for o in value_operands(node)):
            dependent.add(node)
    return dependent


def _hoisted(graph: Graph, rules: dict[Node, Rule], inputs: dict[Node, Layout]) -> tuple[list[Node], set[Node]]:
    """The backward nodes the slices read, with the backward nodes they are computed from: they
    run before the slices, which must not need anything the slices compute to run them."""
    dependent = _dependents(graph, rules)
    for node in inputs:
        if node in dependent:
            cause = _nearest_region_node(node, dependent, rules)
            raise NotSliceable(node, f"feeds the region's slices but depends on %{cause.id} ({cause.op_name}), which "
                                     "the slices compute: it would be needed before they run")  # fmt: skip
    needed = _ancestors([n for n in inputs if n.phase is not Phase.FORWARD], lambda n: n.phase is not Phase.FORWARD)
    hoisted = [n for n in graph if n in needed]
    shape_only = set()
    for node in hoisted:
        if node.op != "call_function" or node.mutated_operands or node.is_random or node.is_collective:
            raise NotSliceable(node, "is needed by the region's slices before the backward, and moving it there "
                                     "would move a side effect")  # fmt: skip
        if node.target in SHAPE_ONLY and (node.args[0] in rules or node.args[0] in dependent):
            meta = node.args[0].tensor
            if meta is None or meta.shape:
                raise NotSliceable(node, "takes the shape of a region value that is not a scalar")
            shape_only.add(node)
    return hoisted, shape_only


def _check_no_write_between(graph: Graph, moved: list[Node]) -> None:
    """The backward nodes that move to the end of the forward pass (the region's and the hoisted
    ones) must read there what they read where they were: nothing may write what they read in
    place in between (an optimizer update moved into the backward, say)."""
    nodes = graph.nodes
    first = next(i for i, n in enumerate(nodes) if n.phase is not Phase.FORWARD)
    written_at: dict[Any, int] = {}  # storage -> the first position in the backward that writes it
    for position in range(first, len(nodes)):
        for written in nodes[position].mutated_operands:
            for meta in written.tensors:
                if meta is not None:
                    written_at.setdefault(meta.storage, position)
    for node in moved:
        position = graph.position(node)
        for operand in node.operands:
            if any(meta is not None and written_at.get(meta.storage, position) < position for meta in operand.tensors):
                raise NotSliceable(node, f"reads %{operand.id}, which the backward writes in place before it: "
                                         "running it before the backward would read another value")  # fmt: skip


def _nearest_region_node(node: Node, dependent: set[Node], rules: dict[Node, Rule]) -> Node:
    """The region node closest to ``node`` among those its value depends on (breadth first)."""
    queue, seen = [node], {node}
    for current in queue:
        for operand in value_operands(current):
            if operand in rules:
                return operand
            if operand in dependent and operand not in seen:
                seen.add(operand)
                queue.append(operand)
    raise AssertionError(f"{node!r} depends on no region node")


def _ancestors(starts: Iterable[Node], within: Callable[[Node], bool]) -> set[Node]:
    """``starts`` and every node they are computed from through nodes for which ``within`` holds
    (a shape-only read ends the walk)."""
    seen: set[Node] = set()
    stack = [n for n in starts if within(n)]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        operands = node.operands if node.target not in SHAPE_ONLY else value_operands(node)
        stack.extend(o for o in operands if within(o) and o not in seen)
    return seen


def _late(graph: Graph, rules: dict[Node, Rule], inputs: dict[Node, Layout], hoisted: list[Node],
          shape_only: set[Node]) -> list[Node]:  # fmt: skip
    """Forward nodes that read what the slices compute (the loss and what is made of it): they
    run right after the slices, which run at the end of the forward pass, so nothing that runs
    before the slices may read them (a hoisted shape-only op reads none: it becomes ``full``)."""
    after: set[Node] = set()
    for node in graph:
        if node.phase is Phase.FORWARD and node not in rules and any(o in rules or o in after for o in node.operands):
            after.add(node)
    for node in [*inputs, *hoisted]:
        if node in after or (node not in shape_only and any(o in after for o in node.operands)):
            raise NotSliceable(node, "feeds the region's slices but reads, even if only for its shape, what they "
                                     "compute")  # fmt: skip
    return [n for n in graph if n in after]


# -- rules ------------------------------------------------------------------------------------

def rule_for(node: Node, known: dict[Node, Layout], rows: int) -> Rule:
    """The rule of a region node, given the layouts ``known`` of the region values it reads."""
    target = node.target
    make = _RULES.get(target)
    if make is not None:
        return make(node, known, rows)
    if is_pointwise(target) or target in (aten._to_copy.default, aten.clone.default):
        return _pointwise(node, known)
    raise NotSliceable(node, "reads the region's logits and has no form that runs row by row")


def _shape(node: Node) -> tuple[int, ...]:
    meta = node.tensor
    if meta is None:
        raise NotSliceable(node, "has no single tensor value")
    return meta.shape


def _rows_of(node: Node, known: dict[Node, Layout], operand: Node) -> Layout:
    layout = known.get(operand)
    if layout is None or layout.kind != "rows":
        raise NotSliceable(node, f"reads %{operand.id} in a form that does not run row by row")
    return layout


def _trailing_dim(node: Node, dim: int, ndim: int, layout: Layout) -> int:
    """A dimension of a rows value, as the same dimension of its slice ``[n, *trailing]``."""
    dim = dim + ndim if dim < 0 else dim
    if dim < layout.lead:
        raise NotSliceable(node, "works along the rows")
    return dim - layout.lead + 1


def _same_op(node: Node, layout: Layout, operands: dict[Node, Layout] | None = None,
             change: Callable[[tuple[Any, ...], dict[str, Any]], tuple[tuple[Any, ...], dict[str, Any]]] | None = None,
             **extra: Any) -> Rule:  # fmt: skip
    """A rule whose slice runs the node's own op on the slices of its operands (``change`` adjusts
    the arguments that name dimensions or sizes)."""

    def emit(ctx: SliceContext) -> Node:
        args, kwargs = ctx.args(node)
        if change is not None:
            args, kwargs = change(args, kwargs)
        return ctx.call(node.target, args, kwargs)

    return Rule(layout, emit, operands or {}, **extra)


def _alias(node: Node, known: dict[Node, Layout], rows: int) -> Rule:
    source = node.args[0]
    return Rule(known[source], lambda ctx: ctx.value(source))


def _view(node: Node, known: dict[Node, Layout], rows: int) -> Rule:
    """A view that regroups the row dimensions (``[N, V]`` <-> ``[B, S, V]``) changes nothing on a
    slice; one that regroups the trailing dimensions views the slice alike."""
    source = node.args[0]
    layout = _rows_of(node, known, source)
    trailing = layout.trailing(_shape(source))
    shape = _shape(node)
    lead = next((i for i in range(1, len(shape) + 1) if math.prod(shape[:i]) == rows
                 and math.prod(shape[i:]) == math.prod(trailing)), None)  # fmt: skip
    if lead is None:
        raise NotSliceable(node, "folds the rows into other dimensions")
    out = Layout("rows", lead)
    if shape[lead:] == trailing:
        return Rule(out, lambda ctx: ctx.value(source))
    return Rule(out, lambda ctx: ctx.call(aten.view.default, (ctx.value(source), [ctx.rows, *shape[lead:]])))


def _transpose(node: Node, known: dict[Node, Layout], rows: int) -> Rule:
    source = node.args[0]
    layout = known[source]
    if node.target is aten.transpose.int and sorted(d % 2 for d in node.args[1:3]) != [0, 1]:
        raise NotSliceable(node, "transposes other dimensions than a matrix's two")
    if len(_shape(source)) != 2 or layout not in (ROWS, COLS):
        raise NotSliceable(node, "transposes a value that is not a matrix of rows")
    return Rule(COLS if layout == ROWS else ROWS, lambda ctx: ctx.call(aten.t.default, (ctx.value(source),)))


def _mm(node: Node, known: dict[Node, Layout], rows: int) -> Rule:
    """``rows @ whole`` runs per slice; ``cols @ rows`` sums over the rows (each slice adds its
    part, as an addmm into the running sum); ``whole @ cols`` runs per slice."""
    a, b = node.args[0], node.args[1]
    la, lb = known.get(a), known.get(b)
    if la == ROWS and lb in (None, WHOLE):
        return _same_op(node, ROWS, {b: WHOLE} if lb is None else {})
    if la in (None, COLS) and lb in (None, ROWS) and (a in known or b in known):
        operands = {n: layout for n, layout, seen in ((a, COLS, la), (b, ROWS, lb)) if seen is None}
        return _same_op(node, WHOLE, operands, whole="sum", accumulate=True)
    if la is None and lb == COLS:
        return _same_op(node, COLS, {a: WHOLE})
    raise NotSliceable(node, "multiplies the region's values in a way that is not row by row")


def _addmm(node: Node, known: dict[Node, Layout], rows: int) -> Rule:
    bias, a, b = node.args[0], node.args[1], node.args[2]
    if known.get(a) != ROWS or b in known or bias in known or len(_shape(bias)) > 1:
        raise NotSliceable(node, "adds a matmul of the region's values in a way that is not row by row")
    return _same_op(node, ROWS, {bias: WHOLE, b: WHOLE})


def _pointwise(node: Node, known: dict[Node, Layout]) -> Rule:
    """An elementwise op: its region operands must have the output's shape; an operand from
    outside either has the output's rows too (it is sliced) or none (it broadcasts over them, seen
    without its leading ones)."""
    shape = _shape(node)
    leads = {known[o].lead for o in node.operands if o in known and known[o].kind == "rows"}
    if any(o in known and known[o].kind != "rows" for o in node.operands) or len(leads) != 1:
        raise NotSliceable(node, "combines the region's values in a way that is not row by row")
    lead = leads.pop()
    layout = Layout("rows", lead)
    operands: dict[Node, Layout] = {}
    squeezed: dict[Node, tuple[int, ...]] = {}
    for operand in node.operands:
        meta = operand.tensor
        if operand in known:
            if meta is None or meta.shape[:lead] != shape[:lead] or len(meta.shape) != len(shape):
                raise NotSliceable(node, f"broadcasts the region's value %{operand.id}")
            continue
        if meta is None:
            continue
        overlap = lead - (len(shape) - len(meta.shape))
        if overlap <= 0:
            operands[operand] = WHOLE
        elif all(size == 1 for size in meta.shape[:overlap]):
            operands[operand] = WHOLE
            squeezed[operand] = meta.shape[overlap:]
        elif len(meta.shape) == len(shape) and meta.shape[:lead] == shape[:lead]:
            operands[operand] = layout
        else:
            raise NotSliceable(node, f"broadcasts %{operand.id} over some of the rows")
    for written in node.mutated_operands:
        if written not in known:
            raise NotSliceable(node, f"writes %{written.id}, which is not the region's own, in place")

    def emit(ctx: SliceContext) -> Node:
        args, kwargs = ctx.args(node)
        for operand, view_shape in squeezed.items():
            viewed = ctx.call(aten.view.default, (ctx.value(operand), list(view_shape)))
            args, kwargs = _replace((args, kwargs), ctx.value(operand), viewed)
        return ctx.call(node.target, args, kwargs)

    return Rule(layout, emit, operands)


def _replace(value: Any, old: Node, new: Node) -> Any:
    return pytree.tree_map(lambda leaf: new if leaf is old else leaf, value)


def _softmax(node: Node, known: dict[Node, Layout], rows: int) -> Rule:
    source = node.args[0]
    layout = _rows_of(node, known, source)
    dim = _trailing_dim(node, node.args[1], len(_shape(source)), layout)
    return _same_op(node, layout, change=lambda args, kwargs: ((args[0], dim, *args[2:]), kwargs))


def _softmax_backward(node: Node, known: dict[Node, Layout], rows: int) -> Rule:
    layout, outside = _aligned(node, known, node.args[:2])
    dim = _trailing_dim(node, node.args[2], len(_shape(node)), layout)
    return Rule(layout, lambda ctx: _call_with(ctx, node, {2: dim}), outside)


def _aligned(node: Node, known: dict[Node, Layout], operands: Iterable[Any]) -> tuple[Layout, dict[Node, Layout]]:
    """The layout of a node whose tensor ``operands`` have its output's shape, element for
    element, and the layouts of those from outside the region."""
    shape = _shape(node)
    layouts = {known.get(o) for o in operands if isinstance(o, Node)}
    rows_layouts = [layout for layout in layouts if layout is not None]
    if len(rows_layouts) != 1 or rows_layouts[0].kind != "rows":
        raise NotSliceable(node, "combines the region's values in a way that is not row by row")
    layout = rows_layouts[0]
    outside: dict[Node, Layout] = {}
    for operand in operands:
        if isinstance(operand, Node) and operand not in known:
            if operand.tensor is None or operand.tensor.shape != shape:
                raise NotSliceable(node, f"reads %{operand.id}, which is not shaped as its rows")
            outside[operand] = layout
    return layout, outside


def _call_with(ctx: SliceContext, node: Node, positions: dict[int, Any]) -> Node:
    args, kwargs = ctx.args(node)
    changed = tuple(positions.get(i, arg) for i, arg in enumerate(args))
    return ctx.call(node.target, changed, kwargs)


def _sum(node: Node, known: dict[Node, Layout], rows: int) -> Rule:
    """A sum along trailing dimensions runs per slice; one along every row dimension is a sum
    over the rows (each slice adds its part); one along some of them only is refused."""
    source = node.args[0]
    layout = _rows_of(node, known, source)
    ndim = len(_shape(source))
    if node.target is aten.sum.default:
        dims: list[int] = list(range(ndim))
        keepdim = False
    else:
        given = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        dims = sorted({d % ndim for d in given}) if given else list(range(ndim))
        keepdim = bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))
    dtype = node.kwargs.get("dtype")
    over_rows = [d for d in dims if d < layout.lead]
    trailing = [d - layout.lead + 1 for d in dims if d >= layout.lead]
    if not over_rows:
        kept = Layout("rows", layout.lead)
        return Rule(kept, lambda ctx: ctx.call(aten.sum.dim_IntList, (ctx.value(source), trailing, keepdim),
                                               {"dtype": dtype} if dtype is not None else {}))  # fmt: skip
    if len(over_rows) != layout.lead:
        raise NotSliceable(node, "sums over some of the row dimensions but not all")
    shape = _shape(node)

    def emit(ctx: SliceContext) -> Node:
        part = ctx.call(aten.sum.dim_IntList, (ctx.value(source), [0, *trailing], keepdim),
                        {"dtype": dtype} if dtype is not None else {})  # fmt: skip
        return part if _shape(part) == shape else ctx.call(aten.view.default, (part, list(shape)))

    return Rule(WHOLE, emit, whole="sum")


def _row_reduction(node: Node, known: dict[Node, Layout], rows: int) -> Rule:
    """amax and logsumexp along trailing dimensions."""
    source = node.args[0]
    layout = _rows_of(node, known, source)
    ndim = len(_shape(source))
    given = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", ())
    if not given:
        raise NotSliceable(node, "reduces every dimension, the rows included")
    dims = [_trailing_dim(node, d, ndim, layout) for d in given]
    return _same_op(node, layout, change=lambda args, kwargs: ((args[0], dims, *args[2:]), kwargs))


def _expand(node: Node, known: dict[Node, Layout], rows: int) -> Rule:
    source = node.args[0]
    layout = _rows_of(node, known, source)
    sizes = list(node.args[1])
    shape = _shape(source)
    if len(sizes) != len(shape) or any(s not in (-1, shape[i]) for i, s in enumerate(sizes[:layout.lead])):
        raise NotSliceable(node, "expands along the rows")
    return _same_op(node, layout, change=lambda args, kwargs: ((args[0], [-1, *sizes[layout.lead:]]), kwargs))


def _unsqueeze(node: Node, known: dict[Node, Layout], rows: int) -> Rule:
    source = node.args[0]
    layout = _rows_of(node, known, source)
    ndim = len(_shape(node)) if node.target is aten.unsqueeze.default else len(_shape(source))
    dim = _trailing_dim(node, node.args[1], ndim, layout)
    return _same_op(node, layout, change=lambda args, kwargs: ((args[0], dim), kwargs))


def _reduction(node: Node) -> int:
    return int(node.args[3] if len(node.args) > 3 else node.kwargs.get("reduction", 1))


def _nll_forward(node: Node, known: dict[Node, Layout], rows: int) -> Rule:
    """The loss over the slice's rows, always as a sum (reduction 2): the slices' sums add up to
    the whole sum, which a mean then divides by the total weight known before the slices."""
    source, target, weight = node.args[0], node.args[1], node.args[2]
    if _rows_of(node, known, source) != ROWS or len(_shape(source)) != 2:
        raise NotSliceable(node, "takes log-probabilities that are not a [tokens x classes] matrix")
    if weight is not None:
        raise NotSliceable(node, "weighs the classes, which slicing does not support")
    reduction = _reduction(node)
    operands = {target: ROWS} if target not in known else {}
    return _same_op(node, TUPLE, operands,
                    change=lambda args, kwargs: ((*args[:3], 2 if reduction else 0, *args[4:]), kwargs))


def _getitem(node: Node, known: dict[Node, Layout], rows: int) -> Rule:
    loss, index = node.args[0], node.args[1]
    if loss.target is not aten.nll_loss_forward.default:
        raise NotSliceable(node, "takes an element of a tuple the region computes")
    reduction = _reduction(loss)

    def emit(ctx: SliceContext) -> Node:
        return ctx.call(operator.getitem, (ctx.value(loss), index))

    if index == 1:
        if reduction == 0:
            raise NotSliceable(node, "reads the total weight of a loss that is not reduced")
        return Rule(WHOLE, emit, whole="fixed", loss=loss)
    if reduction == 0:
        return Rule(ROWS, emit)
    return Rule(WHOLE, emit, whole="mean" if reduction == 1 else "sum", loss=loss)


def _nll_backward(node: Node, known: dict[Node, Layout], rows: int) -> Rule:
    """The gradient of the slice's rows: the same op with the whole loss's total weight, so each
    element is what the whole op computes."""
    seed, source, target, weight = node.args[:4]
    if _rows_of(node, known, source) != ROWS or weight is not None:
        raise NotSliceable(node, "is the gradient of a loss slicing does not support (class weights or a "
                                 "non-matrix input)")  # fmt: skip
    reduction = _reduction_backward(node)
    operands: dict[Node, Layout] = {}
    for operand, layout in ((seed, ROWS if reduction == 0 else WHOLE), (target, ROWS), (node.args[6], WHOLE)):
        if isinstance(operand, Node) and operand not in known:
            operands[operand] = layout
    return _same_op(node, ROWS, operands)


def _reduction_backward(node: Node) -> int:
    return int(node.args[4] if len(node.args) > 4 else node.kwargs.get("reduction", 1))


_RULES: dict[Any, Callable[[Node, dict[Node, Layout], int], Rule]] = {
    aten.alias.default: _alias,
    # torch 2.11's make_fx saves the log-softmax's output for its backward through a detach where
    # later versions use an alias: the same value either way, in a graph with no autograd left.
    aten.detach.default: _alias,
    aten.view.default: _view,
    aten._unsafe_view.default: _view,
    aten.reshape.default: _view,
    aten.t.default: _transpose,
    aten.transpose.int: _transpose,
    aten.mm.default: _mm,
    aten.addmm.default: _addmm,
    aten._log_softmax.default: _softmax,
    aten._softmax.default: _softmax,
    aten._log_softmax_backward_data.default: _softmax_backward,
    aten._softmax_backward_data.default: _softmax_backward,
    aten.sum.dim_IntList: _sum,
    aten.sum.default: _sum,
    aten.amax.default: _row_reduction,
    aten.logsumexp.default: _row_reduction,
    aten.expand.default: _expand,
    aten.unsqueeze.default: _unsqueeze,
    aten.squeeze.dim: _unsqueeze,
    aten.nll_loss_forward.default: _nll_forward,
    operator.getitem: _getitem,
    aten.nll_loss_backward.default: _nll_backward,
}
