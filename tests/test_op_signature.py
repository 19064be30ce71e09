"""Pooling measured times over nodes doing the same work (:mod:`mutwo.ir.op_signature`): the
repeated blocks of a network are priced alike, whatever noise each node's own measurement had."""

from __future__ import annotations

import statistics
from collections import defaultdict

import torch
from torch import nn

from mutwo.ir.graph import Graph
from mutwo.ir.op_signature import op_signature, pool_times
from mutwo.ir.pass_base import PassContext
from mutwo.ir.printer import fingerprint
from mutwo.passes.profile import ProfilePass
from mutwo.runtime.measurement.profiler import NodeProfile, Profile
from mutwo.runtime.planning.captured import capture_graph
from tests import models
from tests.test_verifier import build_small_graph


def repeated_blocks() -> Graph:
    """Three identical Linear+ReLU blocks between a wider input layer and a narrower head."""
    net = nn.Sequential(nn.Linear(12, 8), nn.ReLU(), *[m for _ in range(3) for m in (nn.Linear(8, 8), nn.ReLU())],
                        nn.Linear(8, 3))  # fmt: skip
    workload = models.Workload(models.Classifier(net), (torch.randn(4, 12), torch.randint(0, 3, (4,))),
                               models.cross_entropy)  # fmt: skip
    return capture_graph(workload.model, torch.optim.SGD(net.parameters(), lr=0.1), workload.batch,
                         workload.loss_fn).graph  # fmt: skip


def noisy_profile(graph: Graph) -> Profile:
    """Every op measured at a different time (its id in ms), with memory fields that must survive."""
    nodes = {node.id: NodeProfile((node.id + 1) * 1e-3, allocated_before=node.id, peak=2 * node.id)
             for node in graph if node.op == "call_function"}  # fmt: skip
    return Profile("cpu", fingerprint(graph), nodes, 1)


def test_the_repeated_blocks_get_their_median_and_the_others_keep_their_own_time() -> None:
    graph = repeated_blocks()
    profile = noisy_profile(graph)
    raw = {node_id: p.seconds for node_id, p in profile.nodes.items()}
    groups: dict[object, list[int]] = defaultdict(list)
    for node in graph:
        if node.id in raw:
            groups[op_signature(node)].append(node.id)
    summary = pool_times(graph, profile.nodes)
    forward_addmm = [n for n in graph if n.op_name == "aten.addmm.default" and n.phase.value == "forward"]
    shapes = [(n.args[1].tensors[0].shape, n.args[2].tensors[0].shape) for n in forward_addmm]
    assert shapes[1:4] == [((4, 8), (8, 8))] * 3 and shapes[0][0] == (4, 12)  # the three blocks, and the others
    blocks = [n.id for n in forward_addmm[1:4]]
    assert len({profile.nodes[i].seconds for i in blocks}) == 1
    assert profile.nodes[blocks[0]].seconds == statistics.median(raw[i] for i in groups[op_signature(forward_addmm[1])])
    for ids in groups.values():  # a node alone in its signature keeps its measurement
        if len(ids) == 1:
            assert profile.nodes[ids[0]].seconds == raw[ids[0]]
    assert profile.nodes[forward_addmm[0].id].seconds == raw[forward_addmm[0].id]
    assert all(p.allocated_before == i and p.peak == 2 * i for i, p in profile.nodes.items())  # memory untouched
    assert summary.groups == sum(len(ids) > 1 for ids in groups.values()) > 0
    assert summary.pooled_nodes == sum(len(ids) for ids in groups.values() if len(ids) > 1)
    assert summary.largest_deviation > 0


def test_views_arguments_and_keywords_are_part_of_the_work_and_shapes_alone_are_not() -> None:
    graph, n = build_small_graph()  # mm(x, t(w)): w is (3, 3), so t(w) has w's shape
    aten = torch.ops.aten
    assert op_signature(n.x) is None and op_signature(n.out) is None  # placeholders and the output keep theirs

    def call(target: object, *args: object, **kwargs: object) -> object:
        return graph.create_node("call_function", target, args, kwargs, name="extra", tensors=n.h.tensors)

    same = call(aten.mm.default, n.x, n.wt)
    contiguous = call(aten.mm.default, n.x, n.w)  # same shapes, but not a transposed view
    assert op_signature(same) == op_signature(n.h) != op_signature(contiguous)
    assert op_signature(call(aten.relu.default, n.h)) == op_signature(n.r)
    assert op_signature(call(aten.sum.dim_IntList, n.r, [0])) != op_signature(call(aten.sum.dim_IntList, n.r, [1]))
    assert op_signature(call(aten.add.Tensor, n.h, n.h, alpha=2)) != op_signature(
        call(aten.add.Tensor, n.h, n.h, alpha=3))  # fmt: skip


def test_replay_times_are_pooled_among_the_nodes_that_have_one() -> None:
    graph = repeated_blocks()
    profile = noisy_profile(graph)
    blocks = [n.id for n in graph if n.op_name == "aten.addmm.default" and n.phase.value == "forward"][1:4]
    for node_id, replay in zip(blocks, (1e-3, 2e-3, 9e-3), strict=True):
        profile.nodes[node_id].replay_seconds = replay
    pool_times(graph, profile.nodes)
    assert [profile.nodes[i].replay_seconds for i in blocks] == [2e-3] * 3
    assert all(p.replay_seconds is None for i, p in profile.nodes.items() if i not in blocks)


def test_the_profile_pass_pools_by_default_and_records_it_and_pool_false_keeps_each_time() -> None:
    graph = repeated_blocks()
    pooled, raw = [], []
    for pool, into in ((True, pooled), (False, raw)):
        ctx = PassContext()
        ctx.services["profiler"] = lambda g, runs, warmup: noisy_profile(g)
        into.append(ProfilePass(pool=pool).run(graph, ctx))
    assert pooled[0].meta["pooled"]["groups"] > 0 and raw[0].meta["pooled"] is False
    times = lambda profile: {p.seconds for p in profile.nodes.values()}  # noqa: E731
    assert len(times(pooled[0])) < len(times(raw[0])) == len(raw[0].nodes)
