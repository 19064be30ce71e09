"""Replays that make more activations recomputable (``mutwo.ir.replay``): random ops replayed with
the generator state they consumed, training batch norms replayed from their saved statistics.

Each rewrite is checked against eager torch.optim training from identical copies of the state,
bitwise on CPU, over several calls of the optimized step, and the random stream afterwards must be
where eager leaves it (the next random numbers are equal).
"""

from __future__ import annotations

import collections
import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import mutwo
from mutwo.ir.graph import Graph
from mutwo.ir.node import Phase, StorageKey
from mutwo.ir.pass_base import PassContext
from mutwo.ir.recompute import NotRecomputable, Recompute, insert_blocks, replayable
from mutwo.ir.replay import batch_norm_from_stats, rng_state, run_with_rng_state, training_batch_norm_stats
from mutwo.ir.verifier import verify
from mutwo.passes.liveness import liveness_of
from mutwo.passes.select import refused_random_ops
from mutwo.runtime.measurement.equivalence import (
    check_graphs,
    compare_graphs,
    deterministic_algorithms,
    generator_states,
)
from mutwo.runtime.planning.captured import capture_graph
from tests import models


# == batch norm from its statistics ===============================================================
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "strided", "2d", "3d"])
@pytest.mark.parametrize("affine", [True, False])
def test_batch_norm_from_stats_is_bitwise_on_cpu(dtype: torch.dtype, layout: str, affine: bool) -> None:
    torch.manual_seed(0)
    shapes = {"contiguous": (4, 8, 5, 5), "channels_last": (4, 8, 5, 5), "strided": (4, 8, 10, 10),
              "2d": (16, 32), "3d": (2, 3, 4, 4, 4)}  # fmt: skip
    x = (torch.randn(*shapes[layout]) * 3 + 1).to(dtype)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    elif layout == "strided":
        x = x[:, :, ::2, ::2]
    channels = x.shape[1]
    weight = torch.randn(channels, dtype=dtype) if affine else None
    bias = torch.randn(channels, dtype=dtype) if affine else None
    running = torch.zeros(channels, dtype=dtype), torch.ones(channels, dtype=dtype)
    out, mean, invstd = torch.ops.aten.native_batch_norm(x, weight, bias, *running, True, 0.1, 1e-5)
    (replayed,) = batch_norm_from_stats(x, weight, bias, mean, invstd)
    assert torch.equal(out, replayed)
    assert out.stride() == replayed.stride()


# == end to end against eager =====================================================================
def token_mlp(depth: int = 3, seed: int = 0) -> models.Workload:
    """An MLP over 32 sequences of 64 tokens with ``nn.Dropout(0.2)`` after every hidden layer."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for index in range(depth):
        layers += [nn.Linear(32 if index == 0 else 128, 128), nn.ReLU(), nn.Dropout(0.2)]
    net = nn.Sequential(*layers, nn.Linear(128, 10))
    batch = (torch.randn(32, 64, 32), torch.randint(0, 10, (32, 64)))
    return models.Workload(models.Classifier(net), batch, _token_loss)


def _token_loss(output: torch.Tensor, batch: Any) -> torch.Tensor:
    return F.cross_entropy(output.flatten(0, 1), batch[1].flatten())


class Attention(nn.Module):
    """Self-attention layers whose SDPA calls drop attention weights (``dropout_p``)."""

    def __init__(self, width: int = 32, heads: int = 4, dropout: float = 0.2, layers: int = 3) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.qkv = nn.ModuleList(nn.Linear(width, 3 * width) for _ in range(layers))
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        for qkv in self.qkv:
            q, k, v = qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout)
            x = x + y.transpose(1, 2).reshape(b, t, c).relu()
        return self.head(x)


def attention(seed: int = 0, dropout: float = 0.2) -> models.Workload:
    torch.manual_seed(seed)
    batch = (torch.randn(8, 48, 32), torch.randint(0, 10, (8, 48)))
    return models.Workload(Attention(dropout=dropout), batch, _token_loss)


def train_both(workload: models.Workload, budget: str, steps: int = 3,
               make_optimizer: Any = lambda p: torch.optim.Adam(p, lr=1e-2)) -> Any:  # fmt: skip
    """Optimize a copy of ``workload`` at ``budget`` (with --check), train it and eager for
    ``steps`` calls from identical state and seeds, and assert everything is bitwise equal,
    including the random stream afterwards. Returns the optimized graph's record."""
    eager_model = copy.deepcopy(workload.model)
    eager_optimizer = make_optimizer(eager_model.parameters())
    optimizer = make_optimizer(workload.model.parameters())
    step = mutwo.optimize(workload.model, optimizer, workload.batch, workload.loss_fn, budget=budget, check=True,
                          backend="eager")  # bitwise against eager: the default (auto) compiles on CUDA
    device = next(workload.model.parameters()).device
    torch.manual_seed(1)
    losses = [step(workload.batch) for _ in range(steps)]
    after = generator_states(device)
    torch.manual_seed(1)
    eager = models.Workload(eager_model, workload.batch, workload.loss_fn)
    eager_losses = [models.eager_step(eager, eager_optimizer) for _ in range(steps)]
    assert all(map(torch.equal, generator_states(device), after)), "the random stream is not where eager leaves it"
    assert torch.equal(torch.stack(losses), torch.stack(eager_losses))
    for ours, theirs in zip(workload.model.state_dict().values(), eager_model.state_dict().values(), strict=True):
        assert torch.equal(ours, theirs)
    for ours, theirs in zip(optimizer.state.values(), eager_optimizer.state.values(), strict=True):
        assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    return step.last


def random_replays(graph: Graph) -> list[Any]:
    """Clones that replay a random op; each must read the state its forward original consumed."""
    replays = [n for n in graph if n.origin is not None and n.target is run_with_rng_state]
    for clone in replays:
        snapshot, original = clone.args[0], graph.node(clone.origin)
        assert snapshot.target is rng_state and snapshot.phase is Phase.FORWARD
        assert graph.nodes[graph.position(original) - 1] is snapshot, "the state is not taken right before the op"
        assert clone.args[1] is original.target
    return replays


def test_mlp_with_dropout_reaches_budget_0_6() -> None:
    """Before random ops were replayable, this model's lowest reachable peak was 62% of the unoptimized."""
    optimized = train_both(token_mlp(), "0.6")
    assert optimized.plan.met and optimized.plan.predicted_peak <= 0.6 * optimized.plan.unoptimized_peak
    assert random_replays(optimized.graph), "the plan reached 0.6 without replaying dropout"


def test_sdpa_with_dropout_is_replayed() -> None:
    optimized = train_both(attention(), "min", steps=2)
    assert any(n.is_random for n in optimized.original), "the captured attention draws no random numbers"
    assert random_replays(optimized.graph)


def test_batch_norm_is_replayed_from_its_saved_statistics() -> None:
    optimized = train_both(models.cnn(batch_size=16), "min",
                           make_optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))  # fmt: skip
    clones = collections.Counter(n.target for n in optimized.graph if n.origin is not None)
    assert clones[torch.ops.aten.native_batch_norm.default] == 0, "a clone reruns the whole batch norm"
    profile = optimized.context.artifacts["profile"]
    batch_norms = [n.id for n in optimized.original if n.target is torch.ops.aten.native_batch_norm.default]
    assert batch_norms and all(profile.nodes[i].replay_seconds is not None for i in batch_norms)
    assert all(profile.replay_seconds(i) == profile.nodes[i].replay_seconds for i in batch_norms)


def test_every_batch_norm_output_recomputed_is_replayed_bitwise_on_the_cpu() -> None:
    """Each batch norm's output recomputed, planned directly (which ones ``min`` picks depends on
    the measured times): every block replays from the saved statistics, and the step is bitwise."""
    lowered, original, recomputed = _every_batch_norm_recomputed(models.cnn(batch_size=16))
    graph = lowered.graph
    clones = collections.Counter(n.target for n in graph if n.origin is not None)
    assert clones[batch_norm_from_stats] == recomputed and clones[torch.ops.aten.native_batch_norm.default] == 0
    report = check_graphs(original, graph, lowered.inputs)
    assert report.equivalent and report.bitwise, report.summary()


def _every_batch_norm_recomputed(workload: models.Workload) -> tuple[Any, Graph, int]:
    """The captured CNN step (SGD with momentum) with each training batch norm's output recomputed,
    planned directly (the greedy may not choose them on a tiny model, and which it chooses depends
    on the measured times): the lowered step, the graph before, and how many outputs. Asserts that
    every block replays from the saved statistics and that the rewritten graph verifies."""
    lowered = capture_graph(workload.model, torch.optim.SGD(workload.model.parameters(), lr=0.1, momentum=0.9),
                            workload.batch, workload.loss_fn)  # fmt: skip
    graph, original = lowered.graph, lowered.graph.copy()
    outputs = [StorageKey(n.id, 0) for n in graph if training_batch_norm_stats(n) is not None]
    assert outputs, "no training batch norm in the captured graph"
    blocks = Recompute(graph, liveness_of(graph, PassContext())).plan(outputs)
    assert blocks and all(block.from_stats for block in blocks)
    insert_blocks(graph, blocks)
    verify(graph)
    return lowered, original, len(outputs)


# == what the checks catch and what is refused =====================================================
def test_a_replay_that_leaves_the_generator_moved_is_caught() -> None:
    """--check compares the random stream: a replay that does not restore the generator fails it.

    The replay is of the first of two dropouts, planned directly: a broken replay of the last
    random op of the iteration leaves the generator where the iteration leaves it anyway, so a
    plan chosen from measured times (which vary from run to run) could make the test pass
    vacuously or fail spuriously."""
    workload = token_mlp(depth=2)
    lowered = capture_graph(workload.model, torch.optim.SGD(workload.model.parameters(), lr=0.1), workload.batch,
                            workload.loss_fn)  # fmt: skip
    broken = lowered.graph.copy()
    first = next(n for n in broken if n.is_random and n.phase is Phase.FORWARD)
    drawn = first.mutated_operands[0].tensors[0].storage if first.mutated_operands else StorageKey(first.id, 0)
    insert_blocks(broken, [Recompute(broken, liveness_of(broken, PassContext())).plan_block(drawn, set(), {})])
    replays = random_replays(broken)
    assert [broken.node(r.origin) for r in replays] == [first]
    for clone in replays:
        clone.target = _replay_without_restoring
    report = compare_graphs(lowered.graph, broken, lowered.inputs, iterations=2)
    assert not report.equivalent
    assert {m.what for m in report.mismatches} == {"random generator"}


def _replay_without_restoring(state: torch.Tensor, op: Any, *args: Any, **kwargs: Any) -> Any:
    torch.set_rng_state(state)
    return op(*args, **kwargs)


def test_a_random_op_with_its_own_generator_is_refused() -> None:
    workload = token_mlp(depth=1)
    lowered = capture_graph(workload.model, torch.optim.SGD(workload.model.parameters(), lr=0.1),
                            workload.batch, workload.loss_fn)  # fmt: skip
    graph = lowered.graph
    (random_op,) = [n for n in graph if n.is_random]
    assert replayable(random_op)
    random_op.set_operands(random_op.args, {**random_op.kwargs, "generator": torch.Generator()})
    assert not replayable(random_op)
    assert refused_random_ops(graph) == [f"%{random_op.id} ({random_op.op_name}): it draws from its own "
                                         "generator, whose state cannot be restored"]  # fmt: skip
    recompute = Recompute(graph, liveness_of(graph, PassContext()))
    mask = next(u for u in random_op.users)  # the mask scaled in place, read by the backward
    with pytest.raises(NotRecomputable):
        recompute.plan_block(mask.tensors[0].storage, set(), {})


def test_attention_without_dropout_draws_nothing() -> None:
    """SDPA kernels are tagged as seeded, but draw only with a non-zero ``dropout_p`` (as torch's
    partitioner decides): without dropout they recompute like any other op."""
    workload = attention(dropout=0.0)
    lowered = capture_graph(workload.model, torch.optim.SGD(workload.model.parameters(), lr=0.1),
                            workload.batch, workload.loss_fn)  # fmt: skip
    seeded = [n for n in lowered.graph if torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())]
    assert seeded, "the captured attention has no SDPA kernel"
    assert not any(n.is_random for n in lowered.graph)


# == on the GPU ====================================================================================
def _on_cuda(workload: models.Workload) -> models.Workload:
    workload.model.cuda()
    workload.batch = torch.utils._pytree.tree_map(lambda t: t.cuda(), workload.batch)
    return workload


def _sdpa_call(kernel: str) -> tuple[Any, tuple[Any, ...]]:
    """An SDPA kernel with attention dropout and its arguments, as the captured graphs call them."""
    dtype = torch.bfloat16 if kernel == "flash" else torch.float32
    q, k, v = (torch.randn(2, 4, 64, 32, device="cuda", dtype=dtype) for _ in range(3))
    if kernel == "flash":
        return torch.ops.aten._scaled_dot_product_flash_attention.default, (q, k, v, 0.2)
    if kernel == "efficient":
        return torch.ops.aten._scaled_dot_product_efficient_attention.default, (q, k, v, None, True, 0.2)
    return torch.ops.aten._scaled_dot_product_attention_math.default, (q, k, v, None, 0.2)


@pytest.mark.cuda
@pytest.mark.parametrize("kernel", ["flash", "efficient", "math"])
def test_cuda_sdpa_kernels_with_dropout_replay_bitwise(kernel: str) -> None:
    """The replay draws what the original drew (every output, philox seed and offset included) and
    leaves the generator where the original left it."""
    op, args = _sdpa_call(kernel)
    state = rng_state("cuda")
    first = _copied(op(*args))  # copies: an output may share memory with what a later call writes
    after = torch.cuda.get_rng_state()
    torch.rand(16, device="cuda")  # move the generator on: the replay must not depend on where it is
    moved = torch.cuda.get_rng_state()
    again = _copied(run_with_rng_state(state, op, *args))
    assert torch.equal(torch.cuda.get_rng_state(), moved)
    assert not torch.equal(after, state), "the kernel drew nothing"
    names = [r.name for r in op._schema.returns]
    for name, a, b in zip(names, first, again, strict=True):
        if name == "unused":  # flash attention's placeholder output: uninitialized memory, read by nothing
            continue
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, (kernel, name, a, b)


def _copied(outputs: tuple[Any, ...]) -> list[Any]:
    return [o.clone() if isinstance(o, torch.Tensor) else o for o in outputs]


@pytest.mark.cuda
def test_cuda_dropout_replay_trains_like_eager() -> None:
    with deterministic_algorithms():
        optimized = train_both(_on_cuda(token_mlp()), "0.6")
    assert random_replays(optimized.graph)


@pytest.mark.cuda
def test_cuda_attention_with_dropout_passes_check() -> None:
    workload = _on_cuda(attention())
    optimized = mutwo.optimize(workload.model, torch.optim.Adam(workload.model.parameters(), lr=1e-2),
                               workload.batch, workload.loss_fn, budget="min", check=True,
                               backend="eager").last  # fmt: skip
    assert optimized.report.equivalent and optimized.report.bitwise, optimized.report.summary()
    replayed = {c.args[1] for c in random_replays(optimized.graph)}
    assert replayed & {torch.ops.aten._scaled_dot_product_efficient_attention.default,
                       torch.ops.aten._scaled_dot_product_flash_attention.default}, replayed  # fmt: skip


@pytest.mark.cuda
def test_cuda_batch_norm_replay_passes_check_within_tolerance() -> None:
    """On CUDA the replay is ``batch_norm_elemt``, which matches cuDNN's kernel only to rounding at
    some shapes: --check compares with tolerance when such a clone is in the graph, and says so.
    Each batch norm's output is recomputed here (the greedy may not choose them on a tiny model)."""
    lowered, original, _ = _every_batch_norm_recomputed(_on_cuda(models.cnn(batch_size=16)))
    report = check_graphs(original, lowered.graph, lowered.inputs)
    assert report.equivalent and not report.bitwise, report.summary()
