"""The simulators' time model (:mod:`mutwo.ir.time_model`) on synthetic profiles: nodes that do no
device work cost nothing, the measured iteration calibrates only the others."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mutwo.ir.graph import Graph
from mutwo.ir.node import NodeKind, Phase
from mutwo.ir.printer import fingerprint
from mutwo.ir.recompute import Block
from mutwo.ir.replay import batch_norm_from_stats
from mutwo.ir.swap import OFFLOAD
from mutwo.ir.time_model import TimeModel, device_work
from mutwo.runtime.profiler import IterationMeasurement, NodeProfile, Profile
from tests.test_verifier import build_small_graph, tensor

aten = torch.ops.aten
MS = 1e-3


def synthetic_profile(graph: Graph, device: str, iteration: float | None, **replays: float) -> Profile:
    """Every call_function node measured at 1 ms (a view too: the host's launch time of a real
    profile); ``replays`` by node name: the measured replay from saved statistics."""
    by_name = {node.name: node.id for node in graph}
    nodes = {node.id: NodeProfile(MS) for node in graph if node.op == "call_function"}
    for name, seconds in replays.items():
        nodes[by_name[name]].replay_seconds = seconds
    measured = IterationMeasurement(iteration, None, 1) if iteration is not None else None
    return Profile(device, fingerprint(graph), nodes, 1, measured)


def test_views_cost_nothing_and_the_iteration_is_shared_by_the_nodes_with_kernels() -> None:
    graph, n = build_small_graph()  # 3 aliases (t, expand, t) among 10 ops; add_ writes in place
    model = TimeModel.of(graph, synthetic_profile(graph, "cpu", iteration=14 * MS))
    assert model.idle == {n.wt.id, n.ge.id, n.ght.id}
    assert model.scale == pytest.approx(2.0)  # 14 ms over the 7 nodes with kernels, not over all 10
    assert [model(node) for node in (n.wt, n.h, n.ge, n.upd)] == pytest.approx([0.0, 2 * MS, 0.0, 2 * MS])
    assert sum(model(node) for node in graph) == pytest.approx(14 * MS)  # the iteration, whole
    assert model(n.x) == 0.0 and model(n.out) == 0.0


def test_without_a_measured_iteration_the_measured_times_stand() -> None:
    graph, n = build_small_graph()
    model = TimeModel.of(graph, synthetic_profile(graph, "cpu", iteration=None))
    assert model.scale == 1.0 and model(n.h) == MS and model(n.wt) == 0.0


def test_clones_cost_what_their_origin_does_and_a_batch_norm_replay_its_measured_replay() -> None:
    graph, n = build_small_graph()
    model = TimeModel.of(graph, synthetic_profile(graph, "cpu", iteration=14 * MS, relu=0.25 * MS))
    view_clone = graph.copy_node(n.wt, {}, before=n.ones, phase=Phase.BACKWARD, kind=NodeKind.OTHER)
    relu_clone = graph.copy_node(n.r, {}, before=n.ones, phase=Phase.BACKWARD, kind=NodeKind.OTHER)
    assert model(view_clone) == 0.0 and model(relu_clone) == pytest.approx(2 * MS)
    relu_clone.target = batch_norm_from_stats  # what a batch norm replayed from its statistics runs
    assert model(relu_clone) == pytest.approx(0.5 * MS)
    block = Block(n.r.tensors[0].storage, n.ones.id, [n.wt.id, n.h.id, n.r.id], [], [], from_stats={n.r.id: (0, 0)})
    assert model.block_seconds(block) == pytest.approx(2 * MS + 0.5 * MS)
    offload = graph.create_node("call_function", OFFLOAD, (n.r, n.r.id), name="offload", before=n.loss,
                                tensors=(tensor((2, 3)),))  # fmt: skip
    assert not device_work(offload, "cpu")  # its copies are the copy streams', not the compute's


def test_on_a_gpu_host_side_ops_cost_nothing_and_writes_to_device_tensors_do() -> None:
    graph, n = build_small_graph()
    for node in graph:  # the same graph on a GPU; the in-place update is the optimizer's
        node.tensors = tuple(dataclasses.replace(t, device="cuda:0") for t in node.tensors)
    step = graph.create_node("placeholder", "step", name="step", kind=NodeKind.OPTIMIZER_STATE,
                             tensors=(tensor(()),), label="step", before=n.wt)  # fmt: skip
    bump = graph.create_node("call_function", aten.add_.Tensor, (step, 1), name="add_", phase=Phase.OPTIMIZER,
                             tensors=step.tensors, before=n.out)  # fmt: skip
    scalar = graph.create_node("call_function", aten.scalar_tensor.default, (0.5,), name="scalar_tensor",
                               phase=Phase.OPTIMIZER, tensors=(tensor(()),), before=n.out)  # fmt: skip
    assert not device_work(bump, "cuda:0") and not device_work(scalar, "cuda:0")  # host memory only
    assert device_work(n.upd, "cuda:0") and device_work(n.h, "cuda:0")
    model = TimeModel.of(graph, synthetic_profile(graph, "cuda:0", iteration=7 * MS))
    assert model.idle == {n.wt.id, n.ge.id, n.ght.id, bump.id, scalar.id} and model.scale == pytest.approx(1.0)
