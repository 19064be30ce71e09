"""The IR verifier on deliberately corrupted graphs: one test per invariant it promises.

Each test starts from a graph that verifies, breaks exactly one invariant (through the public API
where it allows the corruption, by poking private fields where it refuses it) and checks that
:func:`verify` names that invariant, the offending node and shows the node in its context.
"""

from __future__ import annotations

import operator
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from mutwo.ir import from_fx
from mutwo.ir.graph import Graph
from mutwo.ir.node import Node, NodeKind, Phase, StorageKey, TensorMeta
from mutwo.ir.printer import format_node
from mutwo.ir.verifier import VerificationError, verify
from mutwo.runtime.capture.iteration import capture

aten = torch.ops.aten
FWD, BWD, OPT = Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER
OWN = StorageKey(-1)  # "the storage of the node being created"


def tensor(shape: tuple[int, ...], storage: StorageKey = OWN, nbytes: int | None = None) -> TensorMeta:
    """A float32 CPU tensor in ``storage`` (by default a fresh storage of the node being created)."""
    size = 4
    for dim in shape:
        size *= dim
    return TensorMeta(shape, torch.float32, "cpu", storage, size if nbytes is None else nbytes)


def storage_of(node: Node) -> StorageKey:
    return node.tensors[0].storage


def build_small_graph() -> tuple[Graph, SimpleNamespace]:
    """A minimal valid iteration: ``relu(x @ w.t()).sum()``, its backward and an SGD update of ``w``.

    ::

        %0  input     forward   x      placeholder
        %1  parameter forward   w      placeholder
        %2  other     forward   wt   = t(w)                     alias of w
        %3  other     forward   h    = mm(x, wt)
        %4  activation forward  r    = relu(h)
        %5  activation forward  loss = sum(r)
        %6  other     backward  ones = ones_like(loss)
        %7  other     backward  ge   = expand(ones, [2, 3])     alias of ones
        %8  other     backward  gh   = threshold_backward(ge, r, 0)
        %9  other     backward  ght  = t(gh)                    alias of gh
        %10 gradient  backward  gw   = mm(ght, x)
        %11 parameter optimizer upd  = add_(w, gw, alpha=-0.1)  in place on w
        %12 other     optimizer output((loss, gw))
    """
    g = Graph()
    n = SimpleNamespace()
    n.x = g.create_node("placeholder", "x", name="x", kind=NodeKind.INPUT, tensors=(tensor((2, 3)),), label="batch")
    n.w = g.create_node("placeholder", "w", name="w", kind=NodeKind.PARAMETER, tensors=(tensor((3, 3)),), label="w")
    n.wt = g.create_node("call_function", aten.t.default, (n.w,), name="t",
                         tensors=(tensor((3, 3), storage_of(n.w), 36),))  # fmt: skip
    n.h = g.create_node("call_function", aten.mm.default, (n.x, n.wt), name="mm", tensors=(tensor((2, 3)),))
    n.r = g.create_node("call_function", aten.relu.default, (n.h,), name="relu", kind=NodeKind.ACTIVATION,
                        tensors=(tensor((2, 3)),))  # fmt: skip
    n.loss = g.create_node("call_function", aten.sum.default, (n.r,), name="sum", kind=NodeKind.ACTIVATION,
                           tensors=(tensor(()),))  # fmt: skip
    n.ones = g.create_node("call_function", aten.ones_like.default, (n.loss,), name="ones_like", phase=BWD,
                           tensors=(tensor(()),))  # fmt: skip
    n.ge = g.create_node("call_function", aten.expand.default, (n.ones, [2, 3]), name="expand", phase=BWD,
                         tensors=(tensor((2, 3), storage_of(n.ones), 4),))  # fmt: skip
    n.gh = g.create_node("call_function", aten.threshold_backward.default, (n.ge, n.r, 0), name="threshold_backward",
                         phase=BWD, tensors=(tensor((2, 3)),))  # fmt: skip
    n.ght = g.create_node("call_function", aten.t.default, (n.gh,), name="t", phase=BWD,
                          tensors=(tensor((3, 2), storage_of(n.gh), 24),))  # fmt: skip
    n.gw = g.create_node("call_function", aten.mm.default, (n.ght, n.x), name="mm", phase=BWD,
                         kind=NodeKind.GRADIENT, tensors=(tensor((3, 3)),), label="w")  # fmt: skip
    n.upd = g.create_node("call_function", aten.add_.Tensor, (n.w, n.gw), {"alpha": -0.1}, name="add_", phase=OPT,
                          kind=NodeKind.PARAMETER, tensors=(tensor((3, 3), storage_of(n.w), 36),))  # fmt: skip
    n.out = g.create_node("output", "output", ((n.loss, n.gw),), name="output", phase=OPT)
    return g, n


def poke_order(graph: Graph, nodes: list[Node]) -> None:
    """Set the node list directly (what the public API refuses to do) and drop the cached positions."""
    graph._nodes = list(nodes)
    graph._index = None


def assert_violation(graph: Graph, invariant: str, node: Node, detail: str = "") -> VerificationError:
    """``verify`` fails on ``invariant`` at ``node``, naming it and marking its line in the context."""
    with pytest.raises(VerificationError) as caught:
        verify(graph)
    error = caught.value
    message = str(error)
    assert error.invariant == invariant, message
    assert error.node is node, message
    assert f"invariant '{invariant}' violated at %{node.id}(" in message
    assert detail in message
    marked = [line for line in message.splitlines() if line.startswith("> ")]
    assert marked == ["> " + format_node(node)], message
    # the context also shows neighbours, unmarked
    assert any(line.startswith("  %") for line in message.splitlines()), message
    return error


# -- the starting points ---------------------------------------------------------------------


def test_small_hand_made_graph_verifies() -> None:
    graph, n = build_small_graph()
    verify(graph)
    assert [node.id for node in graph] == list(range(13))
    assert n.wt.is_alias and storage_of(n.wt) == StorageKey(n.w.id)
    assert n.upd.mutated_operands == [n.w]


@pytest.fixture(scope="module")
def captured_graph() -> Graph:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    batch = torch.randn(2, 4)
    captured, _binding = capture(model, optimizer, batch, lambda out, _batch: out.sum())
    return from_fx(captured.graph_module, [(s.kind, s.label) for s in captured.slots], captured.gradient_labels)


def test_captured_graph_verifies(captured_graph: Graph) -> None:
    verify(captured_graph)
    verify(captured_graph.copy())
    phases = {node.phase for node in captured_graph}
    assert phases == {FWD, BWD, OPT}
    kinds = {node.kind for node in captured_graph}
    assert {NodeKind.PARAMETER, NodeKind.ACTIVATION, NodeKind.GRADIENT, NodeKind.OPTIMIZER_STATE} <= kinds


def test_empty_graph_is_refused() -> None:
    with pytest.raises(VerificationError) as caught:
        verify(Graph())
    assert caught.value.invariant == "single-output"
    assert caught.value.node is None


# -- identity and ownership ------------------------------------------------------------------


def test_unique_ids() -> None:
    graph, n = build_small_graph()
    twin = Node(id=n.h.id, name="twin", op="call_function", target=aten.relu.default, kind=NodeKind.OTHER, phase=FWD,
                tensors=(tensor((2, 3), StorageKey(n.h.id)),))  # fmt: skip
    twin.graph = graph
    nodes = graph.nodes
    nodes.insert(nodes.index(n.r), twin)
    poke_order(graph, nodes)
    assert_violation(graph, "unique-ids", twin, f"id %{n.h.id} is used twice")


def test_unique_names() -> None:
    graph, n = build_small_graph()
    n.r.name = n.h.name  # what the graph's name allocator never does
    assert_violation(graph, "unique-names", n.r, "name 'mm' is used twice")


def test_node_ownership() -> None:
    graph, n = build_small_graph()
    other = Graph()
    stranger = other.create_node("call_function", aten.ones.default, ([2, 3],), name="stranger", node_id=100,
                                 tensors=(tensor((2, 3)),))  # fmt: skip
    nodes = graph.nodes
    nodes.insert(nodes.index(n.wt), stranger)
    poke_order(graph, nodes)
    assert_violation(graph, "node-ownership", stranger, "does not belong to this graph")


# -- order and use lists ---------------------------------------------------------------------


def test_topological_order_use_before_definition() -> None:
    graph, n = build_small_graph()
    nodes = graph.nodes
    nodes.remove(n.r)
    nodes.insert(nodes.index(n.loss) + 1, n.r)  # sum(r) now runs before relu
    poke_order(graph, nodes)
    assert_violation(graph, "topological-order", n.loss, f"operand {n.r!r} is defined after its use")


def test_topological_order_operand_from_another_graph() -> None:
    graph, n = build_small_graph()
    other = Graph()
    stranger = other.create_node("placeholder", "y", name="y", kind=NodeKind.INPUT, tensors=(tensor((2, 3)),))
    n.r._args = (stranger,)  # create_node and set_operands refuse nothing here, but create_node would
    stranger.users[n.r] = None
    assert_violation(graph, "topological-order", n.r, f"operand {stranger!r} is not in the graph")


def test_operand_user_consistency_missing_user() -> None:
    graph, n = build_small_graph()
    del n.h.users[n.r]  # relu still reads mm, but mm forgot it
    assert_violation(graph, "operand-user-consistency", n.r, f"{n.r!r} reads {n.h!r} but is not among its users")


def test_operand_user_consistency_spurious_user() -> None:
    graph, n = build_small_graph()
    n.x.users[n.r] = None  # relu does not read x
    assert_violation(graph, "operand-user-consistency", n.x, f"{n.r!r} is listed as a user but does not read it")


def test_operand_user_consistency_user_missing_from_node_list() -> None:
    graph, n = build_small_graph()
    phantom = Node(id=99, name="phantom", op="call_function", target=aten.neg.default, kind=NodeKind.OTHER, phase=FWD)
    phantom.graph = graph
    phantom.set_operands((n.h,), {})
    assert phantom not in graph.nodes and phantom in n.h.users
    assert_violation(graph, "operand-user-consistency", n.h)


# -- the output ------------------------------------------------------------------------------


def test_single_output_zero_outputs() -> None:
    graph, n = build_small_graph()
    for node in n.out.operands:
        node.users.pop(n.out)
    poke_order(graph, graph.nodes[:-1])
    with pytest.raises(VerificationError) as caught:
        verify(graph)
    assert caught.value.invariant == "single-output"
    assert caught.value.node is None
    assert "the graph has 0 output nodes" in str(caught.value)


def test_single_output_two_outputs() -> None:
    graph, n = build_small_graph()
    second = graph.create_node("output", "output", ((n.loss, n.gw),), name="output", phase=OPT)
    assert second.name != n.out.name
    assert_violation(graph, "single-output", second, "the graph has 2 output nodes")


def test_single_output_output_not_last() -> None:
    graph, n = build_small_graph()
    late = graph.create_node("call_function", aten.neg.default, (n.gw,), name="neg", phase=OPT,
                             tensors=(tensor((3, 3)),))  # fmt: skip
    assert graph.nodes[-1] is late
    assert_violation(graph, "single-output", n.out, "the output node is not the last node")


# -- ops and placement -----------------------------------------------------------------------


def test_known_op() -> None:
    graph, n = build_small_graph()
    n.h.op = "call_module"
    assert_violation(graph, "known-op", n.h, "op 'call_module' is not placeholder, call_function or output")


def test_placeholders_first() -> None:
    graph, n = build_small_graph()
    late = graph.create_node("placeholder", "y", name="y", kind=NodeKind.INPUT, tensors=(tensor((2, 3)),),
                             after=n.wt)  # fmt: skip
    assert graph.position(late) == graph.position(n.wt) + 1
    assert_violation(graph, "placeholders-first", late, "a placeholder comes after a computed node")


def test_phase_order_forward_after_backward() -> None:
    graph, n = build_small_graph()
    stray = graph.create_node("call_function", aten.neg.default, (n.r,), name="neg", phase=FWD,
                              tensors=(tensor((2, 3)),), after=n.ge)  # fmt: skip
    assert_violation(graph, "phase-order", stray, "a forward node follows a backward node")


def test_phase_order_placeholder_outside_forward() -> None:
    graph, n = build_small_graph()
    n.w.phase = BWD
    assert_violation(graph, "phase-order", n.w, "placeholders belong to the forward phase")


def test_phase_order_on_captured_graph(captured_graph: Graph) -> None:
    graph = captured_graph.copy()
    first_optimizer = next(node for node in graph if node.phase is OPT)
    following = graph.nodes[graph.position(first_optimizer) + 1]
    following.phase = BWD
    # Updates may run inside the backward (optimizer-in-backward), but the backward never reads one.
    assert_violation(graph, "phase-order", following, f"a backward node reads %{first_optimizer.id}(")


# -- kinds against phases --------------------------------------------------------------------


def test_kind_phase_activation_in_backward() -> None:
    graph, n = build_small_graph()
    n.gh.kind = NodeKind.ACTIVATION
    assert_violation(graph, "kind-phase-consistency", n.gh, "an activation must be in the forward phase, not backward")


def test_kind_phase_activation_without_backward_user() -> None:
    graph, n = build_small_graph()
    n.h.kind = NodeKind.ACTIVATION  # mm is only read by relu, in the forward
    assert_violation(graph, "kind-phase-consistency", n.h, "an activation must be used by the backward phase")


def test_kind_phase_gradient_in_forward() -> None:
    graph, n = build_small_graph()
    n.h.kind = NodeKind.GRADIENT
    assert_violation(graph, "kind-phase-consistency", n.h, "a gradient must be in the backward phase, not forward")


def test_kind_phase_parameter_view_is_not_an_update() -> None:
    graph, n = build_small_graph()
    n.wt.kind = NodeKind.PARAMETER  # t(w) aliases the parameter but does not write it
    assert n.wt.mutated_operands == []
    assert_violation(graph, "kind-phase-consistency", n.wt,
                     "a computed node of kind parameter must update a parameter placeholder in place")  # fmt: skip


def test_kind_phase_parameter_update_of_non_parameter_storage() -> None:
    graph, n = build_small_graph()
    bump = graph.create_node("call_function", aten.add_.Tensor, (n.gh, 1.0), name="add_", phase=BWD,
                             kind=NodeKind.PARAMETER, tensors=(tensor((2, 3), storage_of(n.gh), 24),),
                             after=n.gh)  # fmt: skip
    assert bump.mutated_operands == [n.gh]
    assert_violation(graph, "kind-phase-consistency", bump,
                     "a computed node of kind parameter must update a parameter placeholder in place")  # fmt: skip


def test_kind_phase_placeholder_of_kind_activation() -> None:
    graph, n = build_small_graph()
    n.x.kind = NodeKind.ACTIVATION
    assert_violation(graph, "kind-phase-consistency", n.x, "a placeholder cannot be of kind activation")


def test_kind_phase_parameter_node_writing_another_tensor() -> None:
    graph, n = build_small_graph()
    # add_ writes gh in place; the node claims to be the parameter w (its storage) all the same
    fake = graph.create_node("call_function", aten.add_.Tensor, (n.gh, n.w), name="add_", phase=BWD,
                             kind=NodeKind.PARAMETER, tensors=(tensor((2, 3), storage_of(n.w), 36),),
                             after=n.gh)  # fmt: skip
    assert fake.mutated_operands == [n.gh]
    assert_violation(graph, "kind-phase-consistency", fake)


# -- storages --------------------------------------------------------------------------------


def test_alias_storage_not_held_by_any_operand() -> None:
    graph, n = build_small_graph()
    view = graph.create_node("call_function", aten.t.default, (n.h,), name="t",
                             tensors=(tensor((3, 2), storage_of(n.x)),), after=n.h)  # fmt: skip
    assert_violation(graph, "alias-storage", view, f"aliases storage %{n.x.id} that none of its operands holds")


def test_alias_storage_created_later() -> None:
    graph, n = build_small_graph()
    n.wt.tensors = (tensor((3, 3), storage_of(n.h), 24),)  # t(w) claims the storage mm allocates after it
    assert_violation(graph, "alias-storage", n.wt, f"aliases storage %{n.h.id} allocated later")


def test_alias_storage_getitem_cannot_allocate() -> None:
    graph, n = build_small_graph()
    pair = graph.create_node("call_function", aten.max.dim, (n.h, 1), name="max", tensors=(tensor((2,)), None),
                             is_tuple=True, after=n.h)  # fmt: skip
    pair.tensors = (tensor((2,), StorageKey(pair.id, 0), 8), tensor((2,), StorageKey(pair.id, 1), 8))
    good = graph.create_node("call_function", operator.getitem, (pair, 0), name="getitem",
                             tensors=(pair.tensors[0],), after=pair)  # fmt: skip
    verify(graph)  # a getitem aliasing its tuple's output is fine
    bad = graph.create_node("call_function", operator.getitem, (pair, 1), name="getitem", tensors=(tensor((2,)),),
                            after=good)  # fmt: skip
    assert bad.owned_bytes == 8
    assert_violation(graph, "alias-storage", bad, "a getitem cannot allocate storage")


def test_alias_storage_negative_size() -> None:
    graph, n = build_small_graph()
    n.h.tensors = (tensor((2, 3), StorageKey(n.h.id), -1),)
    assert_violation(graph, "alias-storage", n.h, "output 0 has a negative size")


# -- recompute clones ------------------------------------------------------------------------


def test_recompute_origin_on_placeholder() -> None:
    graph, n = build_small_graph()
    n.x.origin = n.w.id
    assert_violation(graph, "recompute-origin", n.x, "only computed nodes can be recompute clones")


def test_recompute_origin_on_captured_output(captured_graph: Graph) -> None:
    graph = captured_graph.copy()
    verify(graph)
    graph.output.origin = 0
    assert_violation(graph, "recompute-origin", graph.output, "only computed nodes can be recompute clones")


def test_recompute_clone_made_by_copy_node_verifies() -> None:
    graph, n = build_small_graph()
    clone = graph.copy_node(n.r, {}, before=n.gh, phase=BWD, kind=NodeKind.OTHER)
    assert clone.origin == n.r.id
    verify(graph)
