"""Recompute sources, counts and the rewrite on the paper's chain, captured for real:
W, x -> a = x * W -> b = sin(a) -> c = sin(b) -> d = sin(c) -> loss = d.sum().

Each sin's backward reads its input, so a, b and c are activations: backward needs c first,
then b, then a.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mutwo.ir import from_fx
from mutwo.ir.liveness import compute_liveness
from mutwo.ir.node import StorageKey
from mutwo.ir.recompute import NotRecomputable, Recompute, insert_blocks
from mutwo.ir.verifier import verify
from mutwo.runtime.capture.iteration import capture
from mutwo.runtime.measurement.equivalence import compare_graphs


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.W = nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = x * self.W
        b = a.sin()
        c = b.sin()
        return c.sin()


def _setup():
    torch.manual_seed(0)
    model = Chain()
    batch = (torch.randn(4, 8),)
    captured, binding = capture(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, lambda out, b: out.sum())
    graph = from_fx(captured.graph_module, [(s.kind, s.label) for s in captured.slots], captured.gradient_labels)
    liveness = compute_liveness(graph)
    by_op = {}
    for node in graph:
        if node.op_name in ("aten.mul.Tensor", "aten.sin.default") and node.phase.value == "forward":
            by_op.setdefault(node.op_name, []).append(node)
    a = by_op["aten.mul.Tensor"][0]
    b, c, _d = by_op["aten.sin.default"]
    keys = {name: StorageKey(node.id) for name, node in (("a", a), ("b", b), ("c", c))}
    placeholders = {p.label: p.id for p in graph.placeholders}
    return graph, liveness, keys, placeholders, binding.flat_inputs(batch)


def test_sources_walk_back_to_kept_activations_and_inputs() -> None:
    graph, liveness, keys, placeholders, _ = _setup()
    assert {r.key for r in liveness.activations()} >= set(keys.values())
    recompute = Recompute(graph, liveness)
    block_of = {name: recompute.plan_block(key, set(), {}) for name, key in keys.items()}
    assert set(block_of["a"].sources) == {placeholders["W"], placeholders["batch[0]"]}
    assert block_of["b"].sources == [keys["a"].creator]
    assert block_of["c"].sources == [keys["b"].creator]
    assert [len(block_of[n].nodes) for n in "abc"] == [1, 1, 1]


def test_choosing_b_makes_c_inherit_a_and_choosing_a_recomputes_it_twice() -> None:
    graph, liveness, keys, placeholders, _ = _setup()
    recompute = Recompute(graph, liveness)
    # b chosen: c can no longer read b, so it recomputes b from a.
    blocks = {b.storage: b for b in recompute.plan([keys["b"], keys["c"]])}
    assert blocks[keys["c"]].sources == [keys["a"].creator]
    assert blocks[keys["c"]].nodes == [keys["b"].creator, keys["c"].creator]
    # a chosen too: c's lineage reaches the inputs, and a is cloned for c's block and for b's.
    blocks = recompute.plan([keys["a"], keys["b"], keys["c"]])
    by_key = {b.storage: b for b in blocks}
    assert set(by_key[keys["c"]].sources) == {placeholders["W"], placeholders["batch[0]"]}
    clones = insert_blocks(graph, blocks)
    verify(graph)
    assert len(clones[keys["a"].creator]) == 3  # for c's block, b's block and its own
    assert len(clones[keys["b"].creator]) == 2 and len(clones[keys["c"].creator]) == 1


def test_rewritten_chain_is_bitwise_equivalent_and_blocks_sit_before_first_backward_use() -> None:
    graph, liveness, keys, _, inputs = _setup()
    original = graph.copy()
    blocks = Recompute(graph, liveness).plan(list(keys.values()))
    first_use = {b.storage: b.insert_before for b in blocks}
    insert_blocks(graph, blocks)
    verify(graph)
    for key, point in first_use.items():
        # the clone of the recomputed node sits right before the first backward reader
        clone = [n for n in graph if n.origin == key.creator][-1]
        assert graph.nodes[graph.position(clone) + 1].id == point or graph.node(point) in clone.users
    # the forward originals no longer reach the backward: they are freed in forward
    for key in keys.values():
        assert all(u.phase.value == "forward" for u in graph.node(key.creator).users)
    assert compare_graphs(original, graph, inputs).equivalent


class _NativeDropout(nn.Module):
    """Dropout as CUDA traces it, one random op with two outputs (on CPU ``F.dropout`` is an
    in-place ``bernoulli_`` and a ``mul`` by the mask instead), followed by a matmul whose backward
    reads its output."""

    def __init__(self) -> None:
        super().__init__()
        self.W = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dropped, _mask = torch.ops.aten.native_dropout(x.sin(), 0.25, True)
        return (dropped.view(-1, 8) @ self.W).sin()


def test_output_of_a_random_multi_output_op_is_replayed_with_its_generator_state() -> None:
    """native_dropout's output is regenerated by replaying it with the state it consumed (bitwise);
    made unreplayable (its own generator), reading it back from its own producer would keep it
    live: nothing saved, so it is refused."""
    torch.manual_seed(0)
    model = _NativeDropout()
    batch = (torch.randn(2, 4, 8),)
    captured, binding = capture(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, lambda out, b: out.sum())
    graph = from_fx(captured.graph_module, [(s.kind, s.label) for s in captured.slots], captured.gradient_labels)
    original = graph.copy()
    recompute = Recompute(graph, compute_liveness(graph))
    dropout = next(n for n in graph if n.op_name == "aten.native_dropout.default")
    dropped = StorageKey(dropout.id, 0)
    block = recompute.plan_block(dropped, set(), {})
    assert dropout.id in block.nodes
    insert_blocks(graph, [block])
    verify(graph)
    inputs = binding.flat_inputs(batch) + list(captured.constants.values())
    report = compare_graphs(original, graph, inputs)
    assert report.bitwise and report.equivalent, report.summary()

    refused = original.node(dropout.id)
    refused.set_operands(refused.args, {"generator": torch.Generator()})
    with pytest.raises(NotRecomputable, match="its own producer"):
        Recompute(original, compute_liveness(original)).plan_block(dropped, set(), {})
