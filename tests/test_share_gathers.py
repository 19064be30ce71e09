"""The ``share-gathers`` pass (passes/share_gathers.py) on a ``fully_shard`` Llama, one rank: the
backward gathers each group once, the step stays bitwise equal, and the pass changes nothing
when sharing would raise the peak over the budget or a write to the shards lies between two
gathers. (Two ranks against eager FSDP2 run it in every plan: tests/test_fully_sharded.py.)"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from types import ModuleType

import pytest
import torch

from mutwo.ir.graph import Graph
from mutwo.ir.liveness import compute_liveness
from mutwo.ir.node import Phase
from mutwo.ir.pass_base import PassContext
from mutwo.passes import share_gathers
from mutwo.passes.share_gathers import ShareGathersPass, planned_merges, value_key
from mutwo.runtime.api import optimize

#: The pipeline without the pass, to compare with (``rewrite`` runs it).
WITHOUT = "profile,select,extract,insert-recompute"
#: A budget at which the tiny Llama's plan replays gathers beside FSDP2's own re-gathers.
BUDGET = 0.6


def _backward_gathers(graph: Graph) -> Counter:
    """How many backward all-gathers each group (what it gathers) has."""
    keys: dict = {}
    return Counter(value_key(n, keys) for n in graph
                   if n.op_name == share_gathers.ALL_GATHER and n.phase is Phase.BACKWARD)  # fmt: skip


def _llama() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """A 4-layer Llama of 64 features, each layer ``fully_shard``-ed (resharded after the forward,
    FSDP2's default: gathered again for the backward), then the model; a batch of 16 × 64 tokens."""
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)  # fmt: skip
    model = LlamaForCausalLM(config)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    ids = torch.randint(0, 256, (16, 64))
    return model, {"input_ids": ids, "labels": ids}


def _planned(passes: str) -> tuple[Graph, PassContext]:
    model, batch = _llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = optimize(model, optimizer, batch, lambda output, _: output.loss, budget=BUDGET, passes=passes, check=True)
    assert step.last is not None and step.last.report is not None and step.last.report.equivalent
    return step.last.graph, step.last.context


def test_the_backward_gathers_each_group_once_and_the_step_is_unchanged(
        one_rank: None, evenly_timed: Callable[[ModuleType], None]) -> None:  # fmt: skip
    from mutwo.runtime.planning import captured

    evenly_timed(captured)  # every node at 1 ms: both runs make the same plan
    unshared = _backward_gathers(_planned(WITHOUT)[0])
    assert max(unshared.values()) > 1, f"recompute should replay a group's gather beside FSDP2's: {unshared}"
    graph, ctx = _planned("profile,select,rewrite")  # check=True: bitwise on the CPU
    shared = _backward_gathers(graph)
    assert set(shared) == set(unshared) and set(shared.values()) == {1}
    outcome = ctx.artifacts["shared-gathers"]
    assert outcome["merged"] == outcome["planned"] == sum(unshared.values()) - len(unshared)
    assert outcome["peak_after"] <= outcome["ceiling"]
    # insert-recompute's list of clones (clones.json) no longer names the gathers a merge erased
    listed = [i for ids in ctx.artifacts["recomputed"].values() for i in ids]
    assert listed and all(graph.has_node(i) for i in listed)


def test_sharing_that_would_raise_the_peak_over_the_budget_is_refused(
        one_rank: None, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    graph, ctx = _planned(WITHOUT)
    budget = ctx.artifacts["plan"].budget_bytes
    peaks = iter([budget] + [budget + 1] * 1000)  # before, then with any merge: one byte over

    class Simulated:
        def __init__(self) -> None:
            self.peak_bytes = next(peaks)

    monkeypatch.setattr(share_gathers, "simulate", lambda graph, liveness=None, workspace=None: Simulated())
    before = _backward_gathers(graph)
    outcome = ShareGathersPass().run(graph, ctx)
    assert outcome["merged"] == 0 < outcome["planned"] and _backward_gathers(graph) == before


def test_a_write_to_the_shards_between_two_gathers_keeps_both(one_rank: None) -> None:
    graph, _ = _planned(WITHOUT)
    merges = planned_merges(graph, compute_liveness(graph))
    assert merges
    merge = merges[0]
    dropped = graph.node(merge.dropped)
    shards = share_gathers._shard_storages(dropped)
    shard = next(n for n in graph.placeholders if n.tensors and n.tensors[0].storage in shards)
    # An update of that shard scheduled between the two (as optimizer-in-backward would place one).
    graph.create_node("call_function", torch.ops.aten.mul_.Tensor, (shard, 1.0), name="mul_", before=dropped,
                      phase=Phase.BACKWARD, tensors=shard.tensors)  # fmt: skip
    assert merge not in planned_merges(graph, compute_liveness(graph))
