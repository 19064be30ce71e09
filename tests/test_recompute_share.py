"""Shared recompute blocks (``Recompute.share``, select's ``share``) on a chain of sines:
x * W -> sin -> sin -> ... -> sin -> sum.

Each sin's backward reads its input, so the product and every sin but the last are activations,
needed by the backward in the reverse order. Recomputing all of them with a block each replays
the chain again for every one (quadratic in its depth); a shared block regenerates, once, every
activation its lineage passes through and keeps it for its own backward use, as a checkpointed
segment does, as far as the memory it is given allows.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from mutwo.ir import from_fx
from mutwo.ir.budget import parse_budget
from mutwo.ir.graph import Graph
from mutwo.ir.liveness import compute_liveness
from mutwo.ir.memory import Headroom
from mutwo.ir.node import StorageKey
from mutwo.ir.pass_base import PassContext
from mutwo.ir.pass_manager import Instrumentation, PassManager
from mutwo.ir.recompute import Recompute, insert_blocks
from mutwo.ir.registry import PassRegistry
from mutwo.ir.verifier import verify
from mutwo.passes.select import Plan
from mutwo.runtime.capture.iteration import capture
from mutwo.runtime.measurement.equivalence import compare_graphs
from mutwo.runtime.measurement.profiler import NodeProfile, Profile, fingerprint

DEPTH = 6


class SineChain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.W = nn.Parameter(torch.randn(256))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * self.W
        for _ in range(DEPTH):
            h = h.sin()
        # A large forward temporary, read by no backward node: the forward peaks there, so the
        # backward has room below the peak once every activation is recomputed.
        return h + self.W.repeat(4096, 1).sum()


@pytest.fixture(scope="module")
def chain() -> tuple[Graph, list[Any]]:
    torch.manual_seed(0)
    model = SineChain()
    batch = (torch.randn(64, 256),)
    captured, binding = capture(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, lambda out, b: out.sum())
    graph = from_fx(captured.graph_module, [(s.kind, s.label) for s in captured.slots], captured.gradient_labels)
    return graph, binding.flat_inputs(batch) + list(captured.constants.values())


def _activations(graph: Graph) -> list[StorageKey]:
    """The chain's activations in forward order: the product, then the sines but the last."""
    keys = [r.key for r in compute_liveness(graph).activations()
            if graph.node(r.key.creator).op_name in ("aten.mul.Tensor", "aten.sin.default")]  # not the loss
    assert len(keys) == DEPTH
    return sorted(keys, key=lambda k: graph.position(graph.node(k.creator)))


def _clones(graph: Graph, shared: dict[StorageKey, StorageKey] | None) -> tuple[Graph, int]:
    rewritten = graph.copy()
    blocks = Recompute(rewritten, compute_liveness(rewritten)).plan(_activations(graph), shared=shared)
    clones = insert_blocks(rewritten, blocks)
    verify(rewritten)
    return rewritten, sum(len(c) for c in clones.values())


def test_unshared_blocks_replay_the_chain_once_per_activation(chain: tuple[Graph, list[Any]]) -> None:
    graph, _ = chain
    _, count = _clones(graph, None)
    assert count == DEPTH * (DEPTH + 1) // 2


def test_shared_block_replays_the_chain_once_and_stays_bitwise(chain: tuple[Graph, list[Any]]) -> None:
    graph, inputs = chain
    keys = _activations(graph)
    liveness = compute_liveness(graph)
    shared = Recompute(graph, liveness).share(keys, Headroom(torch.zeros(len(graph.nodes), dtype=torch.int64), 2**40))
    # The last activation's block (first in the backward) regenerates all the others.
    assert shared == {key: keys[-1] for key in keys[:-1]}
    rewritten, count = _clones(graph, shared)
    assert count == DEPTH
    report = compare_graphs(graph, rewritten, inputs)
    assert report.bitwise and report.equivalent, report.summary()


def test_joins_stop_where_the_headroom_is_used_up(chain: tuple[Graph, list[Any]]) -> None:
    """Room for one activation over any stretch: each block keeps the nearest one only, so the
    activations pair up, and the curve never goes above the limit."""
    graph, inputs = chain
    keys = _activations(graph)
    liveness = compute_liveness(graph)
    size = liveness.storages[keys[0]].bytes
    headroom = Headroom(torch.zeros(len(graph.nodes), dtype=torch.int64), size)
    shared = Recompute(graph, liveness).share(keys, headroom)
    assert shared == {keys[4]: keys[5], keys[2]: keys[3], keys[0]: keys[1]}
    assert int(headroom.curve.max()) == size
    rewritten, count = _clones(graph, shared)
    assert count == 6 + 4 + 2  # three blocks, each replaying the chain up to its head
    assert compare_graphs(graph, rewritten, inputs).bitwise
    assert Recompute(graph, liveness).share(keys, Headroom(torch.zeros(len(graph.nodes), dtype=torch.int64), 0)) == {}


def _select(graph: Graph, share: bool) -> tuple[Graph, PassContext]:
    rewritten = graph.copy()
    ctx = PassContext()
    # The same time for every node: the choices do not depend on the machine.
    ctx.services["profiler"] = lambda g, runs, warmup: Profile(
        "cpu", fingerprint(g), {n.id: NodeProfile(1e-6) for n in g if n.op == "call_function"}, 1)
    ctx.services["budget"] = parse_budget("min")
    pipeline = f"profile{{runs=1,warmup=0}},select{{share={str(share).lower()}}},rewrite"
    PassManager(PassRegistry().build_pipeline(pipeline), Instrumentation(verify=True)).run(rewritten, ctx)
    return rewritten, ctx


def test_select_shares_blocks_at_no_higher_peak(chain: tuple[Graph, list[Any]]) -> None:
    """select at the min budget, with and without sharing: the same activations, fewer clones and
    less predicted time at a predicted peak no higher, the rewrite bitwise and its exact
    simulation the plan's prediction."""
    graph, inputs = chain
    plain, plain_ctx = _select(graph, share=False)
    shared, shared_ctx = _select(graph, share=True)
    before, after = plain_ctx.artifacts["plan"], shared_ctx.artifacts["plan"]
    assert after.keys() == before.keys()
    assert after.shared() and not before.shared()
    assert after.clones < before.clones
    assert after.added_seconds < before.added_seconds
    assert after.predicted_peak <= before.predicted_peak
    assert sum(len(c) for c in shared_ctx.artifacts["recomputed"].values()) == after.clones
    # Every entry is regenerated by one block (its own or a shared one), and no forward holder of
    # a recomputed storage keeps a backward reader.
    blocks = shared_ctx.artifacts["recompute-blocks"]
    assert sorted(str(k) for b in blocks for k in (b.storage, *b.also)) == sorted(e["storage"] for e in after.entries)
    assert len(blocks) < len(after.entries)
    for block in blocks:
        for holder in block.redirect:
            assert all(u.phase.value == "forward" for u in shared.node(holder).users), shared.node(holder)
    # extract plans the same blocks from the plan's JSON form
    assert Plan.from_json(after.to_json()).shared() == after.shared()
    report = compare_graphs(graph, shared, inputs)
    assert report.bitwise and report.equivalent, report.summary()
