"""Property-based tests of the recompute pipeline (hypothesis): profile, select, rewrite on random models.

Hypothesis draws small MLP-like models, 1 to 4 blocks of widths 4 to 24, each block plain
(``f(x)``), residual (``x + f(x)``, optionally followed by an in-place ReLU on the sum) or a
concatenation (``Linear(cat([x, f(x)]))``), where ``f`` is a Linear with optional BatchNorm1d, an
in-place or out-of-place activation and optional dropout; a batch of 2 to 16, optionally with a
token dimension (inputs of shape (batch, tokens, features), Linear over the features) so that
activations, not parameters and optimizer state, dominate the peak; SGD with momentum,
Adam or AdamW; and a budget (a fraction in [0.3, 1] or ``min``). The iteration is captured, the
pipeline ``profile{runs=1,warmup=0},select,rewrite`` runs under the pass manager with verification
after every pass, and then:

* the rewritten graph passes the verifier;
* it is bitwise equivalent to the captured graph over 3 iterations (loss, gradients, parameters,
  buffers, optimizer state);
* its simulated peak is the plan's predicted peak and fits the budget; clones exist exactly when the
  plan recomputes something;
* a budget select reports unreachable is acceptable, but then ``min`` must succeed and pass the same
  checks.

The examples are derandomized and no example database is used, so every run (CI included) draws the
same models.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F

from mutwo.ir import from_fx
from mutwo.ir.budget import parse_budget
from mutwo.ir.graph import Graph
from mutwo.ir.memory import simulate
from mutwo.ir.node import Phase
from mutwo.ir.pass_base import PassContext, PassFailure
from mutwo.ir.pass_manager import Instrumentation, PassManager, PipelineFailure
from mutwo.ir.registry import PassRegistry
from mutwo.ir.verifier import verify
from mutwo.runtime.capture.iteration import capture
from mutwo.runtime.measurement.equivalence import compare_graphs
from mutwo.runtime.measurement.profiler import NodeProfile, Profile, fingerprint, profile_graph

PIPELINE = "profile{runs=1,warmup=0},select,rewrite"
ACTIVATIONS = ("relu_", "leaky_relu_", "relu", "gelu", "tanh")


# == the models ==================================================================================
@dataclass(frozen=True)
class BlockSpec:
    kind: str  #: 'plain' | 'residual' | 'concat'
    width: int  #: output width of f (residual blocks keep their input width)
    activation: str  #: one of ACTIVATIONS; a trailing '_' means in place
    batch_norm: bool
    dropout: float  #: 0 for none
    relu_after_sum: bool  #: residual only: an in-place ReLU on x + f(x)


@dataclass(frozen=True)
class ModelSpec:
    tokens: int | None  #: positions per sample ((batch, tokens, features) inputs), or None for (batch, features)
    in_features: int
    blocks: tuple[BlockSpec, ...]
    classes: int
    batch_size: int
    optimizer: str
    budget: str
    seed: int


def _activation(name: str) -> nn.Module:
    return {
        "relu_": lambda: nn.ReLU(inplace=True), "leaky_relu_": lambda: nn.LeakyReLU(0.1, inplace=True),
        "relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh,
    }[name]()  # fmt: skip


class FeatureBatchNorm(nn.BatchNorm1d):
    """BatchNorm1d over the last dimension, for (batch, features) and (batch, tokens, features) inputs
    (every position is a sample). Not ``bn(x.transpose(1, 2)).transpose(1, 2)``: that captures a graph
    that cannot run (see test_batch_norm_over_transposed_features_captures_a_runnable_graph)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            return super().forward(x)
        return super().forward(x.reshape(-1, x.shape[-1])).reshape(x.shape)


class Block(nn.Module):
    def __init__(self, spec: BlockSpec, width_in: int) -> None:
        super().__init__()
        self.kind = spec.kind
        hidden = width_in if spec.kind == "residual" else spec.width
        layers: list[nn.Module] = [nn.Linear(width_in, hidden)]
        if spec.batch_norm:
            layers.append(FeatureBatchNorm(hidden))
        layers.append(_activation(spec.activation))
        if spec.dropout:
            layers.append(nn.Dropout(spec.dropout))
        self.f = nn.Sequential(*layers)
        self.merge = nn.Linear(width_in + hidden, spec.width) if spec.kind == "concat" else None
        self.after_sum = nn.ReLU(inplace=True) if spec.kind == "residual" and spec.relu_after_sum else None
        self.width_out = hidden if spec.kind != "concat" else spec.width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "plain":
            return self.f(x)
        if self.kind == "residual":
            y = x + self.f(x)
            return self.after_sum(y) if self.after_sum is not None else y
        assert self.merge is not None
        return self.merge(torch.cat([x, self.f(x)], dim=-1))


class RandomNet(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        blocks, width = [], spec.in_features
        for block_spec in spec.blocks:
            block = Block(block_spec, width)
            blocks.append(block)
            width = block.width_out
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(width, spec.classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def _loss(output: torch.Tensor, batch: Any) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), batch[1].reshape(-1))


def _optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-2)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.05)


widths = st.integers(min_value=4, max_value=24)
block_specs = st.builds(
    BlockSpec,
    kind=st.sampled_from(["plain", "residual", "concat"]),
    width=widths,
    activation=st.sampled_from(ACTIVATIONS),
    batch_norm=st.booleans(),
    dropout=st.sampled_from([0.0, 0.0, 0.1, 0.5]),
    relu_after_sum=st.booleans(),
)
budgets = st.one_of(st.floats(min_value=0.3, max_value=1.0).map(lambda f: f"{round(f, 2):g}"), st.just("min"))
model_specs = st.builds(
    ModelSpec,
    tokens=st.sampled_from([None, 8, 16, 32]),
    in_features=widths,
    blocks=st.lists(block_specs, min_size=1, max_size=4).map(tuple),
    classes=st.integers(min_value=2, max_value=6),
    batch_size=st.integers(min_value=2, max_value=16),
    optimizer=st.sampled_from(["sgd", "adam", "adamw"]),
    budget=budgets,
    seed=st.integers(min_value=0, max_value=2**16),
)


# == the pipeline =================================================================================
def capture_spec(spec: ModelSpec) -> tuple[Graph, list[torch.Tensor]]:
    """The captured iteration of ``spec``'s model as IR, and its inputs in slot order."""
    torch.manual_seed(spec.seed)
    model = RandomNet(spec)
    positions = () if spec.tokens is None else (spec.tokens,)
    batch = (torch.randn(spec.batch_size, *positions, spec.in_features),
             torch.randint(0, spec.classes, (spec.batch_size, *positions)))  # fmt: skip
    optimizer = _optimizer(spec.optimizer, model.parameters())
    captured, binding = capture(model, optimizer, batch, _loss)
    graph = from_fx(captured.graph_module, [(s.kind, s.label) for s in captured.slots], captured.gradient_labels)
    verify(graph)
    return graph, binding.flat_inputs(batch) + list(captured.constants.values())


def run_pipeline(original: Graph, inputs: list[torch.Tensor], budget: str) -> tuple[Graph, PassContext]:
    graph = original.copy()
    ctx = PassContext()
    ctx.services["profiler"] = lambda g, runs, warmup: profile_graph(g, inputs, runs=runs, warmup=warmup,
                                                                     iteration_runs=0)  # fmt: skip
    ctx.services["budget"] = parse_budget(budget)
    passes = PassRegistry().build_pipeline(PIPELINE)
    PassManager(passes, Instrumentation(verify=True)).run(graph, ctx)
    return graph, ctx


def is_unreachable(failure: PipelineFailure) -> bool:
    return (failure.pass_name == "select" and isinstance(failure.cause, PassFailure)
            and "is unreachable" in str(failure.cause))  # fmt: skip


def check_rewrite(original: Graph, graph: Graph, ctx: PassContext, inputs: list[torch.Tensor], budget: str) -> None:
    """Everything a successful rewrite promises."""
    verify(graph)
    plan = ctx.artifacts["plan"]
    clones = [n for n in graph if n.origin is not None]
    assert bool(clones) == bool(plan.entries), (len(clones), len(plan.entries))
    assert all(c.phase is Phase.BACKWARD and not c.is_random for c in clones)
    assert all(w.origin is not None for c in clones for w in c.mutated_operands), "a clone writes a forward value"
    workspace = ctx.artifacts["profile"].workspace()
    before = simulate(original, workspace=workspace).peak_bytes
    after = simulate(graph, workspace=workspace).peak_bytes
    assert plan.unoptimized_peak == before
    assert abs(plan.predicted_peak - after) <= 0.01 * after, (plan.predicted_peak, after)
    assert after <= before
    if budget != "min":
        assert after <= int(float(budget) * before), (after, budget, before)
    report = compare_graphs(original, graph, inputs, iterations=3)
    assert report.bitwise
    assert report.equivalent, report.summary()


# == the property ===============================================================================
@pytest.mark.slow
@settings(max_examples=40, deadline=None, derandomize=True, database=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip
@given(spec=model_specs)
def test_rewrite_is_verified_and_equivalent(spec: ModelSpec) -> None:
    original, inputs = capture_spec(spec)
    try:
        graph, ctx = run_pipeline(original, inputs, spec.budget)
    except PipelineFailure as failure:
        assert spec.budget != "min", f"the min budget failed: {failure}"
        assert is_unreachable(failure), f"select/rewrite failed for another reason: {failure}"
        assert "lowest peak" in str(failure)
        event("budget unreachable")
        graph, ctx = run_pipeline(original, inputs, "min")
        check_rewrite(original, graph, ctx, inputs, "min")
        event(f"min recomputes {'something' if ctx.artifacts['plan'].entries else 'nothing'}")
        return
    check_rewrite(original, graph, ctx, inputs, spec.budget)
    event(f"budget met, recomputing {'something' if ctx.artifacts['plan'].entries else 'nothing'}")


def test_the_strategy_covers_the_interesting_shapes() -> None:
    """The model strategy draws every block kind, in-place activations, batch norm and dropout."""
    seen: set[str] = set()

    @settings(max_examples=60, derandomize=True, database=None)
    @given(spec=model_specs)
    def collect(spec: ModelSpec) -> None:
        for block in spec.blocks:
            seen.add(block.kind)
            seen.add(block.activation)
            if block.batch_norm:
                seen.add("batch_norm")
            if block.dropout:
                seen.add("dropout")
        seen.add(spec.optimizer)
        seen.add("min" if spec.budget == "min" else "fraction")

    collect()
    expected = {"plain", "residual", "concat", *ACTIVATIONS, "batch_norm", "dropout", "sgd", "adam", "adamw", "min",
                "fraction"}  # fmt: skip
    assert expected <= seen, expected - seen


@pytest.mark.parametrize("budget", ["0.5", "min"])
def test_a_deep_mixed_model(budget: str) -> None:
    """A fixed model with every feature at once, so the property is exercised even if shrinking
    or the strategy changes."""
    spec = ModelSpec(
        tokens=16,
        in_features=12,
        blocks=(
            BlockSpec("plain", 24, "relu_", True, 0.0, False),
            BlockSpec("residual", 24, "gelu", False, 0.1, True),
            BlockSpec("concat", 16, "leaky_relu_", True, 0.0, False),
            BlockSpec("residual", 16, "tanh", True, 0.5, False),
        ),
        classes=5, batch_size=16, optimizer="adamw", budget=budget, seed=0,
    )  # fmt: skip
    original, inputs = capture_spec(spec)
    try:
        graph, ctx = run_pipeline(original, inputs, budget)
    except PipelineFailure as failure:
        assert budget != "min" and is_unreachable(failure), str(failure)
        graph, ctx, budget = *run_pipeline(original, inputs, "min"), "min"
    assert ctx.artifacts["plan"].entries, "expected this model to recompute something"
    check_rewrite(original, graph, ctx, inputs, budget)


# == bugs found by the property ===================================================================
class _TransposedBatchNormNet(nn.Module):
    """Linear -> BatchNorm1d over the features of (batch, tokens, features) via transposes -> Linear."""

    def __init__(self, contiguous: bool) -> None:
        super().__init__()
        self.contiguous = contiguous
        self.a, self.bn, self.b = nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.a(x).transpose(1, 2)
        return self.b(self.bn(h.contiguous() if self.contiguous else h).transpose(1, 2))


@pytest.mark.parametrize("contiguous", [False, True], ids=["transposed", "transposed-contiguous"])
@pytest.mark.xfail(strict=True, raises=RuntimeError, reason=(
    "capture bug: a BatchNorm1d applied across the features of a (batch, tokens, features) activation, "
    "Linear(4, 4) -> bn(h.transpose(1, 2)).transpose(1, 2) -> Linear(4, 2) on x of shape (2, 3, 4), SGD, captures a "
    "graph that cannot run: 'view size is not compatible with input tensor's size and stride'. Fake tensors give "
    "native_batch_norm's output (and native_batch_norm_backward's grad_input) the strides of their non-contiguous "
    "operand, (12, 1, 4), while the CPU kernels return contiguous tensors, (12, 3, 1); make_fx therefore emits an "
    "aten.view (of the forward output before the second Linear, or of the backward's transposed grad_input before "
    "the first Linear's weight gradient) where eager would copy. With h.contiguous() the forward is fine and the "
    "backward still fails. mutwo-opt fails in the profile pass, or with 'running the captured graph failed' in "
    "--check."))
def test_batch_norm_over_transposed_features_captures_a_runnable_graph(contiguous: bool) -> None:
    torch.manual_seed(0)
    model = _TransposedBatchNormNet(contiguous)
    batch = (torch.randn(2, 3, 4), torch.randint(0, 2, (2, 3)))
    captured, binding = capture(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, _loss)
    graph = from_fx(captured.graph_module, [(s.kind, s.label) for s in captured.slots], captured.gradient_labels)
    inputs = binding.flat_inputs(batch) + list(captured.constants.values())
    report = compare_graphs(graph, graph.copy(), inputs, iterations=1)  # runs the captured graph
    assert report.equivalent


class _LinearDropoutNet(nn.Module):
    """Linear(4, 4) -> dropout(0.3) -> Linear(4, 3): the smallest model where 'min' makes the peak worse."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.head = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.head(F.dropout(self.a(x), 0.3, training=True))


def _fixed_profile(graph: Graph) -> Profile:
    """A profile with the same time for every node, so that select's choices do not depend on the machine."""
    return Profile("cpu", fingerprint(graph), {n.id: NodeProfile(1e-6) for n in graph if n.op == "call_function"}, 1)


def test_min_budget_never_raises_the_peak() -> None:
    """Regression (found by the property, fixed in select by keeping the best exactly simulated plan): on
    this model 'min' used to recompute the dropout output, whose block also replays the first addmm (the
    dropout input is not kept), so both clones were live at once in the backward and the simulated peak went
    from 844 B to 892 B; a fraction budget then failed naming 106% of the unoptimized peak as 'the lowest
    peak recomputation reaches'. At scale: torchvision efficientnet_b0 {num_classes: 10}, image_size 64,
    batch 16, Adam reached 99.7 MB with --budget 0.6 but only 104.4 MB with --budget min."""
    torch.manual_seed(0)
    model = _LinearDropoutNet()
    batch = (torch.randn(6, 4), torch.randint(0, 3, (6,)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    captured, binding = capture(model, optimizer, batch, _loss)
    original = from_fx(captured.graph_module, [(s.kind, s.label) for s in captured.slots], captured.gradient_labels)
    inputs = binding.flat_inputs(batch) + list(captured.constants.values())
    graph = original.copy()
    ctx = PassContext()
    ctx.services["profiler"] = lambda g, runs, warmup: _fixed_profile(g)
    ctx.services["budget"] = parse_budget("min")
    PassManager(PassRegistry().build_pipeline(PIPELINE), Instrumentation(verify=True)).run(graph, ctx)
    check_rewrite(original, graph, ctx, inputs, "min")  # equivalent, and the peak is at most the unoptimized one
    assert ctx.artifacts["plan"].predicted_peak <= ctx.artifacts["plan"].unoptimized_peak
    # An unreachable fraction names a lowest peak that is no higher than the unoptimized one.
    ctx = PassContext()
    ctx.services["profiler"] = lambda g, runs, warmup: _fixed_profile(g)
    ctx.services["budget"] = parse_budget("0.5")
    with pytest.raises(PipelineFailure) as failure:
        PassManager(PassRegistry().build_pipeline(PIPELINE), Instrumentation(verify=True)).run(original.copy(), ctx)
    assert is_unreachable(failure.value), str(failure.value)
    percent = re.search(r"lowest peak recomputation reaches is [0-9.]+ (?:MiB|KiB|B) \((\d+)% of the unoptimized",
                        str(failure.value))  # fmt: skip
    assert percent is not None and int(percent.group(1)) <= 100, str(failure.value)
    assert ctx.artifacts["plan"].predicted_peak <= ctx.artifacts["plan"].unoptimized_peak
