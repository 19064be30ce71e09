"""Dropouts replayed from the masks they drew (mutwo.ir.mask_replay): the arithmetic is the CPU
kernel's to the bit, blocks use it only when asked (compiled backends) and only where the backward
keeps the mask, and the rewritten graph trains bitwise like the original."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from mutwo.ir import from_fx
from mutwo.ir.budget import parse_budget
from mutwo.ir.liveness import compute_liveness
from mutwo.ir.mask_replay import dropout_from_mask, mask_holder
from mutwo.ir.node import StorageKey
from mutwo.ir.recompute import Recompute, insert_blocks
from mutwo.ir.replay import rng_state
from mutwo.ir.time_model import TimeModel
from mutwo.ir.verifier import verify
from mutwo.runtime.api import optimize_graph
from mutwo.runtime.capture.iteration import capture
from mutwo.runtime.execution.backends import compile_graph
from mutwo.runtime.measurement.equivalence import check_graphs, compare_graphs
from tests import models
from tests.test_replay import _token_loss


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("p", [0.1, 0.25, 0.5, 0.7, 0.123])
def test_the_replay_is_bitwise_the_cpu_kernel(dtype: torch.dtype, p: float) -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 37).to(dtype)
    for value in (x, x.t()):  # contiguous and transposed: the output keeps the input's strides
        out, mask = torch.ops.aten.native_dropout(value, p, True)
        (replayed,) = dropout_from_mask(value, mask, p)
        assert replayed.dtype == out.dtype and replayed.stride() == out.stride()
        assert torch.equal(replayed.contiguous().view(torch.uint8), out.contiguous().view(torch.uint8))  # bits, -0 too


def test_the_replay_traces_with_fake_tensors() -> None:
    """Inductor traces the final graph with fake tensors: the replay must not read values on the host."""
    x = torch.randn(8, 4)
    _, mask = torch.ops.aten.native_dropout(x, 0.3, True)
    traced = make_fx(lambda a, m: dropout_from_mask(a, m, 0.3), tracing_mode="fake")(x, mask)
    assert all(n.target != torch.ops.aten._local_scalar_dense.default for n in traced.graph.nodes)


class _NativeDropout(nn.Module):
    """Dropout as CUDA traces it (one random op returning output and mask) between two layers with
    parameters, so the backward reads the mask (the dropout's gradient) and the output (the matmul's)."""

    def __init__(self, train: bool = True) -> None:
        super().__init__()
        self.V = nn.Parameter(torch.randn(8))
        self.W = nn.Parameter(torch.randn(8, 8))
        self.train_mode = train

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dropped, _mask = torch.ops.aten.native_dropout((x * self.V).sin(), 0.25, self.train_mode)
        return (dropped.view(-1, 8) @ self.W).sin()


def _captured(train: bool = True):
    torch.manual_seed(0)
    model = _NativeDropout(train)
    batch = (torch.randn(2, 4, 8),)
    captured, binding = capture(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, lambda out, b: out.sum())
    graph = from_fx(captured.graph_module, [(s.kind, s.label) for s in captured.slots], captured.gradient_labels)
    inputs = binding.flat_inputs(batch) + list(captured.constants.values())
    dropout = next(n for n in graph if n.op_name == "aten.native_dropout.default")
    return graph, inputs, dropout


def test_a_block_replays_the_dropout_from_its_kept_mask_bitwise() -> None:
    graph, inputs, dropout = _captured()
    original = graph.copy()
    mask = mask_holder(dropout)
    assert mask is not None
    block = Recompute(graph, compute_liveness(graph), mask_replay=True).plan_block(StorageKey(dropout.id, 0), set(), {})
    assert block.from_mask == {dropout.id: mask.id}
    assert mask.id in block.sources  # read where the backward keeps it anyway: no memory added
    insert_blocks(graph, [block])
    verify(graph)
    clones = [n for n in graph if n.origin == dropout.id]
    assert [c.target for c in clones] == [dropout_from_mask]
    assert not any(n.target is rng_state for n in graph)  # no generator state is read
    report = compare_graphs(original, graph, inputs)
    assert report.bitwise and report.equivalent, report.summary()


def test_without_mask_replay_the_generator_state_is_replayed() -> None:
    graph, _, dropout = _captured()
    block = Recompute(graph, compute_liveness(graph)).plan_block(StorageKey(dropout.id, 0), set(), {})
    assert block.from_mask == {} and dropout.id in block.nodes


def test_a_mask_that_is_recomputed_too_is_not_read() -> None:
    """When the mask itself is chosen, reading it would keep it: the block replays the generator."""
    graph, _, dropout = _captured()
    mask = mask_holder(dropout)
    assert mask is not None
    recompute = Recompute(graph, compute_liveness(graph), mask_replay=True)
    block = recompute.plan_block(StorageKey(dropout.id, 0), {mask.tensors[0].storage}, {})
    assert block.from_mask == {}


def test_an_evaluation_mode_dropout_has_no_mask_to_replay() -> None:
    _, _, dropout = _captured(train=False)
    assert mask_holder(dropout) is None


class _GpuDropout(nn.Module):
    """``nn.Dropout`` as a GPU traces it: ``native_dropout`` (on the CPU ``F.dropout`` traces as
    ``bernoulli_`` and a ``mul`` by the mask, which needs no replay)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten.native_dropout(x, 0.2, True)[0]


def dropout_tanh_mlp() -> models.Workload:
    """Three linear layers, each followed by a dropout drawn as on a GPU (``native_dropout``, which
    returns its mask) and a tanh, over 16 sequences of 32 tokens."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for index in range(3):
        layers += [nn.Linear(32 if index == 0 else 64, 64), _GpuDropout(), nn.Tanh()]
    net = nn.Sequential(*layers, nn.Linear(64, 10))
    return models.Workload(models.Classifier(net), (torch.randn(16, 32, 32), torch.randint(0, 10, (16, 32))),
                           _token_loss)  # fmt: skip


def test_a_compiled_backend_recomputes_through_dropouts_from_their_masks() -> None:
    """Under Inductor select plans dropouts replayed from their masks (it could not before), no
    generator state is read, and the compiled step passes the check."""
    workload = dropout_tanh_mlp()
    messages: list[str] = []
    planned = optimize_graph(workload.model, torch.optim.Adam(workload.model.parameters(), lr=1e-3), workload.batch,
                             workload.loss_fn, budget=parse_budget("min"), backend="inductor",
                             log=messages.append)  # fmt: skip
    assert any("dropouts are replayed from the masks they drew" in m for m in messages)
    assert any(n.target is dropout_from_mask for n in planned.graph), "no dropout replayed: nothing exercised"
    assert not any(n.target is rng_state for n in planned.graph)
    # Priced as Inductor runs it: the tanh after a dropout replayed from its mask fuses into it.
    blocks = [b for b in planned.context.artifacts["recompute-blocks"] if b.from_mask]
    fused = TimeModel.of(planned.original, planned.context.artifacts["profile"], fused=True)
    assert any(planned.original.node(n).op_name == "aten.tanh.default" for b in blocks for n in fused.fused_away(b))
    compiled = compile_graph(planned.graph, planned.inputs, "inductor")
    report = check_graphs(planned.original, planned.graph, planned.inputs, candidate_run=compiled.run,
                          tolerance=compiled.tolerance)  # fmt: skip
    assert report.equivalent, report.summary()
