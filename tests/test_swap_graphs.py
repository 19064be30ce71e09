"""Swap plans recorded as CUDA graphs (mutwo.runtime.execution.swap_graphs), on the CPU: the plan's release
points (where each offloaded tensor's copy out has ended), their insertion into the step's fx
graph, and the swap runtime's recording mode (offloads freed only at their release, host buffers
held for the graph). The capture itself runs in tests/test_cuda_swap.py."""

from __future__ import annotations

import pytest
import torch

from mutwo.ir.swap import OFFLOAD, OFFLOAD_ELEMENTS, PREFETCH, RELEASE_IN_PLACE, SWAP_RELEASES
from mutwo.ir.time_model import TimeModel
from mutwo.ir.timeline import TransferModel, graph_timeline
from mutwo.ir.to_fx import to_fx
from mutwo.passes.mu_two_swap import SWAP
from mutwo.runtime.execution import backends
from mutwo.runtime.execution.backends import BackendError, CompiledStep
from mutwo.runtime.execution.swap import RUNTIME
from mutwo.runtime.execution.swap_graphs import insert_release_points
from mutwo.runtime.measurement.equivalence import check_graphs
from tests import models, swapping

# duplex=true: on a CPU the forward pass is short beside 1 GB/s copies, so the offload window (copies out
# ended within 80% of the forward pass) would leave nothing to swap on a loaded machine.
SWAP_ONLY = "profile{runs=2,warmup=1},select-swap{allow=swap,duplex=true},insert-swap"
#: Copies as a GPU's: beside the compute, slow enough that a copy out spans several nodes.
OVERLAPPING = TransferModel(1e9, 1e9, 0.0, overlap=True, device="cpu")


@pytest.fixture(scope="module")
def planned() -> swapping.Rewritten:
    rewritten = swapping.rewrite(models.cnn(batch_size=32), SWAP_ONLY, "0.9", transfer=OVERLAPPING)
    assert rewritten.ctx.artifacts["swap-plan"].of(SWAP), "nothing swapped: the tests would not exercise a swap"
    return rewritten


def test_each_swap_is_released_where_its_copy_out_has_ended(planned: swapping.Rewritten) -> None:
    plan = planned.ctx.artifacts["swap-plan"]
    graph, original = planned.graph, planned.original
    rank = {node.id: position for position, node in enumerate(original.nodes)}
    timeline = graph_timeline(graph, TimeModel.of(original, planned.ctx.artifacts["profile"]), OVERLAPPING)
    ended = {record["tag"]: (record["copy_out"][1], record["prefetch"]) for record in timeline.swaps}
    releases = graph.meta[SWAP_RELEASES]
    assert sorted(releases) == sorted(ended)
    early = 0
    for entry in plan.of(SWAP):
        assert rank[entry["offload_after"]] < rank[entry["release_before"]] <= rank[entry["prefetch_before"]]
    for tag, release_before in releases.items():
        end, prefetch = ended[tag]
        point = graph.position(graph.node(release_before))
        assert point < graph.position(graph.node(prefetch)) or release_before == graph.node(prefetch).id
        if point < graph.position(graph.node(prefetch)):
            assert timeline.start[point] >= end  # the compute stream gets there after the copy out ends
            early += 1
    assert early, "every release fell back to the prefetch: the test would not check a timeline's release point"


def test_release_points_are_inserted_between_offload_and_prefetch_and_the_step_is_bitwise(
        planned: swapping.Rewritten) -> None:  # fmt: skip
    module = to_fx(planned.graph)
    inserted = insert_release_points(module, planned.graph)
    nodes = list(module.graph.nodes)
    offloads = [n for n in nodes if n.target is OFFLOAD]
    assert inserted == len(offloads) > 0
    for offload in offloads:
        (release,) = [u for u in offload.users if u.target is RELEASE_IN_PLACE]
        (prefetch,) = [u for u in offload.users if u.target is PREFETCH]
        assert nodes.index(offload) < nodes.index(release) < nodes.index(prefetch)
        planned_at = planned.graph.meta[SWAP_RELEASES][offload.args[1]]
        after = nodes[nodes.index(release) + 1]
        assert after.meta.get("mutwo_id") == planned_at or after is prefetch or after.target is RELEASE_IN_PLACE
    buffers = RUNTIME.buffers.free_buffers
    with RUNTIME.recording() as held:
        report = check_graphs(planned.original, planned.graph, planned.inputs, iterations=1, candidate_run=module)
    assert report.bitwise and report.equivalent, report.summary()
    # The graph's, not the pool's (which may hold other tests' buffers of other sizes).
    pooled = {buffer.data_ptr() for entries in RUNTIME.buffers._free.values() for buffer, _ in entries}
    assert held and not pooled & {buffer.data_ptr() for buffer in held}
    assert RUNTIME.buffers.free_buffers <= buffers
    RUNTIME.buffers.restore(held)
    assert RUNTIME.in_flight == 0


def test_inductor_keeps_the_release_points_and_the_step_within_the_tolerance(planned: swapping.Rewritten) -> None:
    """The same rewrite compile_step makes for inductor-cudagraphs, compiled on the CPU: every
    release is called (or the recording's prefetch would refuse its swap) in the plan's order."""
    module = to_fx(planned.graph)
    backends.functionalizable_host_calls(module)
    backends.compiled_swap_ops(module)
    insert_release_points(module, planned.graph)
    backends.mark_phases(module, planned.graph)
    assert sum(n.target is OFFLOAD_ELEMENTS for n in module.graph.nodes) == \
        sum(n.target is RELEASE_IN_PLACE for n in module.graph.nodes) > 0  # fmt: skip
    run, *_ = backends.compile_inductor(module, planned.inputs, swaps=True)
    with RUNTIME.recording() as held:
        report = check_graphs(planned.original, planned.graph, planned.inputs, iterations=1, candidate_run=run,
                              tolerance=CompiledStep("inductor", run).tolerance)  # fmt: skip
    RUNTIME.buffers.restore(held)
    assert report.equivalent, report.summary()
    assert RUNTIME.in_flight == 0


def test_a_swap_without_a_release_point_is_refused_in_one_line(planned: swapping.Rewritten) -> None:
    graph = planned.graph.copy()
    del graph.meta[SWAP_RELEASES]
    with pytest.raises(BackendError, match="has no release point") as refused:
        insert_release_points(to_fx(graph), graph)
    assert "\n" not in str(refused.value) and "plan it again with select-swap" in str(refused.value)


def test_while_recording_an_offload_is_freed_only_at_its_release() -> None:
    x = torch.randn(4, 8)
    with RUNTIME.recording() as held:
        host = torch.ops.mutwo.offload(x, 7)
        with pytest.raises(RuntimeError, match="its offload was not released"):
            torch.ops.mutwo.prefetch(host, x.device, 7)
    RUNTIME.buffers.restore(held)
    assert RUNTIME.in_flight == 0
    with RUNTIME.recording() as held:
        host = torch.ops.mutwo.offload(x, 7)
        torch.ops.mutwo.release_(host, 7)
        back = torch.ops.mutwo.wait(torch.ops.mutwo.prefetch(host, x.device, 7), 7)
        assert torch.equal(back, x)
    assert [b.data_ptr() for b in held] == [host.data_ptr()]  # held for the graph, out of the pool
    assert RUNTIME.buffers.take(host.untyped_storage().nbytes(), pinned=False)[0].data_ptr() != host.data_ptr()
    RUNTIME.buffers.restore(held)
    # Outside a recording the release has nothing to wait for; a release of no offload is refused.
    host = torch.ops.mutwo.offload(x, 7)
    torch.ops.mutwo.release_(host, 7)
    assert torch.equal(torch.ops.mutwo.wait(torch.ops.mutwo.prefetch(host, x.device, 7), 7), x)
    with pytest.raises(RuntimeError, match="not the result of an offload"):
        torch.ops.mutwo.release_(torch.empty(4, 8), 7)
    assert RUNTIME.in_flight == 0


def test_a_release_point_missing_from_the_graph_falls_back_to_the_prefetch_and_says_so(
        planned: swapping.Rewritten, caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    """What tests/test_cuda_swap.py's control relies on: a release point naming no node of the
    graph frees the offloaded tensor right before its prefetch, with a warning per swap."""
    graph = planned.graph.copy()
    graph.meta[SWAP_RELEASES] = dict.fromkeys(graph.meta[SWAP_RELEASES], -1)
    module = to_fx(graph)
    with caplog.at_level("WARNING", logger="mutwo.runtime.execution.swap_graphs"):
        inserted = insert_release_points(module, graph)
    nodes = list(module.graph.nodes)
    for offload in [n for n in nodes if n.target is OFFLOAD]:
        (release,) = [u for u in offload.users if u.target is RELEASE_IN_PLACE]
        (prefetch,) = [u for u in offload.users if u.target is PREFETCH]
        assert nodes[nodes.index(release) + 1] is prefetch
    assert inserted == sum("freed at its prefetch instead" in r.getMessage() for r in caplog.records) > 0
