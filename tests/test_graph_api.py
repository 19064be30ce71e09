"""The narrow mutation API of :class:`mutwo.ir.graph.Graph`: insertion, copies, use replacement,
erasure, whole-graph copies, the change counter and stable ids."""

from __future__ import annotations

import operator

import pytest
import torch

from mutwo.ir.graph import Graph, GraphError
from mutwo.ir.node import Node, NodeKind, Phase, StorageKey
from mutwo.ir.printer import format_node, print_graph
from mutwo.ir.verifier import verify
from tests.test_verifier import build_small_graph, storage_of, tensor

aten = torch.ops.aten
FWD, BWD, OPT = Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER


def assert_users_consistent(graph: Graph) -> None:
    """``users`` of every node are exactly the nodes of the graph that read it, and ``verify`` passes."""
    for node in graph:
        readers = {other for other in graph if node in other.operands}
        assert set(node.users) == readers, f"users of {node!r}: {list(node.users)} != {readers}"
    verify(graph)


def neg(graph: Graph, operand: Node, **where: object) -> Node:
    """An unused, allocating ``neg`` of ``operand`` in ``operand``'s phase."""
    return graph.create_node("call_function", aten.neg.default, (operand,), name="neg", phase=operand.phase,
                             tensors=(tensor(operand.tensors[0].shape),), **where)  # fmt: skip


def neg_named(graph: Graph, operand: Node, name: str) -> Node:
    """Like :func:`neg` with a chosen name, placed right after ``operand``."""
    return graph.create_node("call_function", aten.neg.default, (operand,), name=name, phase=operand.phase,
                             tensors=(tensor(operand.tensors[0].shape),), after=operand)  # fmt: skip


# -- create_node -----------------------------------------------------------------------------


def test_create_node_appends_with_fresh_ids_names_and_own_storage() -> None:
    graph, n = build_small_graph()
    assert n.h.name == "mm" and n.gw.name == "mm_1"  # a taken name gets a suffix
    assert n.h.tensors[0].storage == StorageKey(n.h.id)  # StorageKey(-1) became the node's own id
    count = len(graph)
    node = graph.create_node("call_function", aten.relu.default, (n.gw,), name="relu", phase=OPT,
                             tensors=(tensor((3, 3)),))  # fmt: skip
    assert graph.nodes[-1] is node and len(graph) == count + 1
    assert node.id == max(other.id for other in graph.nodes[:-1]) + 1
    assert node.name == "relu_1"
    assert node.tensors[0].storage == StorageKey(node.id) and node.owned_bytes == 36
    assert graph.node(node.id) is node and node.graph is graph
    assert list(n.gw.users) == [n.upd, n.out, node]


def test_create_node_before_and_after() -> None:
    graph, n = build_small_graph()
    before = neg(graph, n.h, before=n.r)
    assert graph.position(before) == graph.position(n.r) - 1
    assert graph.nodes[graph.position(n.h) + 1] is before
    after = neg(graph, n.h, after=n.h)
    order = graph.nodes
    assert order[order.index(n.h) + 1 : order.index(n.r)] == [after, before]
    first = graph.create_node("placeholder", "y", name="y", kind=NodeKind.INPUT, tensors=(tensor((2, 3)),),
                              before=n.x)  # fmt: skip
    assert graph.nodes[0] is first
    assert_users_consistent(graph)


def test_many_insertions_before_one_point_keep_their_order_and_positions() -> None:
    # The graph remembers where the point moved to (no scan per insertion); every other
    # mutation, and an insertion elsewhere, must make it forget.
    graph, n = build_small_graph()
    inserted = [neg(graph, n.h, before=n.r) for _ in range(40)]
    elsewhere = neg(graph, n.h, after=n.h)
    inserted.append(neg(graph, n.h, before=n.r))
    graph.erase(inserted.pop(3))
    inserted.append(neg(graph, n.h, before=n.r))
    order = graph.nodes
    assert order[order.index(n.h) + 1: order.index(n.r)] == [elsewhere, *inserted]
    assert all(graph.position(node) == index for index, node in enumerate(order))
    assert_users_consistent(graph)


def test_create_node_refuses_before_and_after_together() -> None:
    graph, n = build_small_graph()
    count, version = len(graph), graph.version
    with pytest.raises(GraphError, match="at most one of before= and after="):
        neg(graph, n.h, before=n.r, after=n.h)
    assert len(graph) == count and graph.version == version
    assert list(n.h.users) == [n.r]


def test_create_node_refuses_used_id_and_foreign_operand() -> None:
    graph, n = build_small_graph()
    with pytest.raises(GraphError, match=f"node id %{n.h.id} is already used"):
        graph.create_node("call_function", aten.neg.default, (n.r,), name="neg", node_id=n.h.id)
    other, m = build_small_graph()
    with pytest.raises(GraphError, match="operand %3\\(mm\\) of new node 'neg' is not in this graph"):
        graph.create_node("call_function", aten.neg.default, (m.h,), name="neg")
    assert list(m.h.users) == [m.r]
    assert_users_consistent(graph)
    assert_users_consistent(other)


def test_refused_insertion_leaves_operands_untouched() -> None:
    graph, n = build_small_graph()
    unused = neg(graph, n.h, after=n.h)
    foreign = Graph().create_node("placeholder", "y", name="y")
    with pytest.raises(GraphError):
        neg(graph, unused, before=foreign)
    assert list(unused.users) == []
    graph.erase(unused)  # raises "still used by %14(neg_1)", a node that is not in the graph


def test_refused_node_does_not_reserve_its_name() -> None:
    graph, n = build_small_graph()
    foreign = Graph().create_node("placeholder", "y", name="y")
    with pytest.raises(GraphError):
        graph.create_node("call_function", aten.neg.default, (foreign,), name="negated")
    assert neg_named(graph, n.h, "negated").name == "negated"


# -- copy_node -------------------------------------------------------------------------------


def test_copy_node_of_allocating_node_owns_a_new_storage() -> None:
    graph, n = build_small_graph()
    ids = {node.id for node in graph}
    clone = graph.copy_node(n.r, {}, before=n.gh, phase=BWD, kind=NodeKind.OTHER)
    assert clone.id not in ids and clone is not n.r
    assert clone.origin == n.r.id
    assert clone.name == "relu_1" and clone.target is aten.relu.default
    assert clone.phase is BWD and clone.kind is NodeKind.OTHER
    assert n.r.phase is FWD and n.r.kind is NodeKind.ACTIVATION  # the original is untouched
    assert clone.args == (n.h,)  # operands outside the remap are kept
    assert clone.tensors[0].storage == StorageKey(clone.id, 0)
    assert clone.owned_bytes == n.r.owned_bytes == 24
    assert graph.nodes[graph.position(n.gh) - 1] is clone
    assert list(n.h.users) == [n.r, clone]
    assert_users_consistent(graph)


def test_copy_node_follows_the_remap() -> None:
    graph, n = build_small_graph()
    h2 = graph.copy_node(n.h, {}, after=n.ght, phase=BWD)
    r2 = graph.copy_node(n.r, {n.h: h2}, after=h2, phase=BWD, kind=NodeKind.OTHER)
    assert r2.args == (h2,)
    assert r2.tensors[0].storage == StorageKey(r2.id)
    assert list(h2.users) == [r2] and list(n.h.users) == [n.r]
    assert n.r.args == (n.h,)
    # a copy of a copy still names the first original
    r3 = graph.copy_node(r2, {}, after=r2)
    assert r3.origin == n.r.id
    # remapping reaches into lists and kwargs
    cat = graph.create_node("call_function", aten.cat.default, ([n.h, n.r],), name="cat", tensors=(tensor((4, 3)),),
                            after=n.r)  # fmt: skip
    add = graph.create_node("call_function", aten.add.Tensor, (n.r,), {"other": n.h}, name="add",
                            tensors=(tensor((2, 3)),), after=cat)  # fmt: skip
    cat2 = graph.copy_node(cat, {n.h: h2}, after=r3, phase=BWD)
    add2 = graph.copy_node(add, {n.h: h2}, after=cat2, phase=BWD)
    assert cat2.args == ([h2, n.r],) and cat.args == ([n.h, n.r],)
    assert add2.args == (n.r,) and add2.kwargs == {"other": h2}
    assert set(h2.users) == {r2, r3, cat2, add2}
    upd2 = graph.copy_node(n.upd, {n.gw: r2}, after=n.upd)
    assert upd2.args == (n.w, r2) and upd2.kwargs == {"alpha": -0.1}
    assert storage_of(upd2) == storage_of(n.w)  # an in-place update keeps the storage it writes
    out_args = graph.output.args
    assert out_args == ((n.loss, n.gw),)
    assert_users_consistent(graph)


def test_copy_node_of_view_aliases_the_remapped_operand() -> None:
    graph, n = build_small_graph()
    gh2 = graph.copy_node(n.gh, {}, after=n.ght)
    ght2 = graph.copy_node(n.ght, {n.gh: gh2}, after=gh2)
    assert ght2.args == (gh2,) and ght2.origin == n.ght.id
    assert storage_of(ght2) == storage_of(gh2) == StorageKey(gh2.id)
    assert storage_of(n.ght) == StorageKey(n.gh.id)
    assert ght2.is_alias and ght2.owned_bytes == 0 and ght2.tensors[0].storage_bytes == 24
    # without a remap the view copy still aliases the original operand's storage
    wt2 = graph.copy_node(n.wt, {}, after=n.wt)
    assert storage_of(wt2) == storage_of(n.w)
    assert_users_consistent(graph)


def test_copy_node_of_tuple_and_getitem() -> None:
    graph, n = build_small_graph()
    pair = graph.create_node("call_function", aten.max.dim, (n.ge, 1), name="max", phase=BWD, is_tuple=True,
                             tensors=(tensor((2,), StorageKey(-1, 0)), tensor((2,), StorageKey(-1, 1))),
                             after=n.ge)  # fmt: skip
    second = graph.create_node("call_function", operator.getitem, (pair, 1), name="getitem", phase=BWD,
                               tensors=(pair.tensors[1],), after=pair)  # fmt: skip
    verify(graph)
    pair2 = graph.copy_node(pair, {}, after=second)
    assert pair2.is_tuple
    assert [t.storage for t in pair2.tensors] == [StorageKey(pair2.id, 0), StorageKey(pair2.id, 1)]
    second2 = graph.copy_node(second, {pair: pair2}, after=pair2)
    assert second2.args == (pair2, 1)
    assert storage_of(second2) == StorageKey(pair2.id, 1)
    assert second2.owned_bytes == 0
    assert_users_consistent(graph)


# -- replace_uses_after ----------------------------------------------------------------------


def test_replace_uses_after_changes_only_later_users() -> None:
    graph, n = build_small_graph()
    clone = graph.copy_node(n.r, {}, before=n.gh, phase=BWD, kind=NodeKind.OTHER)
    # the point is sum(r) itself: a user at the point is not "after" it and keeps reading relu
    assert graph.replace_uses_after(n.r, clone, n.loss) == 1
    assert n.gh.args == (n.ge, clone, 0)
    assert n.loss.args == (n.r,)
    assert list(n.r.users) == [n.loss] and list(clone.users) == [n.gh]
    n.r.kind = NodeKind.OTHER  # relu is no longer kept for the backward
    assert_users_consistent(graph)


def test_replace_uses_after_counts_users_not_occurrences() -> None:
    graph, n = build_small_graph()
    both = graph.create_node("call_function", aten.mul.Tensor, (n.h, n.h), name="mul", tensors=(tensor((2, 3)),),
                             after=n.r)  # fmt: skip
    kw = graph.create_node("call_function", aten.add.Tensor, (n.r,), {"other": n.h}, name="add",
                           tensors=(tensor((2, 3)),), after=both)  # fmt: skip
    # point = r: relu(h) keeps h, mul(h, h) and add(r, other=h) read r instead
    assert graph.replace_uses_after(n.h, n.r, n.r) == 2
    assert both.args == (n.r, n.r)
    assert kw.args == (n.r,) and kw.kwargs == {"other": n.r}
    assert n.r.args == (n.h,)
    assert list(n.h.users) == [n.r]
    assert_users_consistent(graph)


def test_replace_uses_after_with_no_later_user_changes_nothing() -> None:
    graph, n = build_small_graph()
    other = neg(graph, n.h, after=n.h)
    version, before = graph.version, print_graph(graph)
    assert graph.replace_uses_after(n.h, other, n.gh) == 0
    assert graph.version == version and print_graph(graph) == before
    # the new node itself is never rewired, even when it is a later user of the old one
    assert graph.replace_uses_after(n.h, other, n.x) == 1
    assert other.args == (n.h,)
    assert n.r.args == (other,)
    assert_users_consistent(graph)


def test_replace_uses_after_refuses_a_foreign_node() -> None:
    graph, n = build_small_graph()
    other, m = build_small_graph()
    with pytest.raises(GraphError):
        graph.replace_uses_after(n.h, m.h, n.h)
    assert n.r.args == (n.h,)


# -- erase -----------------------------------------------------------------------------------


def test_erase_refuses_a_used_node() -> None:
    graph, n = build_small_graph()
    version, text = graph.version, print_graph(graph)
    with pytest.raises(GraphError) as caught:
        graph.erase(n.r)
    message = str(caught.value)
    assert message == f"cannot erase {n.r!r}: it is still used by %{n.loss.id}(sum), %{n.gh.id}(threshold_backward)"
    assert graph.has_node(n.r.id) and n.r.graph is graph
    assert graph.version == version and print_graph(graph) == text
    assert_users_consistent(graph)


def test_erase_an_unused_node() -> None:
    graph, n = build_small_graph()
    unused = neg(graph, n.h, after=n.h)
    count = len(graph)
    graph.erase(unused)
    assert len(graph) == count - 1 and unused not in graph.nodes
    assert not graph.has_node(unused.id)
    with pytest.raises(GraphError, match=f"no node %{unused.id}"):
        graph.node(unused.id)
    assert unused.graph is None and unused.args == ()
    assert list(n.h.users) == [n.r]
    assert graph.position(n.r) == graph.position(n.h) + 1  # positions are recomputed
    assert neg_named(graph, n.h, "neg").name == "neg"  # the name is free again
    assert_users_consistent(graph)


def test_erase_chain_from_the_last_user() -> None:
    graph, n = build_small_graph()
    a = neg(graph, n.h, after=n.h)
    b = neg(graph, a, after=a)
    with pytest.raises(GraphError, match=f"still used by %{b.id}"):
        graph.erase(a)
    graph.erase(b)
    assert list(a.users) == []
    graph.erase(a)
    assert_users_consistent(graph)
    assert [node.id for node in graph] == list(range(13))


def test_erase_refuses_a_foreign_node_without_touching_it() -> None:
    graph, _ = build_small_graph()
    other, m = build_small_graph()
    unused = neg(other, m.h, after=m.h)
    with pytest.raises(ValueError) as caught:
        graph.erase(unused)
    assert unused.args == (m.h,)  # today: () -- the node was stripped inside `other`
    assert list(m.h.users) == [m.r, unused]
    assert isinstance(caught.value, GraphError)


# -- consistency through a sequence of mutations ---------------------------------------------


def test_users_stay_consistent_through_a_recompute_rewrite() -> None:
    graph, n = build_small_graph()
    assert_users_consistent(graph)
    h2 = graph.copy_node(n.h, {}, before=n.gh, phase=BWD)
    assert_users_consistent(graph)
    r2 = graph.copy_node(n.r, {n.h: h2}, after=h2, kind=NodeKind.OTHER, phase=BWD)
    assert_users_consistent(graph)
    assert graph.replace_uses_after(n.r, r2, r2) == 1
    n.r.kind = NodeKind.OTHER
    assert_users_consistent(graph)
    n.gh.set_operands((n.ge, r2, 0.0), {})
    assert_users_consistent(graph)
    spare = neg(graph, r2, after=r2)
    assert_users_consistent(graph)
    graph.erase(spare)
    assert_users_consistent(graph)
    assert [node.origin for node in graph if node.origin is not None] == [n.h.id, n.r.id]


# -- Graph.copy ------------------------------------------------------------------------------


def test_copy_keeps_ids_names_kinds_labels_and_more() -> None:
    graph, n = build_small_graph()
    clone_of_relu = graph.copy_node(n.r, {}, after=n.ght, phase=BWD, kind=NodeKind.OTHER)
    graph.meta["model"] = {"layers": [1, 2]}
    copy = graph.copy()
    assert len(copy) == len(graph)
    for original, twin in zip(graph, copy, strict=True):
        assert twin is not original and twin.graph is copy
        assert (twin.id, twin.name, twin.op, twin.target, twin.kind, twin.phase, twin.label, twin.origin) == (
            original.id, original.name, original.op, original.target, original.kind, original.phase, original.label,
            original.origin,
        )  # fmt: skip
        assert twin.tensors == original.tensors and twin.is_tuple == original.is_tuple
        assert [o.id for o in twin.operands] == [o.id for o in original.operands]
        assert all(o.graph is copy for o in twin.operands)
        assert [u.id for u in twin.users] == [u.id for u in original.users]
    assert copy.node(clone_of_relu.id).origin == n.r.id
    assert copy.node(n.w.id).label == "w" and copy.node(n.gw.id).label == "w"
    assert copy.meta == graph.meta and copy.meta["model"] is not graph.meta["model"]
    verify(copy)


def test_copy_is_independent() -> None:
    graph, n = build_small_graph()
    before, version = print_graph(graph), graph.version
    copy = graph.copy()
    r = copy.node(n.r.id)
    extra = neg(copy, r, after=r)
    copy.erase(extra)
    copy.erase(copy.node(n.upd.id))
    copy.node(n.gh.id).set_operands((copy.node(n.ge.id), copy.node(n.h.id), 0), {})
    copy.meta["touched"] = True
    assert print_graph(graph) == before and graph.version == version
    assert graph.has_node(n.upd.id) and list(n.r.users) == [n.loss, n.gh]
    assert "touched" not in graph.meta
    # and the other way round
    neg(graph, n.h, after=n.h)
    assert len(copy) == 12
    assert_users_consistent(graph)
    # ids keep growing independently in both graphs
    assert neg(copy, copy.node(n.h.id)).id == neg(graph, n.h).id == 14


# -- the change counter ----------------------------------------------------------------------


def test_version_increases_on_every_mutation() -> None:
    graph, n = build_small_graph()
    seen = [graph.version]

    def bumped() -> None:
        assert graph.version > seen[-1]
        seen.append(graph.version)

    assert graph.version > 0
    node = neg(graph, n.h, after=n.h)
    bumped()
    clone = graph.copy_node(node, {}, after=node)
    bumped()
    assert graph.replace_uses_after(n.h, clone, clone) == 1
    bumped()
    node.set_operands((n.r,), {})
    bumped()
    graph.erase(node)
    bumped()
    with pytest.raises(GraphError):
        graph.erase(clone)
    assert graph.version == seen[-1]  # a refused mutation changes nothing
    assert graph.copy().version == 0  # a copy starts its own count


# -- stable ids ------------------------------------------------------------------------------


def test_stable_ids_survive_mutation_copy_and_printing() -> None:
    graph, n = build_small_graph()
    spare = neg(graph, n.h, after=n.h)
    graph.erase(spare)
    newer = neg(graph, n.h, before=n.r)
    assert newer.id == spare.id + 1  # an erased id is never handed out again
    ids = [node.id for node in graph]
    assert ids == [0, 1, 2, 3, 14, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    text = print_graph(graph)
    assert [line.split(" ", 1)[0] for line in text.splitlines()] == [f"%{i}" for i in ids]
    assert f"= aten.neg.default(%{n.h.id})" in text
    assert f"= aten.relu.default(%{n.h.id})" in text
    copy = graph.copy()
    assert [node.id for node in copy] == ids
    assert print_graph(copy) == text
    assert all(format_node(copy.node(i)) == format_node(graph.node(i)) for i in ids)


def test_operands_follow_every_change_of_the_arguments() -> None:
    """``operands`` is cached per args/kwargs object: new arguments, however set, are seen."""
    graph, n = build_small_graph()
    assert n.gh.operands == [n.ge, n.r]
    n.gh.set_operands((n.ge, n.h, 0.0), {})
    assert n.gh.operands == [n.ge, n.h]
    n.gh._args = (n.h, n.h, 0.0)  # bypassing set_operands, as test_verifier does to break a graph
    assert n.gh.operands == [n.h]
    copied = graph.copy().node(n.gh.id)
    assert [o.id for o in copied.operands] == [n.h.id] and copied.operands[0] is not n.h


def test_arguments_are_walked_and_rebuilt_as_pytree_does() -> None:
    """``iter_nodes`` and ``map_nodes`` walk plain tuples, lists, dicts and fx's immutable lists
    themselves, for speed: every container must give pytree's leaves in pytree's order, and be
    rebuilt as pytree rebuilds it (other containers: pytree's own walk)."""
    import collections

    from torch.fx.immutable_collections import immutable_dict, immutable_list
    from torch.utils import _pytree as pytree

    from mutwo.ir.node import iter_nodes, map_nodes

    graph = build_small_graph()[0]
    a, b, c = graph.nodes[:3]
    pair = collections.namedtuple("pair", "first second")
    structures = [
        (a, [b, 1.5, None], {"k": c, "s": "text"}),
        immutable_list([a, immutable_list([b])]),
        immutable_dict({"x": a, "y": [b, c]}),
        collections.OrderedDict([("z", c), ("a", a)]),
        collections.deque([a, (b, c)]),
        pair(a, [c, b]),
        torch.Size([2, 3]),
        (slice(0, 2), torch.float32, torch.device("cpu"), [a, a]),
        [],
        {},
    ]
    swapped = {a: b, b: c, c: a}
    for value in structures:
        expected = [leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, Node)]
        assert list(iter_nodes(value)) == expected, value
        mapped = map_nodes(value, swapped.__getitem__)
        reference = pytree.tree_map(lambda leaf: swapped[leaf] if isinstance(leaf, Node) else leaf, value)
        assert type(mapped) is type(reference) and mapped == reference, value
