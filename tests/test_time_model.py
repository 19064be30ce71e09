"""The simulators' time model (:mod:`mutwo.ir.time_model`) on synthetic profiles: nodes that do no
device work cost nothing, the measured iteration calibrates only the others; fused pricing charges
nothing for a pointwise clone that Inductor fuses into its block's producer."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from mutwo.ir.graph import Graph
from mutwo.ir.liveness import compute_liveness
from mutwo.ir.node import Node, NodeKind, Phase, StorageKey
from mutwo.ir.pass_base import PassContext, PassFailure
from mutwo.ir.printer import fingerprint
from mutwo.ir.recompute import Block, Recompute, insert_blocks
from mutwo.ir.replay import batch_norm_from_stats
from mutwo.ir.swap import OFFLOAD
from mutwo.ir.time_model import TimeModel, device_work, is_plain_alias, is_pointwise
from mutwo.passes.select import SelectPass
from mutwo.runtime.execution.backends import backend_services
from mutwo.runtime.measurement.iterations import IterationMeasurement
from mutwo.runtime.measurement.profiler import NodeProfile, Profile
from mutwo.runtime.planning.captured import capture_graph
from tests import models
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


def captured_chains() -> tuple[Graph, dict[str, Node]]:
    """A captured iteration with the chains fused pricing is about: convolution -> batch norm ->
    ReLU (in place), and addmm -> GELU -> tanh; its forward nodes by name."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(inplace=True), nn.Flatten(),
                        nn.Linear(4 * 8 * 8, 16), nn.GELU(), nn.Tanh(), nn.Linear(16, 3))  # fmt: skip
    workload = models.Workload(models.Classifier(net), (torch.randn(2, 3, 8, 8), torch.randint(0, 3, (2,))),
                               models.cross_entropy)  # fmt: skip
    graph = capture_graph(workload.model, torch.optim.SGD(net.parameters(), lr=0.1), workload.batch,
                          workload.loss_fn).graph  # fmt: skip
    forward = {node.name: node for node in graph if node.phase is Phase.FORWARD and node.op == "call_function"}
    assert {"convolution", "native_batch_norm", "relu_", "addmm", "gelu", "tanh"} <= set(forward)
    return graph, forward


def block_for(graph: Graph, *recomputed: Node) -> Block:
    """The block regenerating the last of ``recomputed`` when all of them are recomputed."""
    chosen = {node.tensors[0].storage for node in recomputed}
    return Recompute(graph, compute_liveness(graph)).plan_block(recomputed[-1].tensors[0].storage, chosen, {})


def test_fused_pricing_charges_a_pointwise_clone_fed_by_a_replay_or_a_pointwise_clone_nothing() -> None:
    """Every op at 1 ms, the batch norm's replay from its statistics 0.25 ms, aliases free: under
    Inductor the ReLU after the replay, and the tanh after the GELU, are the same kernel as their
    producer; the GELU after the addmm (an extern matmul) is not, and a chain's head keeps its time."""
    graph, n = captured_chains()
    profile = synthetic_profile(graph, "cpu", iteration=None, native_batch_norm=0.25 * MS)
    eager, fused = TimeModel.of(graph, profile), TimeModel.of(graph, profile, fused=True)
    assert not eager.fused and fused.fused
    relu_output = block_for(graph, n["native_batch_norm"])  # the ReLU writes the batch norm's output in place
    assert {n["native_batch_norm"].id, n["relu_"].id} <= set(relu_output.nodes)
    assert n["native_batch_norm"].id in relu_output.from_stats
    assert eager.block_seconds(relu_output) == pytest.approx(1.25 * MS)  # replay + ReLU
    assert fused.block_seconds(relu_output) == pytest.approx(0.25 * MS)  # the replay alone
    assert fused.fused_away(relu_output) == {n["relu_"].id}
    chain = block_for(graph, n["convolution"], n["native_batch_norm"])
    assert n["convolution"].id in chain.nodes
    assert eager.block_seconds(chain) == pytest.approx(2.25 * MS)
    assert fused.block_seconds(chain) == pytest.approx(1.25 * MS)  # convolution + replay
    tail = block_for(graph, n["addmm"], n["gelu"], n["tanh"])
    *computed, saved = (graph.node(i) for i in tail.nodes)  # the tanh's backward reads an alias of its output
    assert [n.name for n in computed] == ["addmm", "gelu", "tanh"] and is_plain_alias(saved)  # alias or detach
    assert eager.block_seconds(tail) == pytest.approx(3 * MS)
    assert fused.block_seconds(tail) == pytest.approx(2 * MS)  # addmm + GELU; the tanh fuses into the GELU
    assert fused.fused_away(tail) == {n["tanh"].id}  # the GELU's producer is the addmm: it keeps its time
    tanh_alone = block_for(graph, n["tanh"])  # the GELU's output is not kept: it is cloned, from the kept addmm
    assert n["addmm"].id in tanh_alone.sources and n["gelu"].id in tanh_alone.nodes
    assert eager.block_seconds(tanh_alone) == pytest.approx(2 * MS)
    assert fused.block_seconds(tanh_alone) == pytest.approx(MS)  # the GELU heads the chain


@pytest.mark.parametrize("recomputed", [("native_batch_norm",), ("convolution", "native_batch_norm"),
                                        ("addmm", "gelu", "tanh"), ("tanh",)])  # fmt: skip
def test_fused_pricing_of_a_rewritten_graph_node_by_node_agrees_with_the_blocks(recomputed: tuple[str, ...]) -> None:
    """The swap planner prices a rewritten graph clone by clone (timelines): with ``fused``, the
    clones it prices at nothing are the ones :meth:`TimeModel.fused_away` names for the block, so
    the clones add up to :meth:`TimeModel.block_seconds` (and priced eagerly, to the eager block)."""
    graph, n = captured_chains()
    profile = synthetic_profile(graph, "cpu", iteration=None, native_batch_norm=0.25 * MS)
    eager, fused = TimeModel.of(graph, profile), TimeModel.of(graph, profile, fused=True)
    liveness = compute_liveness(graph)
    chosen = [n[name].tensors[0].storage for name in recomputed]
    blocks = Recompute(graph, liveness).plan([k for k in chosen if liveness.storages[k].first_backward_use is not None])
    rewritten = graph.copy()
    clones = insert_blocks(rewritten, blocks)
    cloned = [rewritten.node(c) for ids in clones.values() for c in ids]
    assert cloned and all(node.origin is not None for node in cloned)
    assert sum(map(fused, cloned)) == pytest.approx(sum(map(fused.block_seconds, blocks)))
    assert sum(map(eager, cloned)) == pytest.approx(sum(map(eager.block_seconds, blocks)))
    assert sum(map(fused, rewritten)) - sum(map(fused, graph)) == pytest.approx(sum(map(fused.block_seconds, blocks)))


class _SharedSigmoid(nn.Module):
    """A sigmoid read by a tanh and by a second linear layer: recomputing both, the tanh's block
    reads the sigmoid's clone from the sigmoid's own, earlier block."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second, self.third = nn.Linear(8, 8), nn.Linear(8, 3), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = torch.sigmoid(self.first(x))
        return self.second(torch.tanh(shared)) + self.third(shared)


def test_a_clone_reading_another_blocks_clone_is_not_fused_into_it() -> None:
    """The tanh's clone reads the sigmoid's clone of an earlier block, which was written to memory:
    priced clone by clone in the rewritten graph it costs its time, as the block prices it."""
    torch.manual_seed(0)
    net = _SharedSigmoid()
    workload = models.Workload(models.Classifier(net), (torch.randn(4, 8), torch.randint(0, 3, (4,))),
                               models.cross_entropy)  # fmt: skip
    graph = capture_graph(workload.model, torch.optim.SGD(net.parameters(), lr=0.1), workload.batch,
                          workload.loss_fn).graph  # fmt: skip
    forward = {n.name: n for n in graph if n.phase is Phase.FORWARD and n.op == "call_function"}
    chosen = [forward["sigmoid"].tensors[0].storage, forward["tanh"].tensors[0].storage]
    blocks = Recompute(graph, compute_liveness(graph)).plan(chosen)
    assert any(block.from_clones for block in blocks), "no block reads another's clone: nothing exercised"
    fused = TimeModel.of(graph, synthetic_profile(graph, "cpu", iteration=None), fused=True)
    rewritten = graph.copy()
    clones = [rewritten.node(c) for ids in insert_blocks(rewritten, blocks).values() for c in ids]
    assert sum(map(fused, clones)) == pytest.approx(sum(map(fused.block_seconds, blocks)))


def test_in_place_ops_are_pointwise_by_their_own_tag_or_their_out_of_place_forms() -> None:
    assert is_pointwise(aten.relu_.default) and torch.Tag.pointwise in aten.relu_.default.tags
    assert torch.Tag.pointwise not in aten.gelu_.default.tags and is_pointwise(aten.gelu_.default)
    assert not is_pointwise(aten.convolution.default) and not is_pointwise(aten.native_batch_norm.default)
    assert not is_pointwise(batch_norm_from_stats)


@pytest.mark.parametrize("budget", ["0.9", "min"])
def test_select_plans_a_fused_backend_with_fused_pricing(budget: str) -> None:
    """The CNN of tests/models.py, every op at 1 ms and each batch norm's replay 0.25 ms: with
    ``fused`` under a backend that fuses (inductor), select says it prices recomputes so, and its plan costs no more,
    priced as Inductor runs it, than the plan it makes for eager (at 0.9 of the peak: the batch
    norm's output, replay and ReLU in one kernel, 0.25 ms, instead of a convolution, 1 ms)."""
    workload = models.cnn(batch_size=8)
    graph = capture_graph(workload.model, torch.optim.SGD(workload.model.parameters(), lr=0.1), workload.batch,
                          workload.loss_fn).graph  # fmt: skip
    replays = {node.name: 0.25 * MS for node in graph if node.op_name == "aten.native_batch_norm.default"}
    profile = synthetic_profile(graph, "cpu", None, **replays)
    plans, logs = {}, {}
    for backend in ("eager", "inductor"):
        logs[backend] = []
        ctx = PassContext(log=logs[backend].append)
        ctx.artifacts["profile"] = profile
        ctx.services.update(backend_services(backend))
        plans[backend] = SelectPass(budget=budget, fused=backend == "inductor").run(graph, ctx)
        assert plans[backend].met
    line = "select: pricing recomputes as Inductor fuses them: a pointwise clone fed by a pointwise clone of its " \
           "block costs nothing"  # fmt: skip
    assert line in logs["inductor"] and not any("Inductor fuses" in message for message in logs["eager"])
    fused = TimeModel.of(graph, profile, fused=True)
    eager_blocks = Recompute(graph, compute_liveness(graph)).plan([StorageKey(*k) for k in plans["eager"].keys()],
                                                                  shared=plans["eager"].shared())  # fmt: skip
    assert plans["inductor"].added_seconds <= sum(map(fused.block_seconds, eager_blocks))
    if budget == "0.9":
        assert [e["op"] for e in plans["eager"].entries] == ["aten.convolution.default"]
        assert [e["op"] for e in plans["inductor"].entries] == ["aten.native_batch_norm.default"]
        assert plans["inductor"].added_seconds == pytest.approx(0.25 * MS)


def test_fused_pricing_is_asked_for_and_only_under_a_backend_that_fuses() -> None:
    """Off by default even under inductor (measured on the H100, its plans ran no faster); asked
    for under a backend that does not fuse, the pass fails with the fix."""
    workload = models.cnn(batch_size=8)
    graph = capture_graph(workload.model, torch.optim.SGD(workload.model.parameters(), lr=0.1), workload.batch,
                          workload.loss_fn).graph  # fmt: skip
    messages: list[str] = []
    ctx = PassContext(log=messages.append)
    ctx.artifacts["profile"] = synthetic_profile(graph, "cpu", None)
    ctx.services.update(backend_services("inductor"))
    assert SelectPass(budget="0.9").run(graph, ctx).met
    assert not any("Inductor fuses" in message for message in messages)
    ctx.services.update(backend_services("eager"))
    with pytest.raises(PassFailure, match=r"select\{fused=true\} prices recomputes as Inductor fuses them, but "
                                          "this run's backend does not compile with Inductor"):  # fmt: skip
        SelectPass(budget="0.9", fused=True).run(graph, ctx)


def test_a_plan_says_how_much_slower_it_is_predicted_and_warns_when_it_is_much_slower() -> None:
    from mutwo.passes.select import SLOW_PLAN_FACTOR, Plan

    def plan(added: float) -> Plan:
        entry = {"storage_creator": 1, "storage_output": 0}
        return Plan("fp", "min", 1000, 4000, 2000, 3, "backward", base_seconds=0.1, met=True,
                    added_seconds=added, entries=[entry])  # fmt: skip

    assert "(1.50× the step without recompute)" in plan(0.05).summary()
    slow = plan(0.1 * (SLOW_PLAN_FACTOR - 1) + 0.01).summary()
    assert f"× the step without recompute; WARNING: over {SLOW_PLAN_FACTOR:g}× slower" in slow
