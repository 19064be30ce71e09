"""Where a ``fully_shard`` step's all-gathers run (:mod:`mutwo.runtime.capture.fully_sharded`).

The step is traced with every group gathered before the forward. :func:`schedule_gathers` then
moves each group's all-gather to just before the group's first use, as FSDP2's pre-forward hook
gathers a module as it starts, and, for a group FSDP2 reshards after the forward
(``reshard_after_forward=True``), computes again before the backward's first read every forward
value the backward reads of it, all-gather included, so the gathered parameters die after their
last forward use, as FSDP2 frees them, and come back for the backward.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from mutwo.ir.from_fx import PHASE_META
from mutwo.ir.node import Phase
from mutwo.runtime.capture.fully_sharded import FullySharded

_C10D = torch.ops._c10d_functional


def schedule_gathers(graph_module: fx.GraphModule, n_params: int, sharded: FullySharded) -> int:
    """Move each group's all-gather (and what the forward computes from parameters alone) to just
    before its first reader, and gather the groups FSDP2 reshards after the forward again before
    their first use in the backward. Returns the all-gathers added."""
    graph = graph_module.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"][:n_params]
    from_shards: set[fx.Node] = set(placeholders)
    for node in graph.nodes:
        if node.op == "call_function" and node.meta.get(PHASE_META) is Phase.FORWARD and node.all_input_nodes \
                and all(i in from_shards for i in node.all_input_nodes):  # fmt: skip
            from_shards.add(node)
    _sink(graph, [n for n in from_shards if n.op == "call_function"])
    regathered = {name for group in sharded.groups if group.regathered for name in group.names}
    wanted = {p for p, name in zip(placeholders, sharded.parameters, strict=True) if name in regathered}
    added = _gather_again(graph, from_shards, wanted)
    graph.lint()
    graph_module.recompile()
    return added


def _fresh_value(node: fx.Node) -> None:
    """Give a copied node a fake value of its own (the copy's ``meta["val"]`` is its original's,
    whose storage the IR would take for the copy's)."""
    original = node.meta["val"]
    fakes = [v for v in pytree.tree_leaves(original) if isinstance(v, torch.Tensor)]
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
    with fakes[0].fake_mode if fakes else contextlib.nullcontext():
        node.meta["val"] = node.target(*args, **kwargs)


def _sink(graph: fx.Graph, movable: list[fx.Node]) -> None:
    """Move every node of ``movable`` right before its earliest user, the last ones first (so
    each one's users already stand where they end up)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in sorted(movable, key=order.__getitem__, reverse=True):
        if not node.users:
            continue
        position = {n: i for i, n in enumerate(graph.nodes)}
        first = min(node.users, key=position.__getitem__)
        if position[first] > position[node] + 1:
            first.prepend(node)


def _gather_again(graph: fx.Graph, from_shards: set[fx.Node], wanted: set[fx.Node]) -> int:
    """Every forward value computed from the shards ``wanted`` (placeholders) that the backward
    reads is computed again, all-gather included, right before the backward's first read of it."""
    if not wanted:
        return 0

    # The forward values computed from those shards: one pass, the graph being in topological order.
    from_wanted = set(wanted)
    for node in graph.nodes:
        if node in from_shards and node.op != "placeholder" and any(i in from_wanted for i in node.all_input_nodes):
            from_wanted.add(node)

    copies: dict[fx.Node, fx.Node] = {}
    added = 0

    def copy_of(node: fx.Node, before: fx.Node) -> fx.Node:
        nonlocal added
        if node.op == "placeholder":
            return node
        if node not in copies:
            for source in node.all_input_nodes:
                copy_of(source, before)
            with graph.inserting_before(before):
                copies[node] = graph.node_copy(node, lambda n: copies.get(n, n))
            copies[node].meta[PHASE_META] = Phase.BACKWARD
            _fresh_value(copies[node])
            added += node.target is _C10D.all_gather_into_tensor.default
        return copies[node]

    for user in list(graph.nodes):
        if user.op != "call_function" or user.meta.get(PHASE_META) is not Phase.BACKWARD:
            continue
        for source in user.all_input_nodes:
            if source in from_wanted and source.op != "placeholder":
                user.replace_input_with(source, copy_of(source, user))
                _refresh_views(user, _storages(source))
    return added


def _storages(node: fx.Node) -> set[Any]:
    from torch.multiprocessing.reductions import StorageWeakRef

    return {StorageWeakRef(v.untyped_storage()) for v in pytree.tree_leaves(node.meta.get("val"))
            if isinstance(v, torch.Tensor)}  # fmt: skip


def _refresh_views(node: fx.Node, old: set[Any]) -> None:
    """``node`` reads a new value where it read one of storages ``old``: if its value is a view of
    that storage, give it (and the views of it downstream) a fake value of the new one."""
    own = _storages(node)
    if not own & old:
        return
    _fresh_value(node)
    for user in node.users:
        _refresh_views(user, own)
