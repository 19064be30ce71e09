"""A concatenation onto an empty tensor (a key-value cache's first update) compiles under Inductor
with eager's layout (runtime/execution/empty_concatenations.py): GPT-2 under ``backend="inductor"``
could not compile on the CPU before."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

import mutwo
from mutwo.ir.to_fx import to_fx
from mutwo.runtime.execution.empty_concatenations import single_tensor_concatenations
from mutwo.runtime.measurement.equivalence import compare_graphs
from mutwo.runtime.planning.captured import capture_graph

BATCH, TOKENS, HEADS, WIDTH = 2, 6, 2, 4


class CachedAttentionScores(nn.Module):
    """Keys from a fused projection, transposed per head, concatenated onto an empty cache (eager's
    result is contiguous), then viewed as GPT-2's attention views them: a view that is valid only
    in eager's layout."""

    def __init__(self) -> None:
        super().__init__()
        self.project = nn.Linear(HEADS * WIDTH, 2 * HEADS * WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        query, key = self.project(x).split(HEADS * WIDTH, dim=-1)
        key = key.view(BATCH, TOKENS, HEADS, WIDTH).transpose(1, 2)  # a transposed slice, not contiguous
        key = torch.cat([x.new_zeros(BATCH, HEADS, 0, WIDTH), key], dim=-2)  # the empty cache's first update
        scaled = key.transpose(-2, -1) * 0.5
        flat = scaled.view(BATCH * HEADS, WIDTH, TOKENS)  # valid on eager's contiguous concatenation only
        query = query.reshape(BATCH, TOKENS, HEADS, WIDTH).transpose(1, 2).reshape(BATCH * HEADS, TOKENS, WIDTH)
        return torch.bmm(query, flat).mean(dim=-1)


def _workload() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return CachedAttentionScores(), torch.randn(BATCH, TOKENS, HEADS * WIDTH), torch.randn(BATCH * HEADS, TOKENS)


def test_a_concatenation_onto_an_empty_tensor_becomes_a_contiguous_copy_bitwise_like_eager() -> None:
    model, x, y = _workload()
    lowered = capture_graph(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y),
                            F.mse_loss)  # fmt: skip
    module = to_fx(lowered.graph)
    assert single_tensor_concatenations(module, lowered.graph) == 1  # the backward's cat of two gradients stays
    report = compare_graphs(lowered.graph, lowered.graph, lowered.inputs, candidate_run=module)
    assert report.bitwise and report.equivalent, report.summary()


def test_a_step_concatenating_onto_an_empty_cache_compiles_under_inductor_and_passes_the_check() -> None:
    model, x, y = _workload()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = mutwo.optimize(model, optimizer, (x, y), F.mse_loss, check=True, backend="inductor")
    report = step.last.report
    assert report is not None and report.equivalent, report.summary()
