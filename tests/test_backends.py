"""Backends for the final graph (docs/backends.md): Inductor on CPU (equivalence within the stated
tolerance, the plan's memory kept, the compile cache), refusals, and CUDA graphs on a GPU."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import fx, nn

import mutwo
from mutwo.ir.budget import parse_budget
from mutwo.ir.liveness import compute_liveness
from mutwo.ir.mask_replay import dropout_from_mask, mask_holder
from mutwo.ir.node import StorageKey
from mutwo.ir.recompute import Recompute, insert_blocks
from mutwo.ir.replay import batch_norm_elemt_decomposition, batch_norm_from_stats, rng_state
from mutwo.ir.swap import OFFLOAD
from mutwo.ir.to_fx import to_fx
from mutwo.runtime.api import optimize_graph
from mutwo.runtime.execution.backends import BackendError, backend_services, compile_graph, compile_inductor
from mutwo.runtime.execution.cuda_graphs import graphable_optimizer
from mutwo.runtime.execution.fusion import CUSTOM_PHASE
from mutwo.runtime.execution.swap import RUNTIME
from mutwo.runtime.measurement.equivalence import Tolerance, check_graphs, compare_graphs
from mutwo.runtime.measurement.iterations import cpu_iteration_peak
from mutwo.runtime.planning.captured import capture_graph
from tests import models
from tests.inductor_code import generated_anew
from tests.test_mask_replay import dropout_tanh_mlp
from tests.test_replay import token_mlp


def _adam(params: object) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)  # type: ignore[arg-type]


def test_inductor_step_trains_like_eager_within_the_stated_tolerance() -> None:
    """A CNN with batch norms replayed at the lowest budget: --check passes within the tolerance
    and says so, and 3 steps of the compiled step track eager torch.optim training."""
    workload = models.cnn(batch_size=8)
    reference = copy.deepcopy(workload.model)
    optimizer = _adam(workload.model.parameters())
    step = mutwo.optimize(workload.model, optimizer, workload.batch, workload.loss_fn, budget="min", check=True,
                          backend="inductor")  # fmt: skip
    report = step.last.report
    assert report is not None and report.equivalent and report.tolerance == Tolerance()
    assert "compiled-step tolerance" in report.summary() and not report.bitwise
    assert step.last.plan.entries, "nothing recomputed: the test would not exercise a plan"
    eager = models.Workload(reference, workload.batch, workload.loss_fn)
    eager_optimizer = _adam(reference.parameters())
    for _ in range(3):
        loss = step(workload.batch)
        expected = models.eager_step(eager, eager_optimizer)
        torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-5)
    for ours, theirs in zip(workload.model.state_dict().values(), reference.state_dict().values(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-3, atol=1e-5 + 3 * 2 * 1e-3)


def test_the_check_catches_a_compiled_step_that_computes_something_else() -> None:
    workload = models.mlp(batch_size=8)
    lowered = capture_graph(workload.model, torch.optim.SGD(workload.model.parameters(), lr=0.1), workload.batch,
                            workload.loss_fn)  # fmt: skip
    compiled = compile_graph(lowered.graph, lowered.inputs, "inductor")

    def off_by_a_percent(*flat: torch.Tensor) -> object:
        flat[0].mul_(1.01)  # a parameter read 1% too large: still "close" to a careless eye
        return compiled.run(*flat)

    report = compare_graphs(lowered.graph, lowered.graph, lowered.inputs, candidate_run=off_by_a_percent,
                            tolerance=Tolerance())  # fmt: skip
    assert not report.equivalent
    assert {m.what for m in report.mismatches} >= {"gradient", "parameter"}
    honest = check_graphs(lowered.graph, lowered.graph, lowered.inputs, candidate_run=compiled.run,
                          tolerance=compiled.tolerance)
    assert honest.equivalent, honest.summary()


def test_inductor_keeps_the_plans_peak() -> None:
    """Measured on the CPU (the profiler's allocation events): at the lowest budget the compiled
    step allocates no more than the eager executor of the same plan. Without the fusion rule of
    mutwo.runtime.execution.fusion this plan measured 3.20 MB against eager's 2.66 MB (docs/backends.md)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 16, 3, padding=1),
                        nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
                        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))  # fmt: skip
    batch = (torch.randn(32, 3, 16, 16), torch.randint(0, 10, (32,)))
    workload = models.Workload(models.Classifier(net), batch, models.cross_entropy)
    optimizer = torch.optim.SGD(workload.model.parameters(), lr=0.1, momentum=0.9)
    optimized = optimize_graph(workload.model, optimizer, workload.batch, workload.loss_fn,
                               budget=parse_budget("min"), passes="profile,select,rewrite")  # fmt: skip
    assert optimized.plan.entries
    eager = cpu_iteration_peak(to_fx(optimized.graph), optimized.inputs)
    compiled = compile_graph(optimized.graph, optimized.inputs, "inductor")
    assert cpu_iteration_peak(compiled.run, optimized.inputs) <= 1.03 * eager


def test_inductor_keeps_the_peak_of_a_plan_recomputing_a_max_pool() -> None:
    """The CNN of tests/models.py with its max-pool recomputed (both outputs), on the CPU: the C++
    backend's kernel grouping kept the max-pool's gradient alive while the batch norm's input
    gradient and a channels-last copy of the batch were allocated, 2.30 MB against eager's 2.10 MB
    (docs/backends.md); one kernel per fused node measures 2.11 MB."""
    workload = models.cnn(batch_size=64)
    lowered = capture_graph(workload.model, torch.optim.SGD(workload.model.parameters(), lr=0.1, momentum=0.9),
                            workload.batch, workload.loss_fn)  # fmt: skip
    graph = lowered.graph
    pooled = [r.key for r in compute_liveness(graph).activations()
              if graph.node(r.key.creator).op_name == "aten.max_pool2d_with_indices.default"]  # fmt: skip
    assert len(pooled) == 2, "the max-pool's values and indices are no longer both activations"
    insert_blocks(graph, Recompute(graph, compute_liveness(graph)).plan(pooled))
    eager = cpu_iteration_peak(to_fx(graph), lowered.inputs)
    compiled = compile_graph(graph, lowered.inputs, "inductor")
    assert cpu_iteration_peak(compiled.run, lowered.inputs) <= 1.03 * eager


def test_a_second_compile_hits_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    workload = models.mlp(batch_size=8)
    lowered = capture_graph(workload.model, torch.optim.SGD(workload.model.parameters(), lr=0.1), workload.batch,
                            workload.loss_fn)  # fmt: skip
    first = compile_graph(lowered.graph, lowered.inputs, "inductor")
    second = compile_graph(lowered.graph, lowered.inputs, "inductor")
    assert (first.cache_hit, second.cache_hit) == (False, True)
    assert (first.aot_cache_hit, second.aot_cache_hit) == (False, True)  # not traced again
    assert second.compile_seconds < first.compile_seconds
    assert any(tmp_path.iterdir()), "the cache was not written where TORCHINDUCTOR_CACHE_DIR points"


def test_a_compile_only_inductors_cache_answered_says_the_step_was_traced_again() -> None:
    """Where AOTAutograd's cache misses and Inductor's FX graph cache hits, the compile traced the
    whole step again (13-26 s of a restart on an H200, against 3 s for a hit of both): the log says so."""
    from mutwo.runtime.execution.backends import CompiledStep

    both = CompiledStep("inductor", lambda: None, 3.0, cache_hit=True, aot_cache_hit=True)
    inductors = CompiledStep("inductor", lambda: None, 20.0, cache_hit=True, aot_cache_hit=False)
    assert both.cache_note() == " (Inductor's cache)"
    assert inductors.cache_note() == " (Inductor's FX graph cache; AOTAutograd's missed, so the step was traced again)"
    assert inductors.describe()["compile_aot_cache_hit"] is False


@pytest.mark.parametrize("replay", ["dropout", "batch-norm"])
def test_a_plan_that_replays_a_dropout_or_batch_norm_hits_autograd_cache(
        replay: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A graph calling mutwo's replay functions is served by AOTAutograd's cache on the second
    compile, not re-traced: it bypassed that cache ("Unsupported call_function target"), and a
    restart of BERT-base b64 on the H100 re-traced its whole step (~13 s)."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    workload, target = (dropout_tanh_mlp(), dropout_from_mask) if replay == "dropout" else \
        (models.cnn(batch_size=8), batch_norm_from_stats)  # fmt: skip
    planned = optimize_graph(workload.model, _adam(workload.model.parameters()), workload.batch, workload.loss_fn,
                             passes="profile{runs=1,warmup=0},select,rewrite", budget=parse_budget("min"),
                             backend="inductor")  # fmt: skip
    assert any(n.target is target for n in planned.graph), f"no {replay} replayed: nothing exercised"
    compile_graph(planned.graph, planned.inputs, "inductor")
    hits, bypasses = counters["aot_autograd"]["autograd_cache_hit"], counters["aot_autograd"]["autograd_cache_bypass"]
    compile_graph(planned.graph, planned.inputs, "inductor")
    assert counters["aot_autograd"]["autograd_cache_bypass"] == bypasses
    assert counters["aot_autograd"]["autograd_cache_hit"] == hits + 1


def test_a_compile_that_autograd_cache_skips_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capfd: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """Without the replay functions marked cacheable, AOTAutograd's cache skips a plan replaying
    a dropout: the compile says so and names the function; with them, it says nothing. The reason
    stays out of the user's stderr (torch logs it at INFO only where TORCH_LOGS asks)."""
    import logging

    from mutwo.runtime.execution import backends

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    workload = dropout_tanh_mlp()
    planned = optimize_graph(workload.model, _adam(workload.model.parameters()), workload.batch, workload.loss_fn,
                             passes="profile{runs=1,warmup=0},select,rewrite", budget=parse_budget("min"),
                             backend="inductor")  # fmt: skip
    assert compile_graph(planned.graph, planned.inputs, "inductor").cache_bypass is None
    monkeypatch.setattr(backends, "replay_cache_keys", dict)
    logger = logging.getLogger("torch._functorch._aot_autograd.autograd_cache")
    before = (list(logger.handlers), logger.level, logger.propagate)
    capfd.readouterr()
    skipped = compile_graph(planned.graph, planned.inputs, "inductor")
    assert "Bypassing autograd cache" not in capfd.readouterr().err or logger.isEnabledFor(logging.INFO)
    assert skipped.cache_bypass is not None and "dropout_from_mask" in skipped.cache_bypass
    assert "AOTAutograd's cache skipped it" in skipped.cache_note() and "dropout_from_mask" in skipped.cache_note()
    assert skipped.describe()["compile_cache_bypass"] == skipped.cache_bypass
    assert (list(logger.handlers), logger.level, logger.propagate) == before  # left as found


def test_the_replay_cache_key_follows_the_replay_source(monkeypatch: pytest.MonkeyPatch) -> None:
    """Code compiled for one replay arithmetic is never served for another: the key is a digest of
    the source of the modules that define it."""
    import inspect

    from mutwo.runtime.execution import replay_cache_keys as keys

    before = keys.replay_cache_keys()
    assert set(before) == {"mutwo.ir.mask_replay.dropout_from_mask", "mutwo.ir.replay.batch_norm_from_stats"}
    real = inspect.getsource
    monkeypatch.setattr(keys.inspect, "getsource", lambda module: real(module) + "# changed")
    keys.replay_cache_keys.cache_clear()
    after = keys.replay_cache_keys()
    keys.replay_cache_keys.cache_clear()
    assert all(before[name] != after[name] for name in before)


def test_random_replays_are_not_planned_for_a_compiled_backend() -> None:
    """Inductor would bake a saved generator state in as a constant: select keeps dropout's outputs
    for a compiled backend, and a plan that replays them anyway is refused in one line."""
    workload = token_mlp()
    # 0.6: below what this model reaches without replaying dropout (tests/test_replay.py)
    replaying = optimize_graph(workload.model, _adam(workload.model.parameters()), workload.batch,
                               workload.loss_fn, budget=parse_budget("0.6"))  # fmt: skip
    with pytest.raises(BackendError, match="replays random ops from a saved generator state") as refused:
        compile_graph(replaying.graph, replaying.inputs, "inductor")
    assert "\n" not in str(refused.value)
    messages: list[str] = []
    planned = optimize_graph(workload.model, _adam(workload.model.parameters()), workload.batch, workload.loss_fn,
                             budget=parse_budget("0.75"), backend="inductor", log=messages.append)  # fmt: skip
    assert not any(n.is_random for n in planned.graph if n.origin is not None)
    assert any("cannot replay random ops" in m for m in messages)


def test_inductor_runs_a_swap_plan() -> None:
    """A plan that swaps compiles under Inductor (``mutwo::wait`` becomes the in-place
    ``mutwo::wait_``, which Inductor reinplaces: a copy of the prefetched tensor instead would make
    the runtime refuse the wait) and trains like the eager graph of the same plan within the
    compiled-step tolerance, every copy consumed."""
    workload = models.cnn(batch_size=32)
    swapping = optimize_graph(workload.model, _adam(workload.model.parameters()), workload.batch, workload.loss_fn,
                              passes="profile{runs=1,warmup=0},swap", budget=parse_budget("0.8"))  # fmt: skip
    assert swapping.plan.of("swap"), "nothing swapped: the test would not exercise a swap plan"
    compiled = compile_graph(swapping.graph, swapping.inputs, "inductor")
    offloads = RUNTIME.offloads
    with torch.no_grad():
        compiled.run(*[t.clone() for t in swapping.inputs])
    assert RUNTIME.offloads - offloads == sum(node.target is OFFLOAD for node in swapping.graph) > 0
    report = check_graphs(swapping.graph, swapping.graph, swapping.inputs, candidate_run=compiled.run,
                          tolerance=compiled.tolerance)  # fmt: skip
    assert report.equivalent, report.summary()
    assert RUNTIME.in_flight == 0


@pytest.mark.parametrize("options", ["allow=recompute", "keep_faster=false,bandwidth=2"])
def test_select_swap_plans_for_inductor_without_generator_replays(options: str) -> None:
    """Planning swaps for Inductor (optimize(..., backend="inductor")) on an MLP whose dropouts
    return their masks: select-swap prices recomputes as fused (asked to), recomputes dropouts only from their
    masks (no generator state; with recompute only at min it does), never swaps a mask out (with
    cheap copies at min it swaps), and the plan compiles and passes the check within the tolerance."""
    workload = dropout_tanh_mlp()
    messages: list[str] = []
    planned = optimize_graph(workload.model, _adam(workload.model.parameters()), workload.batch, workload.loss_fn,
                             passes=f"profile{{runs=1,warmup=0}},select-swap{{{options},fused=true}},insert-swap",
                             budget=parse_budget("min"), backend="inductor", check=True,
                             log=messages.append)  # fmt: skip
    assert any("select-swap: pricing recomputes as Inductor fuses them" in m for m in messages)
    assert not any(node.target is rng_state for node in planned.graph)
    if options == "allow=recompute":
        assert any(node.target is dropout_from_mask for node in planned.graph), "no dropout replayed from its mask"
    else:
        masks = {h.tensors[0].storage for h in map(mask_holder, planned.original) if h is not None}
        swapped = {StorageKey(e["storage_creator"], e["storage_output"]) for e in planned.plan.of("swap")}
        assert masks and swapped and not masks & swapped
        priced = "select-swap: under Inductor, swaps and recomputes are priced with eager node times"
        assert any(priced in m for m in messages)
    assert planned.report is not None and planned.report.equivalent, planned.report
    assert "compiled-step tolerance" in planned.report.summary()


def test_cuda_graphs_refuse_a_cpu_step() -> None:
    workload = models.mlp()
    with pytest.raises(BackendError, match="CUDA graphs need the model"):
        mutwo.optimize(workload.model, _adam(workload.model.parameters()), workload.batch, workload.loss_fn,
                       backend="cudagraphs")  # fmt: skip


def test_unknown_backend() -> None:
    workload = models.mlp()
    with pytest.raises(BackendError, match="unknown backend 'tvm'; choose one of auto, eager, inductor"):
        mutwo.optimize(workload.model, _adam(workload.model.parameters()), workload.batch, workload.loss_fn,
                       backend="tvm")  # fmt: skip


def test_backend_services_say_what_select_may_replay_and_how_it_prices() -> None:
    assert backend_services("eager") == {"replay_random": True, "fused_recompute": False}
    assert backend_services("cudagraphs") == {"replay_random": False, "fused_recompute": False}
    for backend in ("inductor", "inductor-cudagraphs"):
        assert backend_services(backend) == {"replay_random": False, "fused_recompute": True}


# -- batch_norm_elemt, decomposed for Inductor ---------------------------------------------------
def _elemt_operands(dtype: torch.dtype, channels_last: bool, affine: bool) -> list[torch.Tensor | None]:
    """An input of ``dtype`` and float32 statistics (a mixed-precision batch norm's), for 3 channels."""
    torch.manual_seed(0)
    x = torch.randn(4, 3, 5, 6).to(dtype)
    x = x.to(memory_format=torch.channels_last) if channels_last else x
    weight, bias = (torch.randn(3), torch.randn(3)) if affine else (None, None)
    return [x, weight, bias, torch.randn(3), torch.rand(3) + 0.5]


def _elemt_reference(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, mean: torch.Tensor,
                     invstd: torch.Tensor, math: torch.dtype) -> torch.Tensor:  # fmt: skip
    """``((x - mean) * invstd) * weight + bias`` in ``math``, per channel, cast back to ``x``'s dtype."""
    def channel(t: torch.Tensor) -> torch.Tensor:
        return t.to(math)[None, :, None, None]

    out = (x.to(math) - channel(mean)) * channel(invstd)
    out = out * channel(weight) if weight is not None else out
    return (out + channel(bias) if bias is not None else out).to(x.dtype)


@pytest.mark.parametrize("dtype,math", [(torch.float32, torch.float32), (torch.float64, torch.float64),
                                        (torch.bfloat16, torch.float32), (torch.float16, torch.float32)])  # fmt: skip
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("affine", [True, False])
def test_the_batch_norm_elemt_decomposition_is_the_kernels_formula(dtype: torch.dtype, math: torch.dtype,
                                                                    channels_last: bool, affine: bool) -> None:
    """Half-precision inputs are computed in float32 and cast back, as ATen's kernel does; the
    output keeps the input's dtype and memory format."""
    operands = _elemt_operands(dtype, channels_last, affine)
    out = batch_norm_elemt_decomposition(*operands, 1e-5)  # type: ignore[arg-type]
    assert out.dtype == dtype and out.stride() == operands[0].stride()  # type: ignore[union-attr]
    assert torch.equal(out, _elemt_reference(*operands, math))  # type: ignore[arg-type]


@pytest.fixture
def elemt_meta() -> Iterator[None]:
    """A meta kernel for ``aten.batch_norm_elemt``, which has a CUDA kernel only: Inductor's fake
    tensors on the CPU need one to trace it (on CUDA they run the real kernel on zeros)."""
    from torch._prims_common import suggest_memory_format

    library = torch.library.Library("aten", "IMPL")
    library.impl("batch_norm_elemt", lambda x, *_: torch.empty_like(x, memory_format=suggest_memory_format(x)),
                 "Meta")  # fmt: skip
    yield
    library._destroy()


@pytest.mark.parametrize("channels_last,affine", [(True, True), (False, False)])
def test_inductor_fuses_a_batch_norm_replay_with_the_relu_after_it(elemt_meta: None, channels_last: bool,
                                                                    affine: bool) -> None:  # fmt: skip
    """``batch_norm_elemt`` (the CUDA replay of a batch norm from its statistics) then a ReLU,
    compiled as a step is: one fused kernel, no call to the op (it has no CPU kernel: the step
    would fail), and bitwise the formula (the same operations in the same order)."""
    from torch._inductor.decomposition import decompositions
    from torch._inductor.utils import run_and_get_code

    operands = _elemt_operands(torch.float32, channels_last, affine)
    graph = fx.Graph()
    args = [None if t is None else graph.placeholder(f"operand_{i}") for i, t in enumerate(operands)]
    normalized = graph.call_function(torch.ops.aten.batch_norm_elemt.default, (*args, 1e-5))
    relu = graph.call_function(torch.ops.aten.relu.default, (normalized,))
    for node in (normalized, relu):
        node.meta["custom"] = {CUSTOM_PHASE: "backward"}  # what mark_phases records, which phases_arrived checks
    graph.output((normalized, relu))
    inputs = [t for t in operands if t is not None]
    (compiled, *_), code = run_and_get_code(compile_inductor, fx.GraphModule(nn.Module(), graph), inputs)
    assert "aten.batch_norm_elemt" not in code[0] and code[0].count("cpp_fused_") == 2  # its definition and call
    out, relu_out = compiled(*inputs)
    expected = _elemt_reference(*operands, torch.float32)  # type: ignore[arg-type]
    assert torch.equal(out, expected) and torch.equal(relu_out, expected.relu())
    assert torch.ops.aten.batch_norm_elemt.default not in decompositions, "Inductor's table was not restored"
    assert out.stride() == relu_out.stride() == operands[0].stride()  # type: ignore[union-attr]


def _residual_step(product_read_later: bool) -> fx.GraphModule:
    """A forward ``a = x @ w - r`` (the product a buffer of its own) that the forward reduces and a
    backward node reads, each node marked with its phase (what mark_phases records); with
    ``product_read_later`` the backward reads the product too."""
    aten = torch.ops.aten
    graph = fx.Graph()
    x, w, r = graph.placeholder("x"), graph.placeholder("w"), graph.placeholder("r")
    product = graph.call_function(aten.mm.default, (x, w))
    added = graph.call_function(aten.sub.Tensor, (product, r))
    reduced = graph.call_function(aten.sum.default, (graph.call_function(aten.relu.default, (added,)),))
    later = [graph.call_function(aten.mul.Tensor, (added, 2.0))]
    if product_read_later:
        later.append(graph.call_function(aten.mul.Tensor, (product, 3.0)))
    for node in graph.nodes:
        if node.op == "call_function":
            node.meta["custom"] = {CUSTOM_PHASE: "backward" if node in later else "forward"}
    graph.output((reduced, *later))
    return fx.GraphModule(nn.Module(), graph)


@pytest.mark.parametrize("product_read_later", [False, True])
def test_a_forward_value_read_in_the_backward_is_stored_where_its_inputs_would_die(product_read_later: bool) -> None:
    """Lowering inlines a pointwise node reading few buffers into every reader, so a backward reader
    recomputes it from its inputs, which stay alive until then instead of the value the plan kept
    (BERT-base b64 sliced on the H100: two 96 MiB buffers per residual add where the plan kept one).
    A forward value read in the backward is stored where it is computed, and the backward's kernel
    reads it, not its inputs (without the rule: ``cpp_fused_mul_sub_1(buf0, arg2_1, buf2)``), unless
    everything it reads outlives the forward anyway (here the backward reads the product too):
    then it is recomputed there and not stored (GPT-2's GELU intermediates)."""
    import re

    from torch._inductor.utils import run_and_get_code

    inputs = [torch.randn(7, 5), torch.randn(5, 13), torch.randn(7, 13)]
    module = _residual_step(product_read_later)
    with generated_anew():  # the phases are not in the cache's key
        (compiled, *_), code = run_and_get_code(compile_inductor, module, inputs)
    kernels = re.findall(r"^\s*(cpp_fused_\w+)\(([^)]*)\)", code[0], re.MULTILINE)
    (forward, _), *later = kernels
    assert "sub" in forward and later, kernels
    recomputing = [name for name, _ in later if "sub" in name]
    if product_read_later:  # recomputed in the backward from the product and r, both kept anyway
        assert recomputing, kernels
    else:  # stored, read back: neither recomputed nor r (arg2_1) read in the backward
        assert not recomputing and not any("arg2_1" in args for _, args in later), kernels
    for got, expected in zip(compiled(*inputs), module(*inputs), strict=True):
        torch.testing.assert_close(got, expected)  # a sum: vectorized, in another order


@pytest.mark.parametrize("name", ["cnn", "bert"])
def test_inductor_pre_grad_passes_leave_a_captured_step_as_it_is(name: str) -> None:
    """The ground for skipping them (``pre_grad_passes_skipped``): Inductor's pre-grad passes,
    written for Dynamo's Torch-IR graphs, change nothing in a captured whole iteration of aten ops
    (batch norm, convolutions, dropout, attention, Adam). Should a torch start rewriting aten
    graphs there, this fails and the skip must go."""
    from torch._inductor.fx_passes.pre_grad import pre_grad_passes
    from torch._subclasses.fake_tensor import FakeTensorMode

    from mutwo.runtime.execution.backends import pre_grad_passes_skipped

    workload = getattr(models, name)()
    lowered = capture_graph(workload.model, _adam(workload.model.parameters()), workload.batch, workload.loss_fn)
    module = to_fx(lowered.graph)
    before = module.code
    fake_mode = FakeTensorMode()
    with fake_mode:
        fakes = [fake_mode.from_tensor(t) for t in lowered.inputs]
    assert pre_grad_passes(module, fakes).code == before
    assert pre_grad_passes_skipped() == {"use_pre_grad_passes": False}


def test_compile_step_regenerates_the_step_s_code_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rewrites before Inductor (random draws, optimizer host calls, ...) each ask to recompile
    the module; the code is regenerated once, when the module first runs (to_fx's modules generate
    it on demand, :mod:`mutwo.ir.fx_modules`), and the module runs as rewritten (BERT-base's restart
    paid 0.15-0.2 s per regeneration)."""
    from mutwo.runtime.execution import backends

    workload = models.mlp()
    lowered = capture_graph(workload.model, torch.optim.SGD(workload.model.parameters(), lr=0.1), workload.batch,
                            workload.loss_fn)  # fmt: skip
    module = to_fx(lowered.graph)
    calls = []
    original = fx.GraphModule.recompile  # what every module's code generation comes down to
    monkeypatch.setattr(fx.GraphModule, "recompile", lambda self: calls.append(self) or original(self))
    monkeypatch.setattr(backends, "compile_inductor", lambda module, inputs, **_: (module, False, False, None))
    with backends.one_recompile(module):
        backends.draw_as_eager(module, lowered.graph, lowered.inputs, "inductor")  # the mlp's dropout: rewritten
        backends.functionalizable_host_calls(module)
    fresh = to_fx(lowered.graph)
    backends.compile_step(fresh, lowered.inputs, "inductor", lowered.graph)
    assert calls == [], "nothing regenerated before a module runs"
    report = compare_graphs(lowered.graph, lowered.graph, lowered.inputs, candidate_run=module)
    assert report.bitwise and report.equivalent, report.summary()
    # (the comparison runs the reference graph's own module too)
    assert [c for c in calls if c is module] == [module], "regenerated once, as rewritten, when it first ran"


# -- on a GPU ------------------------------------------------------------------------------------
def _cuda_cnn() -> tuple[models.Workload, models.Workload]:
    """A CNN on the GPU and an identical copy, for a capturable Adam with a learning rate on the GPU."""
    workload = models.cnn(batch_size=16)
    workload = models.Workload(workload.model.cuda(), tuple(t.cuda() for t in workload.batch), workload.loss_fn)
    return workload, models.Workload(copy.deepcopy(workload.model), workload.batch, workload.loss_fn)


def _capturable_adam(model: torch.nn.Module) -> torch.optim.Optimizer:
    optimizer = _adam(model.parameters())
    graphable_optimizer(optimizer, torch.device("cuda"))
    assert optimizer.param_groups[0]["capturable"] and optimizer.param_groups[0]["lr"].is_cuda
    return optimizer


@pytest.mark.cuda
def test_cuda_graphs_replay_bitwise_like_the_eager_backend() -> None:
    from mutwo.runtime.measurement.equivalence import deterministic_algorithms

    graphed, plain = _cuda_cnn()
    with deterministic_algorithms():
        replayed = mutwo.optimize(graphed.model, _capturable_adam(graphed.model), graphed.batch, graphed.loss_fn,
                                  backend="cudagraphs")  # fmt: skip
        eager = mutwo.optimize(plain.model, _capturable_adam(plain.model), plain.batch, plain.loss_fn, backend="eager")
        for _ in range(3):
            assert torch.equal(replayed(graphed.batch), eager(plain.batch))
    for ours, theirs in zip(graphed.model.state_dict().values(), plain.model.state_dict().values(), strict=True):
        assert torch.equal(ours, theirs)
    runner = replayed.last.step.compiled.run
    assert runner.recordings == 1 and runner.recorded_peak_bytes > 0


@pytest.mark.cuda
def test_cuda_graphs_copy_each_new_batch_in() -> None:
    graphed, plain = _cuda_cnn()
    replayed = mutwo.optimize(graphed.model, _capturable_adam(graphed.model), graphed.batch, graphed.loss_fn,
                              backend="cudagraphs")  # fmt: skip
    eager = mutwo.optimize(plain.model, _capturable_adam(plain.model), plain.batch, plain.loss_fn, backend="eager")
    for seed in range(3):
        torch.manual_seed(seed)
        batch = (torch.randn_like(graphed.batch[0]), torch.randint(0, 10, graphed.batch[1].shape, device="cuda"))
        torch.testing.assert_close(replayed(batch), eager(batch), rtol=1e-4, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize(("backend", "graphable"), [("inductor", False), ("inductor", True),
                                                    ("inductor-cudagraphs", True),
                                                    ("inductor-cudagraphs", False)])  # fmt: skip
def test_compiled_backends_on_the_gpu_pass_the_check(backend: str, graphable: bool) -> None:
    """Inductor with the learning rate and Adam's step counts on the host (the default) or on the
    GPU, and Inductor replayed as a CUDA graph, at the lowest budget (a stock Adam: mutwo traces
    its capturable form, tests/test_cuda_graph_optimizer.py)."""
    graphed, _ = _cuda_cnn()
    optimizer = _capturable_adam(graphed.model) if graphable else _adam(graphed.model.parameters())
    step = mutwo.optimize(graphed.model, optimizer, graphed.batch, graphed.loss_fn, budget="min", backend=backend,
                          check=True)  # fmt: skip
    assert step.last.report is not None and step.last.report.equivalent, step.last.report.summary()
    losses = [float(step(graphed.batch)) for _ in range(3)]
    assert losses[-1] < losses[0]


@pytest.mark.cuda
def test_a_channels_last_cnn_compiled_on_the_gpu_passes_the_check() -> None:
    """The memory_format option's GPU case: a channels-last CNN, recomputing at the lowest budget,
    compiled by Inductor (cuDNN's NHWC kernels), checked against its captured graph."""
    from mutwo.tools.workloads import channels_last

    graphed = channels_last(_cuda_cnn()[0], "cnn")
    step = mutwo.optimize(graphed.model, _adam(graphed.model.parameters()), graphed.batch, graphed.loss_fn,
                          budget="min", backend="inductor", check=True)  # fmt: skip
    assert step.last.report is not None and step.last.report.equivalent, step.last.report.summary()


@pytest.mark.cuda
def test_peak_calibration_measures_the_compiled_step_on_the_gpu() -> None:
    """--calibrate-peak's GPU case: each round's peak comes from the CUDA allocator; the kept step
    passes the check, and a round within 3% of the budget, if any, is the one kept."""
    graphed, _ = _cuda_cnn()
    step = mutwo.optimize(graphed.model, _adam(graphed.model.parameters()), graphed.batch, graphed.loss_fn,
                          budget=0.7, backend="inductor", calibrate_peak=2, check=True)  # fmt: skip
    optimized = step.last
    assert optimized.report is not None and optimized.report.equivalent, optimized.report.summary()
    calibration = optimized.calibration
    assert calibration is not None and all(r.measured_peak_bytes > 0 for r in calibration.rounds)
    if any(abs(r.measured_peak_bytes / calibration.target_bytes - 1) <= 0.03 for r in calibration.rounds):
        assert calibration.within, calibration.summary()


@pytest.mark.cuda
def test_cuda_recordings_released_leave_no_cublas_workspace_behind() -> None:
    """Every recording warms up on the one warm-up stream of its device: cuBLAS keeps a workspace
    per stream for the process's life, so recordings on new streams each left 32 MiB allocated
    (bench/cublas_workspace_probe.py)."""
    from mutwo.runtime.execution.cuda_graphs import CudaGraphRunner

    weight = torch.randn(1024, 1024, device="cuda")
    x = torch.randn(2048, 1024, device="cuda")
    allocated = []
    for _ in range(3):
        runner = CudaGraphRunner(lambda w, v: ((v @ w).relu().sum(),), [True, False])
        runner(weight, x)
        runner.release()
        del runner
        torch.cuda.synchronize()
        allocated.append(torch.cuda.memory_allocated())
    assert allocated[1] == allocated[2], allocated


def test_release_all_resets_every_live_recording_now() -> None:
    """``release_all`` resets each live runner's CUDA graph at once (a data-parallel run calls it
    before destroying an NCCL group, which hangs while a recording of its collectives lives)."""
    from mutwo.runtime.execution.cuda_graphs import CudaGraphRunner, release_all

    reset: list[str] = []

    class Recording:  # stands in for torch.cuda.CUDAGraph, which needs a GPU
        def __init__(self, name: str) -> None:
            self.name = name

        def reset(self) -> None:
            reset.append(self.name)

    runners = [CudaGraphRunner(lambda x: (x,), [False]) for _ in range(3)]
    runners[0].graph, runners[2].graph = Recording("first"), Recording("third")  # the second never recorded
    assert release_all() == 2
    assert sorted(reset) == ["first", "third"] and all(r.graph is None for r in runners)
    assert release_all() == 0


def _bare_assertion() -> None:
    raise AssertionError  # a check with no message, as torch's own asserts often are


def test_compile_failure_names_where_an_error_with_no_message_was_raised() -> None:
    """Inductor wraps a bare ``assert`` of torch's as ``InductorError: AssertionError:``; the one
    line the user gets names the file, line and function that raised it, so it can be reported."""
    from torch._inductor.exc import InductorError

    from mutwo.runtime.execution.backends import compile_failure_summary

    try:
        _bare_assertion()
    except AssertionError as inner:
        wrapped = InductorError(inner, "")
    summary = compile_failure_summary(wrapped)
    assert summary.startswith("InductorError: AssertionError raised at ")
    assert summary.endswith(f"test_backends.py:{_bare_assertion.__code__.co_firstlineno + 1} in _bare_assertion")
    # an error that says what went wrong keeps its own first line
    assert compile_failure_summary(InductorError(ValueError("no kernel for op"), "")) == (
        "InductorError: ValueError: no kernel for op")
