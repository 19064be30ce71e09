"""Storage liveness, the memory simulator, the liveness/memory/profile passes and the reports.

Every expected number below is computed by hand in a comment next to the graph it belongs to,
never by the code under test. Most graphs give each storage a size that is a distinct power of
ten, so that a byte count reads as the set of storages live at that moment (digit k set means
the storage of 10**k bytes is live).
"""

from __future__ import annotations

import csv
import json
import operator
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from mutwo.ir import from_fx
from mutwo.ir.budget import readable_bytes
from mutwo.ir.graph import Graph
from mutwo.ir.liveness import compute_liveness
from mutwo.ir.memory import BREAKDOWN_NAMES, describe_breakdown, simulate
from mutwo.ir.node import Node, NodeKind, Phase, StorageKey, TensorMeta
from mutwo.ir.pass_base import PassContext
from mutwo.passes.liveness import COLUMNS, LivenessPass
from mutwo.passes.memory import MemoryPass
from mutwo.passes.profile import ProfilePass, unsteady_runs
from mutwo.runtime.capture.iteration import capture
from mutwo.runtime.measurement import profiler as profiler_module
from mutwo.tools.reports import write_reports
from tests import models
from tests.scaling import assert_linear

aten = torch.ops.aten
FWD, BWD, OPT = Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER
OWN = StorageKey(-1)  # "the storage of the node being created"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
KIND_NAMES = ("parameter", "buffer", "optimizer_state", "input", "communication", "gradient", "activation", "other")


def meta(nbytes: int, storage: StorageKey = OWN, device: str = "cpu", shape: tuple[int, ...] = (2, 4)) -> TensorMeta:
    """A float32 tensor in ``storage`` whose storage takes ``nbytes`` (shapes do not matter here)."""
    return TensorMeta(shape, torch.float32, device, storage, nbytes)


def key(node: Node) -> StorageKey:
    return node.tensors[0].storage


def breakdown(**values: int) -> dict[str, int]:
    """A breakdown by kind with every kind present, zero unless given."""
    totals = dict.fromkeys(KIND_NAMES, 0)
    totals.update(values)
    return totals


# -- the hand-made training iteration ---------------------------------------------------------


def build_training_graph(optimizer_temp: bool = False) -> tuple[Graph, SimpleNamespace]:
    """``sum(relu(view(x @ w)))``, its backward and an SGD update of ``w``.

    ::

        rank id  kind       phase     node                                    storage  bytes
        0    %0  parameter  forward   w    placeholder                        %0       1
        1    %1  input      forward   x    placeholder                        %1       10
        2    %2  other      forward   a  = mm(x, w)                           %2       100
        3    %3  other      forward   v  = view(a)                            alias %2
        4    %4  activation forward   r  = relu(v)                            %4       1000
        5    %5  activation forward   s  = sum(r)          (returned: loss)   %5       10000
        6    %6  other      backward  g  = ones_like(s)                       %6       100000
        7    %7  other      backward  ge = expand(g)                          alias %6
        8    %8  other      backward  gr = threshold_backward(ge, r, 0)       %8       1000000
        9    %9  other      backward  gv = view(gr)                           alias %8
        10   %10 other      backward  xt = t(x)                               alias %1
        11   %11 other      backward  gwr = mm(xt, gv)                        %11      10000000
        12   %12 gradient   backward  gw = view(gwr)       (returned)         alias %11
        [optimizer_temp only:
        13   %13 other      optimizer tmp = mul(gw, 0.5)                      %13      100000000]
        13/14    parameter  optimizer upd = add_(w, gw or tmp, alpha=-0.1)    alias %0
        14/15    other      optimizer output((s, gw))
    """
    g = Graph()
    n = SimpleNamespace()
    n.w = g.create_node("placeholder", "w", name="w", kind=NodeKind.PARAMETER, tensors=(meta(1),), label="w")
    n.x = g.create_node("placeholder", "x", name="x", kind=NodeKind.INPUT, tensors=(meta(10),), label="batch")
    n.a = g.create_node("call_function", aten.mm.default, (n.x, n.w), name="mm", tensors=(meta(100),))
    n.v = g.create_node("call_function", aten.view.default, (n.a, [8]), name="view",
                        tensors=(meta(100, key(n.a)),))  # fmt: skip
    n.r = g.create_node("call_function", aten.relu.default, (n.v,), name="relu", kind=NodeKind.ACTIVATION,
                        tensors=(meta(1000),))  # fmt: skip
    n.s = g.create_node("call_function", aten.sum.default, (n.r,), name="sum", kind=NodeKind.ACTIVATION,
                        tensors=(meta(10000),))  # fmt: skip
    n.g = g.create_node("call_function", aten.ones_like.default, (n.s,), name="ones_like", phase=BWD,
                        tensors=(meta(100000),))  # fmt: skip
    n.ge = g.create_node("call_function", aten.expand.default, (n.g, [8]), name="expand", phase=BWD,
                         tensors=(meta(100000, key(n.g)),))  # fmt: skip
    n.gr = g.create_node("call_function", aten.threshold_backward.default, (n.ge, n.r, 0),
                         name="threshold_backward", phase=BWD, tensors=(meta(1000000),))  # fmt: skip
    n.gv = g.create_node("call_function", aten.view.default, (n.gr, [2, 4]), name="view", phase=BWD,
                         tensors=(meta(1000000, key(n.gr)),))  # fmt: skip
    n.xt = g.create_node("call_function", aten.t.default, (n.x,), name="t", phase=BWD, tensors=(meta(10, key(n.x)),))
    n.gwr = g.create_node("call_function", aten.mm.default, (n.xt, n.gv), name="mm", phase=BWD,
                          tensors=(meta(10000000),))  # fmt: skip
    n.gw = g.create_node("call_function", aten.view.default, (n.gwr, [3, 4]), name="view", phase=BWD,
                         kind=NodeKind.GRADIENT, tensors=(meta(10000000, key(n.gwr)),), label="w")  # fmt: skip
    step = n.gw
    if optimizer_temp:
        n.tmp = g.create_node("call_function", aten.mul.Tensor, (n.gw, 0.5), name="mul", phase=OPT,
                              tensors=(meta(100000000),))  # fmt: skip
        step = n.tmp
    n.upd = g.create_node("call_function", aten.add_.Tensor, (n.w, step), {"alpha": -0.1}, name="add_", phase=OPT,
                          kind=NodeKind.PARAMETER, tensors=(meta(1, key(n.w)),))  # fmt: skip
    n.out = g.create_node("output", "output", ((n.s, n.gw),), name="output", phase=OPT)
    return g, n


def test_a_breakdown_reads_each_share_in_its_own_unit() -> None:
    """A small share of the peak reads as KiB or bytes, not as 0.0 MiB beside the large ones."""
    assert (readable_bytes(3 * 2**20 // 2), readable_bytes(12 * 2**10), readable_bytes(512)) == \
        ("1.5 MiB", "12.0 KiB", "512 B")  # fmt: skip
    text = describe_breakdown({"parameter": 2 * 2**20, "input": 3 * 2**10, "activation": 0})
    assert text == "parameters 2.0 MiB, batch 3.0 KiB"


def test_a_breakdown_in_a_messages_unit_reads_small_shares_as_under_a_tenth() -> None:
    """In a message whose sizes are all in one unit (a budget refusal), so is its breakdown."""
    text = describe_breakdown({"parameter": 2 * 2**20, "input": 3 * 2**10, "activation": 4}, "MiB")
    assert text == "parameters 2.0 MiB, batch < 0.1 MiB, activations < 0.1 MiB"
    assert describe_breakdown({"parameter": 1500, "activation": 4}, "B") == "parameters 1,500 B, activations 4 B"


def test_training_graph_has_the_ids_the_tables_assume() -> None:
    graph, n = build_training_graph()
    assert [node.id for node in graph] == list(range(15))
    assert [node.id for node in build_training_graph(optimizer_temp=True)[0]] == list(range(16))
    assert (n.gwr.id, n.gw.id, n.upd.id, n.out.id) == (11, 12, 13, 14)


# Expected liveness of the training graph, derived by hand from the table in its docstring.
# (bytes, kind, persistent, created, last_forward_use, first_backward_use, last_backward_use, last_use,
#  holders, is_activation, inactive_interval, returned)
EXPECTED_LIVENESS = {
    # w: read by mm (2, fwd) and add_ (13, optimizer); add_ is in place so it holds %0 too; a
    # placeholder lives to the output's rank 14.
    StorageKey(0): (1, NodeKind.PARAMETER, True, 0, 2, None, None, 14, [0, 13], False, None, False),
    # x: read by mm (2, fwd) and t (10, bwd); t's view is read by mm at 11. Kind: input beats other.
    StorageKey(1): (10, NodeKind.INPUT, True, 1, 2, 10, 11, 14, [1, 10], False, None, False),
    # a: its view v is read by relu at 4, so it lives to 4 (not 3); never read by the backward.
    StorageKey(2): (100, NodeKind.OTHER, False, 2, 4, None, None, 4, [2, 3], False, None, False),
    # r: read by sum (5) then threshold_backward (8): an activation idle from 5 to 8.
    StorageKey(4): (1000, NodeKind.ACTIVATION, False, 4, 5, 8, 8, 8, [4], True, (5, 8), False),
    # s (the loss): read only by ones_like (6, bwd) and the output: no forward use, so its inactive
    # interval starts at its creation (5); returned, so it lives to the output (14).
    StorageKey(5): (10000, NodeKind.ACTIVATION, False, 5, None, 6, 6, 14, [5], True, (5, 6), True),
    # g: created in the backward, read through expand by threshold_backward at 8: not an activation.
    StorageKey(6): (100000, NodeKind.OTHER, False, 6, None, 7, 8, 8, [6, 7], False, None, False),
    # gr: its view gv is read by mm at 11.
    StorageKey(8): (1000000, NodeKind.OTHER, False, 8, None, 9, 11, 11, [8, 9], False, None, False),
    # gwr: held by the gradient view gw (kind: gradient beats other); gw is returned.
    StorageKey(11): (10000000, NodeKind.GRADIENT, False, 11, None, 12, 12, 14, [11, 12], False, None, True),
}


def test_liveness_of_every_storage() -> None:
    graph, _ = build_training_graph()
    liveness = compute_liveness(graph)
    assert liveness.version == graph.version
    assert liveness.rank == {i: i for i in range(15)}
    assert set(liveness.storages) == set(EXPECTED_LIVENESS)
    for storage, expected in EXPECTED_LIVENESS.items():
        record = liveness.storages[storage]
        actual = (record.bytes, record.kind, record.persistent, record.created, record.last_forward_use,
                  record.first_backward_use, record.last_backward_use, record.last_use, record.holders,
                  record.is_activation, record.inactive_interval, record.returned)  # fmt: skip
        assert actual == expected, f"storage {storage}"
        assert record.device == "cpu"
    assert sorted(r.key for r in liveness.activations()) == [StorageKey(4), StorageKey(5)]


def test_allocation_and_free_points() -> None:
    graph, n = build_training_graph()
    liveness = compute_liveness(graph)
    # Non-persistent storages are allocated at their creator's rank...
    assert liveness.allocated_at == {2: [StorageKey(2)], 4: [StorageKey(4)], 5: [StorageKey(5)],
                                     6: [StorageKey(6)], 8: [StorageKey(8)], 11: [StorageKey(11)]}  # fmt: skip
    # ...and freed after their last use, except the returned ones (%5, %11) and placeholders.
    freed = {rank: sorted(keys) for rank, keys in liveness.freed_after.items()}
    assert freed == {4: [StorageKey(2)], 8: [StorageKey(4), StorageKey(6)], 11: [StorageKey(8)]}
    # A view, an expand and an in-place update hold their base's storage.
    assert [r.key for r in liveness.of_node(n.v)] == [StorageKey(2)]
    assert [r.key for r in liveness.of_node(n.upd)] == [StorageKey(0)]
    assert [r.key for r in liveness.of_node(n.xt)] == [StorageKey(1)]


def test_an_unread_view_keeps_its_storage_until_it_is_defined() -> None:
    """Defining a view reads its base: a view of ``a`` that nothing reads, placed after ``s``
    (rank 6 once inserted), moves a's free point from 4 to 6 and becomes one of its holders."""
    graph, n = build_training_graph()
    dead = graph.create_node("call_function", aten.view.default, (n.a, [8]), name="view",
                             tensors=(meta(100, key(n.a)),), before=n.g)  # fmt: skip
    liveness = compute_liveness(graph)
    record = liveness.storages[StorageKey(2)]
    assert (record.holders, record.last_use, record.last_forward_use) == ([2, 3, dead.id], 6, 6)
    assert StorageKey(2) in liveness.freed_after[6]
    # r4 1111 (a still live), r5 11111, r6 the dead view 11111, then a is freed
    assert simulate(graph, liveness).curve[4:8] == [1111, 11111, 11111, 111011]


def test_kind_follows_precedence_not_creator() -> None:
    """A storage created by an 'other' node and held by a later node of a more significant kind
    takes that kind, whichever holder comes first."""
    graph, n = build_training_graph()
    # make the in-place update of w an 'other' node: the placeholder's kind (parameter) still wins
    n.upd.kind = NodeKind.OTHER
    # make the view of a an activation: activation beats other although the creator is 'other'
    n.v.kind = NodeKind.ACTIVATION
    # make the base of the gradient a gradient and its view 'other': still gradient
    n.gwr.kind, n.gw.kind = NodeKind.GRADIENT, NodeKind.OTHER
    liveness = compute_liveness(graph)
    assert liveness.storages[StorageKey(0)].kind is NodeKind.PARAMETER
    assert liveness.storages[StorageKey(2)].kind is NodeKind.ACTIVATION
    assert liveness.storages[StorageKey(11)].kind is NodeKind.GRADIENT
    # an optimizer-state holder of an input's storage outranks input
    n.xt.kind = NodeKind.OPTIMIZER_STATE
    graph.mark_changed()
    assert compute_liveness(graph).storages[StorageKey(1)].kind is NodeKind.OPTIMIZER_STATE


# -- views, tuples and in-place results own nothing ------------------------------------------


def build_tuple_graph() -> tuple[Graph, SimpleNamespace]:
    """A three-output op with getitems of outputs 0 and 2 only, and an in-place op.

    ::

        rank id  node                                            storages (bytes)
        0    %0  x  placeholder (input)                          %0 (1)
        1    %1  bn = native_batch_norm(x, ...) -> tuple         %1 (100), %1.1 (1000), %1.2 (10000)
        2    %2  y  = getitem(bn, 0)                             alias %1
        3    %3  m  = getitem(bn, 2)                             alias %1.2
        4    %4  z  = relu(y)                                    %4 (100000)
        5    %5  z2 = relu_(z)                                   alias %4 (in place)
        6    %6  k  = neg(m)                                     %6 (1000000)
        7    %7  zz = sum(z2)                                    %7 (10000000)
        8    %8  output((zz, k))
    """
    g = Graph()
    n = SimpleNamespace()
    n.x = g.create_node("placeholder", "x", name="x", kind=NodeKind.INPUT, tensors=(meta(1),), label="batch")
    bn_args = (n.x, None, None, None, None, True, 0.1, 1e-5)
    n.bn = g.create_node("call_function", aten.native_batch_norm.default, bn_args, name="native_batch_norm",
                         is_tuple=True,
                         tensors=(meta(100, StorageKey(-1, 0)), meta(1000, StorageKey(-1, 1), shape=(4,)),
                                  meta(10000, StorageKey(-1, 2), shape=(4,))))  # fmt: skip
    n.y = g.create_node("call_function", operator.getitem, (n.bn, 0), name="getitem",
                        tensors=(meta(100, StorageKey(1, 0)),))  # fmt: skip
    n.m = g.create_node("call_function", operator.getitem, (n.bn, 2), name="getitem",
                        tensors=(meta(10000, StorageKey(1, 2), shape=(4,)),))  # fmt: skip
    n.z = g.create_node("call_function", aten.relu.default, (n.y,), name="relu", tensors=(meta(100000),))
    n.z2 = g.create_node("call_function", aten.relu_.default, (n.z,), name="relu_", tensors=(meta(100000, key(n.z)),))
    n.k = g.create_node("call_function", aten.neg.default, (n.m,), name="neg", tensors=(meta(1000000, shape=(4,)),))
    n.zz = g.create_node("call_function", aten.sum.default, (n.z2,), name="sum", tensors=(meta(10000000),))
    n.out = g.create_node("output", "output", ((n.zz, n.k),), name="output")
    return g, n


def test_aliases_own_no_bytes() -> None:
    graph, n = build_tuple_graph()
    # the tuple node allocates all three storages: 100 + 1000 + 10000
    assert n.bn.owned_bytes == 11100
    assert [m.storage for m in n.bn.owned_storages()] == [StorageKey(1, 0), StorageKey(1, 1), StorageKey(1, 2)]
    for alias in (n.y, n.m, n.z2):
        assert alias.owned_bytes == 0 and alias.is_alias, alias
    training, t = build_training_graph()
    for alias in (t.v, t.ge, t.gv, t.xt, t.gw, t.upd):
        assert alias.owned_bytes == 0 and alias.is_alias, alias
    assert t.a.owned_bytes == 100 and not t.a.is_alias


def test_tuple_storages_live_until_their_getitems_last_use() -> None:
    graph, n = build_tuple_graph()
    liveness = compute_liveness(graph)
    s = liveness.storages
    # all three are allocated at the tuple node (rank 1)
    assert sorted(liveness.allocated_at[1]) == [StorageKey(1, 0), StorageKey(1, 1), StorageKey(1, 2)]
    assert all(s[StorageKey(1, i)].created == 1 for i in range(3))
    # output 0: getitem y (2) is read by relu at 4
    assert (s[StorageKey(1, 0)].last_use, s[StorageKey(1, 0)].holders) == (4, [1, 2])
    # output 1 has no getitem: it dies with the tuple, whose last reader is the getitem at 3
    assert (s[StorageKey(1, 1)].last_use, s[StorageKey(1, 1)].holders) == (3, [1])
    # output 2: getitem m (3) is read by neg at 6
    assert (s[StorageKey(1, 2)].last_use, s[StorageKey(1, 2)].holders) == (6, [1, 3])
    # the in-place relu_ holds z's storage, whose last reader is then sum at 7
    assert (s[StorageKey(4)].last_use, s[StorageKey(4)].holders) == (7, [4, 5])
    freed = {rank: sorted(keys) for rank, keys in liveness.freed_after.items()}
    assert freed == {3: [StorageKey(1, 1)], 4: [StorageKey(1, 0)], 6: [StorageKey(1, 2)], 7: [StorageKey(4)]}


def test_simulator_curve_does_not_step_at_aliases() -> None:
    graph, n = build_tuple_graph()
    simulation = simulate(graph)
    # persistent: x = 1
    # r0 x        1
    # r1 bn       1 + 100 + 1000 + 10000                      = 11101
    # r2 y        no allocation                               = 11101
    # r3 m        11101; then %1.1 (1000) is freed            -> 10101
    # r4 z        10101 + 100000 = 110101; then %1 (100) freed -> 110001
    # r5 z2       in place: no allocation                     = 110001
    # r6 k        110001 + 1000000 = 1110001; %1.2 freed      -> 1100001
    # r7 zz       1100001 + 10000000 = 11100001; %4 freed     -> 11000001
    # r8 output   11000001 (zz and k are returned)
    assert simulation.curve == [1, 11101, 11101, 11101, 110101, 110001, 1110001, 11100001, 11000001]
    assert simulation.persistent_bytes == 1
    assert (simulation.peak_bytes, simulation.peak_rank, simulation.peak_node) == (11100001, 7, 7)
    assert simulation.device == "cpu"


# -- the simulator on the training graph -----------------------------------------------------

# Persistent: w (1) + x (10) = 11. Allocations and frees from test_allocation_and_free_points:
# r0 11, r1 11, r2 +100 = 111, r3 111, r4 +1000 = 1111 (then -100 -> 1011), r5 +10000 = 11011,
# r6 +100000 = 111011, r7 111011, r8 +1000000 = 1111011 (then -1000 -100000 -> 1010011),
# r9 1010011, r10 1010011, r11 +10000000 = 11010011 (then -1000000 -> 10010011),
# r12 10010011, r13 10010011, r14 10010011 (s and gw are returned and stay to the end).
TRAINING_CURVE = [11, 11, 111, 111, 1111, 11011, 111011, 111011, 1111011, 1010011, 1010011, 11010011,
                  10010011, 10010011, 10010011]  # fmt: skip


def test_simulated_curve_peak_and_breakdown() -> None:
    graph, _ = build_training_graph()
    simulation = simulate(graph)
    assert simulation.device == "cpu"
    assert simulation.persistent_bytes == 11
    assert simulation.curve == TRAINING_CURVE
    # peak at gwr = mm (rank 11), in the backward
    assert (simulation.peak_bytes, simulation.peak_rank, simulation.peak_node) == (11010011, 11, 11)
    assert simulation.peak_phase == "backward"
    # live at rank 11: w (parameter 1), x (input 10), s (activation 10000), gr (other 1000000),
    # gwr (gradient 10000000); r (freed after 8) and g (freed after 8) are gone.
    assert simulation.breakdown == breakdown(parameter=1, input=10, activation=10000, other=1000000,
                                             gradient=10000000)  # fmt: skip
    # a returned storage stays live to the end: the last point still holds s and gw
    assert simulation.curve[-1] == 11 + 10000 + 10000000


def test_simulate_reuses_given_liveness_only_for_the_same_version() -> None:
    graph, n = build_training_graph()
    stale = compute_liveness(graph)
    # add a node after computing liveness: the stale liveness must not be used
    graph.create_node("call_function", aten.neg.default, (n.r,), name="neg", tensors=(meta(5),), before=n.s)
    simulation = simulate(graph, stale)
    # the new node (rank 5) allocates 5 bytes, read by nothing, freed right after it:
    # r5 = w 1 + x 10 + r 1000 + neg 5 = 1016; r6 (sum) = 11 + 1000 + 10000 = 11011
    assert simulation.curve[5] == 1016
    assert simulation.curve[6] == 11011
    assert len(simulation.curve) == 16


def test_workspace_counts_only_while_its_node_runs() -> None:
    graph, _ = build_training_graph()
    # 5 bytes of workspace at the view (rank 3), not at the peak: only that point moves
    small = simulate(graph, workspace={3: 5})
    assert small.curve == TRAINING_CURVE[:3] + [111 + 5] + TRAINING_CURVE[4:]
    assert small.peak_bytes == 11010011 and "workspace" not in small.breakdown
    # 20,000,000 bytes at ones_like (rank 6): 111011 + 20000000 = 20111011 becomes the peak
    big = simulate(graph, workspace={6: 20000000})
    assert big.curve == TRAINING_CURVE[:6] + [20111011] + TRAINING_CURVE[7:]
    assert (big.peak_bytes, big.peak_rank, big.peak_node, big.peak_phase) == (20111011, 6, 6, "backward")
    # live at rank 6: w 1, x 10, r (activation 1000), s (activation 10000), g (other 100000)
    assert big.breakdown == {**breakdown(parameter=1, input=10, activation=11000, other=100000),
                             "workspace": 20000000}  # fmt: skip


def build_cuda_graph() -> tuple[Graph, SimpleNamespace]:
    """Tensors on cuda:0 of awkward sizes, a zero-byte one, and CPU scalars.

    ::

        rank id  node                           device  bytes  cuda:0 cost
        0    %0  w  placeholder (parameter)     cuda:0  100    512
        1    %1  x  placeholder (input)         cuda:0  1000   1024
        2    %2  lr placeholder (input)         cpu     8      0 (another device)
        3    %3  e  = empty                     cuda:0  0      0 (never read: freed after 3)
        4    %4  a  = mm(x, w)                  cuda:0  513    1024 (freed after 6)
        5    %5  c  = mul(lr, 2)                cpu     4      0 (returned)
        6    %6  b  = relu(a)   (activation)    cuda:0  512    512 (returned)
        7    %7  output((b, c))
    """
    g = Graph()
    n = SimpleNamespace()
    cuda = "cuda:0"
    n.w = g.create_node("placeholder", "w", name="w", kind=NodeKind.PARAMETER, tensors=(meta(100, device=cuda),))
    n.x = g.create_node("placeholder", "x", name="x", kind=NodeKind.INPUT, tensors=(meta(1000, device=cuda),))
    n.lr = g.create_node("placeholder", "lr", name="lr", kind=NodeKind.INPUT, tensors=(meta(8, shape=()),))
    n.e = g.create_node("call_function", aten.empty.memory_format, ([0],), name="empty",
                        tensors=(meta(0, device=cuda, shape=(0,)),))  # fmt: skip
    n.a = g.create_node("call_function", aten.mm.default, (n.x, n.w), name="mm", tensors=(meta(513, device=cuda),))
    n.c = g.create_node("call_function", aten.mul.Tensor, (n.lr, 2), name="mul", tensors=(meta(4, shape=()),))
    n.b = g.create_node("call_function", aten.relu.default, (n.a,), name="relu", kind=NodeKind.ACTIVATION,
                        tensors=(meta(512, device=cuda),))  # fmt: skip
    n.out = g.create_node("output", "output", ((n.b, n.c),), name="output")
    return g, n


def test_cuda_sizes_are_rounded_and_other_devices_ignored() -> None:
    graph, _ = build_cuda_graph()
    simulation = simulate(graph, device="cuda:0")
    # persistent: w 512 + x 1024 + lr 0 = 1536
    # r0-r2 1536, r3 +0 = 1536, r4 +1024 = 2560, r5 +0 = 2560, r6 +512 = 3072 (then a's 1024 freed),
    # r7 2048
    assert simulation.persistent_bytes == 1536
    assert simulation.curve == [1536, 1536, 1536, 1536, 2560, 2560, 3072, 2048]
    assert (simulation.peak_bytes, simulation.peak_node, simulation.device) == (3072, 6, "cuda:0")
    # at rank 6: parameter 512, input 1024 (x) + 0 (lr), other 1024 (a), activation 512 (b)
    assert simulation.breakdown == breakdown(parameter=512, input=1024, other=1024, activation=512)
    # the main device is the parameters' device, so the default is the same simulation
    assert simulate(graph).curve == simulation.curve
    # simulating the CPU side instead: lr 8 persistent, c 4 from rank 5 on, nothing rounded
    cpu = simulate(graph, device="cpu")
    assert cpu.curve == [8, 8, 8, 8, 8, 12, 12, 12]
    assert (cpu.persistent_bytes, cpu.peak_bytes, cpu.peak_node) == (8, 12, 5)


# -- a peak in the optimizer step ------------------------------------------------------------


def test_peak_in_the_optimizer_step() -> None:
    graph, n = build_training_graph(optimizer_temp=True)
    simulation = simulate(graph)
    # as TRAINING_CURVE up to rank 12 (10010011), then tmp (rank 13) adds 100000000 -> 110010011;
    # tmp is read by add_ at 14 and freed after it: 10010011 at 14 and at the output (15)
    assert simulation.curve == TRAINING_CURVE[:13] + [110010011, 110010011, 10010011]
    assert (simulation.peak_bytes, simulation.peak_rank, simulation.peak_node) == (110010011, 13, n.tmp.id)
    assert simulation.peak_phase == "optimizer"
    # live at 13: w 1, x 10, s 10000 (activation), gwr 10000000 (gradient), tmp 100000000 (other)
    assert simulation.breakdown == breakdown(parameter=1, input=10, activation=10000, gradient=10000000,
                                             other=100000000)  # fmt: skip


def test_memory_pass_says_the_optimizer_peak_cannot_be_recomputed_away(tmp_path: Path) -> None:
    messages: list[str] = []
    graph, _ = build_training_graph(optimizer_temp=True)
    ctx = PassContext(out_dir=tmp_path, log=messages.append)
    MemoryPass().run(graph, ctx)
    assert ctx.artifacts["memory"].peak_node == 13
    sentence = ("memory: the peak lies in the optimizer step, where recomputing activations cannot lower it; the "
                "optimizer passes (optimizer-in-backward, foreach-buckets) can")  # fmt: skip
    assert sentence in messages
    assert any("at %13 (aten.mul.Tensor, optimizer)" in m for m in messages), messages
    breakdown = ctx.artifacts["memory"].breakdown  # the log says what the peak holds, largest first
    largest = max((kind for kind in breakdown if breakdown[kind]), key=breakdown.__getitem__)
    assert any(f"the peak holds {BREAKDOWN_NAMES[largest]} " in m for m in messages), messages
    # a backward peak does not get that sentence
    messages.clear()
    MemoryPass().run(build_training_graph()[0], PassContext(log=messages.append))
    assert messages and not any("optimizer step" in m for m in messages), messages
    assert any("at %11 (aten.mm.default, backward)" in m for m in messages), messages


# -- the passes' files -----------------------------------------------------------------------


def test_liveness_pass_writes_live_ranges_csv(tmp_path: Path) -> None:
    graph, _ = build_training_graph()
    messages: list[str] = []
    ctx = PassContext(out_dir=tmp_path, log=messages.append)
    result = LivenessPass().run(graph, ctx)
    assert ctx.artifacts["liveness"] is result
    with (tmp_path / "live_ranges.csv").open(newline="") as handle:
        rows = list(csv.reader(handle))
    assert tuple(rows[0]) == COLUMNS == ("storage", "bytes", "kind", "device", "persistent", "activation",
                                         "created", "last_forward_use", "first_backward_use",
                                         "last_backward_use", "last_use", "holders")  # fmt: skip
    # one row per storage, sorted by storage; values from EXPECTED_LIVENESS, None written empty
    assert rows[1:] == [
        ["%0", "1", "parameter", "cpu", "True", "False", "0", "2", "", "", "14", "%0 %13"],
        ["%1", "10", "input", "cpu", "True", "False", "1", "2", "10", "11", "14", "%1 %10"],
        ["%2", "100", "other", "cpu", "False", "False", "2", "4", "", "", "4", "%2 %3"],
        ["%4", "1000", "activation", "cpu", "False", "True", "4", "5", "8", "8", "8", "%4"],
        ["%5", "10000", "activation", "cpu", "False", "True", "5", "", "6", "6", "14", "%5"],
        ["%6", "100000", "other", "cpu", "False", "False", "6", "", "7", "8", "8", "%6 %7"],
        ["%8", "1000000", "other", "cpu", "False", "False", "8", "", "9", "11", "11", "%8 %9"],
        ["%11", "10000000", "gradient", "cpu", "False", "False", "11", "", "12", "12", "14", "%11 %12"],
    ]
    assert any("8 storages, 2 activations" in m for m in messages), messages


def test_liveness_pass_caches_per_graph_version(tmp_path: Path) -> None:
    graph, n = build_training_graph()
    ctx = PassContext(out_dir=tmp_path)
    first = LivenessPass().run(graph, ctx)
    assert LivenessPass().run(graph, ctx) is first
    graph.create_node("call_function", aten.neg.default, (n.r,), name="neg", tensors=(meta(5),), before=n.s)
    second = LivenessPass().run(graph, ctx)
    assert second is not first and len(second.storages) == 9
    rows = list(csv.reader((tmp_path / "live_ranges.csv").open(newline="")))
    # the new node has id 15 but rank 5: rows stay sorted by storage, not by execution order
    assert [row[0] for row in rows[1:]] == ["%0", "%1", "%2", "%4", "%5", "%6", "%8", "%11", "%15"]
    assert rows[-1][1:] == ["5", "other", "cpu", "False", "False", "5", "", "", "", "5", "%15"]


def test_memory_pass_writes_memory_json(tmp_path: Path) -> None:
    graph, _ = build_training_graph()
    ctx = PassContext(out_dir=tmp_path)
    MemoryPass().run(graph, ctx)
    data = json.loads((tmp_path / "memory.json").read_text())
    assert data["peak_bytes"] == 11010011
    assert data["peak_node"] == 11
    assert data["peak_rank"] == 11
    assert data["peak_phase"] == "backward"
    assert data["persistent_bytes"] == 11
    assert data["device"] == "cpu"
    assert data["breakdown_at_peak"] == breakdown(parameter=1, input=10, activation=10000, other=1000000,
                                                  gradient=10000000)  # fmt: skip
    assert data["curve"] == TRAINING_CURVE


def test_memory_pass_uses_the_profiles_workspace(tmp_path: Path) -> None:
    graph, _ = build_training_graph()
    ctx = PassContext(out_dir=tmp_path)
    ctx.artifacts["profile"] = profiler_module.Profile(
        "cpu", profiler_module.fingerprint(graph),
        {6: profiler_module.NodeProfile(1e-3, workspace=20000000), 3: profiler_module.NodeProfile(1e-3)}, runs=1)
    MemoryPass().run(graph, ctx)
    data = json.loads((tmp_path / "memory.json").read_text())
    # as test_workspace_counts_only_while_its_node_runs: 111011 + 20000000 at ones_like
    assert (data["peak_bytes"], data["peak_node"]) == (20111011, 6)
    assert data["breakdown_at_peak"]["workspace"] == 20000000


# -- reports and the profiler on a captured model --------------------------------------------


CapturedMlp = tuple[Graph, list[torch.Tensor]]


@pytest.fixture(scope="module")
def captured_mlp() -> CapturedMlp:
    workload = models.mlp()
    optimizer = models.OPTIMIZERS["sgd"](workload.model.parameters())
    captured, binding = capture(workload.model, optimizer, workload.batch, workload.loss_fn)
    graph = from_fx(captured.graph_module, [(s.kind, s.label) for s in captured.slots], captured.gradient_labels)
    inputs = binding.flat_inputs(workload.batch) + list(captured.constants.values())
    return graph, inputs


@pytest.fixture(scope="module")
def mlp_profile(captured_mlp: CapturedMlp) -> profiler_module.Profile:
    graph, inputs = captured_mlp
    return profiler_module.profile_graph(graph, inputs, runs=2, warmup=1, iteration_runs=2)


def test_reports_are_written(tmp_path: Path, captured_mlp: CapturedMlp, mlp_profile: profiler_module.Profile) -> None:
    graph, _ = captured_mlp
    liveness = compute_liveness(graph)
    simulation = simulate(graph, liveness)
    names = write_reports(tmp_path, graph, simulation, liveness, mlp_profile, "mlp")
    assert names == ["memory_timeline.png", "peak_breakdown.png", "activations.md"]
    for name in ("memory_timeline.png", "peak_breakdown.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == PNG_SIGNATURE and len(data) > 1000, name
    assert not list(tmp_path.glob(".*")), "temporary files left behind"
    report = (tmp_path / "activations.md").read_text()
    activations = liveness.activations()
    assert activations, "an MLP keeps activations for its backward"
    assert report.startswith(f"# Activations: {len(activations)}, ")
    for record in activations[:15]:
        assert f"| {record.key} | {graph.node(record.key.creator).op_name} |" in report
    # without a profile the second table ranks by span in nodes
    write_reports(tmp_path, graph, simulation, liveness, None, "mlp")
    assert "by inactive span (nodes)" in (tmp_path / "activations.md").read_text()


def test_activation_report_lists_hand_made_activations(tmp_path: Path) -> None:
    graph, _ = build_training_graph()
    liveness = compute_liveness(graph)
    write_reports(tmp_path, graph, simulate(graph, liveness), liveness, None, "hand")
    report = (tmp_path / "activations.md").read_text()
    # two activations: r (%4, 1000 B, idle 5 -> 8: 3 nodes) and s (%5, 10000 B, idle 5 -> 6: 1 node)
    assert report.startswith("# Activations: 2, 0.0 MiB in all")
    assert "| %4 | aten.relu.default | 0.00 | 3 | 0.00 |" in report
    assert "| %5 | aten.sum.default | 0.01 | 1 | 0.00 |" in report
    assert "%2 |" not in report and "%11 |" not in report


def test_an_unsteady_profile_is_called_out(tmp_path: Path, captured_mlp: CapturedMlp) -> None:
    """Runs far apart (a busy machine) get a warning line naming their spread, since the plan
    follows these times; steady runs get none. The per-run sums are kept in profile.json."""
    graph, inputs = captured_mlp
    assert unsteady_runs([1.0, 1.1, 1.2]) is None and unsteady_runs([1.0]) is None
    assert "took 2.4 to 8.0 ms (3.3× apart)" in (unsteady_runs([0.0024, 0.008, 0.003]) or "")
    for runs, warned in (([0.002, 0.0021], False), ([0.002, 0.0066], True)):
        def profiler(g: Graph, runs: int, warmup: int, sums: list[float] = runs) -> profiler_module.Profile:
            profile = profiler_module.profile_graph(g, inputs, runs=runs, warmup=warmup, iteration_runs=1)
            profile.meta["run_seconds"] = sums
            return profile

        messages: list[str] = []
        ctx = PassContext(out_dir=tmp_path, log=messages.append)
        ctx.services["profiler"] = profiler
        ProfilePass(runs=2, warmup=0).run(graph, ctx)
        assert any(m.startswith("profile: warning: the measured runs took") for m in messages) == warned, messages
    profile = profiler_module.profile_graph(graph, inputs, runs=3, warmup=0, iteration_runs=1)
    assert len(profile.meta["run_seconds"]) == 3 and all(s > 0 for s in profile.meta["run_seconds"])


def test_profile_pass_writes_its_tables(tmp_path: Path, captured_mlp: CapturedMlp) -> None:
    graph, inputs = captured_mlp
    calls: list[tuple[int, int]] = []

    def profiler(g: Graph, runs: int, warmup: int) -> profiler_module.Profile:
        calls.append((runs, warmup))
        return profiler_module.profile_graph(g, inputs, runs=runs, warmup=warmup, iteration_runs=1)

    messages: list[str] = []
    ctx = PassContext(out_dir=tmp_path, log=messages.append)
    ctx.services["profiler"] = profiler
    profile = ProfilePass(runs=2, warmup=0).run(graph, ctx)
    assert calls == [(2, 0)]
    assert ctx.artifacts["profile"] is profile
    computed = {node.id for node in graph if node.op == "call_function"}
    assert set(profile.nodes) == computed
    loaded = profiler_module.Profile.from_json(json.loads((tmp_path / "profile.json").read_text()))
    assert loaded == profile
    assert loaded.fingerprint == profiler_module.fingerprint(graph) and loaded.runs == 2
    # nodes.csv: one row per node, keyed by node id, in execution order
    with (tmp_path / "nodes.csv").open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [int(r["id"]) for r in rows] == [node.id for node in graph]
    for row in rows:
        node = graph.node(int(row["id"]))
        assert (row["name"], row["op"], int(row["owned_bytes"])) == (node.name, node.op_name, node.owned_bytes)
        assert (row["seconds"] != "") == (node.id in computed)
    # activations.csv: one row per activation, keyed by storage and producer node
    liveness = compute_liveness(graph)
    with (tmp_path / "activations.csv").open(newline="") as handle:
        activation_rows = list(csv.DictReader(handle))
    assert sorted(r["storage"] for r in activation_rows) == sorted(str(a.key) for a in liveness.activations())
    for row in activation_rows:
        record = next(a for a in liveness.activations() if str(a.key) == row["storage"])
        assert row["producer"] == graph.node(record.key.creator).name
        assert int(row["bytes"]) == record.bytes and int(row["created"]) == record.created
    assert [int(r["bytes"]) for r in activation_rows] == sorted((int(r["bytes"]) for r in activation_rows),
                                                                reverse=True)  # fmt: skip
    assert any(m.startswith(f"profile: {len(computed)} nodes") for m in messages), messages


def test_profile_pass_asks_for_isolated_times_only_when_set(captured_mlp: CapturedMlp) -> None:
    """``profile{isolate=true}`` reaches the profiler; without it ``isolate`` is not passed, so a
    service of (graph, runs, warmup) keeps working. On CPU isolating changes
    nothing: the profile says it was not isolated."""
    graph, inputs = captured_mlp
    calls: list[dict[str, Any]] = []

    def profiler(g: Graph, runs: int, warmup: int, **options: Any) -> profiler_module.Profile:
        calls.append(options)
        return profiler_module.profile_graph(g, inputs, runs=runs, warmup=warmup, iteration_runs=1, **options)

    ctx = PassContext()
    ctx.services["profiler"] = profiler
    assert ProfilePass(runs=1, warmup=0).run(graph, ctx).meta["isolated"] is False
    isolated = ProfilePass.from_options({"isolate": "true", "runs": "1", "warmup": "0"}).run(graph, ctx)
    # A service taking keywords is told whether to measure the copies' contention (no swap pass here).
    assert calls == [{"contention": False}, {"isolate": True, "contention": False}]
    assert isolated.meta["isolated"] is False  # no GPU queue to isolate from


def test_profile_pass_activation_times_are_hand_computable(tmp_path: Path) -> None:
    """activations.csv on the hand-made graph with a hand-made profile: node k takes k ms."""
    graph, _ = build_training_graph()
    profile = profiler_module.Profile("cpu", profiler_module.fingerprint(graph),
                                      {i: profiler_module.NodeProfile(i * 1e-3) for i in range(2, 14)}, runs=1)
    ctx = PassContext(out_dir=tmp_path)
    ctx.services["profiler"] = lambda g, runs, warmup: profile
    ProfilePass().run(graph, ctx)
    rows = list(csv.DictReader((tmp_path / "activations.csv").open(newline="")))
    # s (%5, 10000 B) first, then r (%4, 1000 B).
    # s idles from 5 to 6: nothing runs strictly between them -> 0 s; recompute sum = 5 ms.
    # r idles from 5 to 8: nodes 6 and 7 run in between -> 6 + 7 = 13 ms; recompute relu = 4 ms.
    assert [(r["storage"], r["producer"], r["bytes"], r["lifetime_nodes"]) for r in rows] == [
        ("%5", "sum", "10000", "9"), ("%4", "relu", "1000", "4")]  # lifetimes 14-5 and 8-4
    assert [float(r["inactive_seconds"]) for r in rows] == pytest.approx([0.0, 0.013])
    assert [float(r["recompute_seconds_estimate"]) for r in rows] == pytest.approx([0.005, 0.004])


def test_profile_json_round_trip_and_fingerprint(mlp_profile: profiler_module.Profile,
                                                  captured_mlp: CapturedMlp) -> None:
    graph, _ = captured_mlp
    data = json.loads(json.dumps(mlp_profile.to_json()))
    again = profiler_module.Profile.from_json(data)
    assert again == mlp_profile
    assert again.iteration is None  # on CPU the node times make the iteration; only CUDA measures whole ones
    assert again.to_json() == mlp_profile.to_json()
    # the fingerprint is stable for an equal graph and changes when a node is added
    original = profiler_module.fingerprint(graph)
    copy = graph.copy()
    assert profiler_module.fingerprint(copy) == original
    some = next(node for node in copy if node.op == "call_function" and node.tensor is not None)
    copy.create_node("call_function", aten.neg.default, (some,), name="extra", phase=some.phase,
                     tensors=(TensorMeta(some.tensor.shape, some.tensor.dtype, "cpu", OWN, 4),), before=copy.output)
    assert profiler_module.fingerprint(copy) != original
    assert profiler_module.fingerprint(graph) == original


# -- speed guards ----------------------------------------------------------------------------

CHAIN_LENGTH = 20000


def build_chain(length: int, in_place: bool = False) -> Graph:
    """``x`` then ``length - 2`` unary ops, each reading the previous, then the output; with
    ``in_place`` every op after the first writes the first op's storage in place."""
    g = Graph()
    previous = g.create_node("placeholder", "x", name="x", kind=NodeKind.INPUT, tensors=(meta(400),))
    base = None
    for index in range(length - 2):
        if in_place and base is not None:
            previous = g.create_node("call_function", aten.relu_.default, (previous,), name=f"n{index}",
                                     tensors=(meta(400, base),))  # fmt: skip
        else:
            previous = g.create_node("call_function", aten.relu.default, (previous,), name=f"n{index}",
                                     tensors=(meta(400),))  # fmt: skip
            base = key(previous)
    g.create_node("output", "output", ((previous,),), name="output")
    return g


@pytest.fixture(scope="module")
def chain() -> Graph:
    return build_chain(CHAIN_LENGTH)


def _analyse(graph: Graph) -> tuple[float, object]:
    start = time.perf_counter()
    simulation = simulate(graph, compute_liveness(graph))
    return time.perf_counter() - start, simulation


def test_long_chain_is_analysed_in_linear_time(chain: Graph) -> None:
    assert len(chain) == CHAIN_LENGTH
    _, simulation = _analyse(chain)
    assert_linear(lambda length: _analyse(build_chain(length))[0], CHAIN_LENGTH, "liveness + simulation of a chain")
    # x (400) is persistent; while op i runs, its input and its output are live: 400 + 800;
    # the last op's result is returned and stays to the end: 400 + 400 at the output
    assert simulation.peak_bytes == 1200 and simulation.peak_node == 2
    assert simulation.curve[1] == 800 and simulation.curve[-1] == 800
    assert set(simulation.curve[2:-1]) == {1200}


def test_long_in_place_chain_is_analysed_in_linear_time(chain: Graph) -> None:
    in_place = build_chain(CHAIN_LENGTH, in_place=True)
    # one storage with 19,998 holders: the analysis must not be much slower than on the plain
    # chain of the same length (linear in nodes plus edges, as compute_liveness promises)
    plain = min(_analyse(chain)[0] for _ in range(3))
    seconds, simulation = _analyse(in_place)
    # x (400) + the single shared storage (400)
    assert simulation.peak_bytes == 800
    assert seconds < 4 * plain + 0.2, f"in-place chain {seconds:.2f} s, plain chain {plain:.2f} s"
