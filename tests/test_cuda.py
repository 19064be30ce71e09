"""Checks that need a GPU: run on the GPU machine before closing runtime issues (skipped on CPU)."""

from __future__ import annotations

import copy

import pytest
import torch

from mutwo.ir import from_fx
from mutwo.ir.memory import simulate
from mutwo.ir.to_fx import to_fx
from mutwo.runtime.capture.iteration import capture
from mutwo.runtime.execution.step import GraphStep
from mutwo.runtime.measurement.equivalence import compare_graphs, deterministic_algorithms, replays_exact
from mutwo.runtime.measurement.iterations import measure_iterations
from mutwo.runtime.measurement.profiler import profile_graph
from tests import models

pytestmark = pytest.mark.cuda


def _on_cuda(workload: models.Workload) -> models.Workload:
    workload.model.cuda()
    workload.batch = torch.utils._pytree.tree_map(lambda t: t.cuda(), workload.batch)
    return workload


@pytest.mark.parametrize("foreach", [None, False], ids=["default-foreach", "single-tensor"])
@pytest.mark.parametrize("optimizer", sorted(models.OPTIMIZERS))
@pytest.mark.parametrize("make", [models.cnn, models.bert], ids=["cnn", "bert"])
def test_cuda_graph_trains_like_eager(make: object, optimizer: str, foreach: bool | None) -> None:
    """With deterministic kernels, training is bitwise equal to eager torch.optim in both of its
    CUDA forms: the default multi-tensor (foreach) update and the single-tensor one."""
    mutwo_run, eager_run = _on_cuda(make()), _on_cuda(make())
    mutwo_opt = models.OPTIMIZERS[optimizer](mutwo_run.model.parameters(), foreach=foreach)
    eager_opt = models.OPTIMIZERS[optimizer](eager_run.model.parameters(), foreach=foreach)
    with deterministic_algorithms():
        _train_and_compare(mutwo_run, mutwo_opt, eager_run, eager_opt)


def _train_and_compare(mutwo_run: models.Workload, mutwo_opt: torch.optim.Optimizer, eager_run: models.Workload,
                       eager_opt: torch.optim.Optimizer) -> None:  # fmt: skip
    captured, binding = capture(mutwo_run.model, mutwo_opt, mutwo_run.batch, mutwo_run.loss_fn)
    graph = from_fx(captured.graph_module, [(s.kind, s.label) for s in captured.slots], captured.gradient_labels)
    step = GraphStep(graph, captured, binding)
    for iteration in range(3):
        torch.manual_seed(iteration)
        loss = step(mutwo_run.batch).loss
        torch.manual_seed(iteration)
        eager = models.eager_step(eager_run, eager_opt)
        torch.testing.assert_close(loss, eager, rtol=0, atol=0)
    for (name, p), (_, q) in zip(mutwo_run.model.named_parameters(), eager_run.model.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    for p, q in zip(mutwo_run.model.parameters(), eager_run.model.parameters(), strict=True):
        for key, value in eager_opt.state[q].items():
            torch.testing.assert_close(mutwo_opt.state[p][key], value, rtol=0, atol=0, msg=key)


def test_cuda_check_of_a_graph_against_its_copy_is_bitwise_with_deterministic_kernels() -> None:
    workload = _on_cuda(models.bert())
    optimizer = torch.optim.AdamW(workload.model.parameters(), lr=1e-3)
    captured, binding = capture(workload.model, optimizer, workload.batch, workload.loss_fn)
    graph = from_fx(captured.graph_module, [(s.kind, s.label) for s in captured.slots], captured.gradient_labels)
    inputs = binding.flat_inputs(workload.batch) + list(captured.constants.values())
    with deterministic_algorithms():
        report = compare_graphs(graph, graph.copy(), inputs)
    assert report.bitwise and report.equivalent, report.summary()


def test_cuda_simulated_peak_matches_measured() -> None:
    workload = _on_cuda(models.cnn(batch_size=64))
    optimizer = torch.optim.Adam(workload.model.parameters())
    captured, binding = capture(workload.model, optimizer, workload.batch, workload.loss_fn)
    graph = from_fx(captured.graph_module, [(s.kind, s.label) for s in captured.slots], captured.gradient_labels)
    inputs = binding.flat_inputs(workload.batch) + list(captured.constants.values())
    measured = measure_iterations(to_fx(graph), inputs, runs=3, warmup=2)
    profile = profile_graph(graph, inputs, runs=2, warmup=1, iteration_runs=0)
    simulated = simulate(graph, workspace=profile.workspace())
    assert measured.peak_bytes is not None
    assert abs(simulated.peak_bytes - measured.peak_bytes) <= 0.05 * measured.peak_bytes


@pytest.mark.parametrize("make", [models.cnn, models.bert], ids=["cnn", "bert"])
def test_cuda_rewrite_is_equivalent_and_fits_the_budget(make: object) -> None:
    from mutwo.ir.budget import parse_budget
    from mutwo.ir.pass_base import PassContext
    from mutwo.ir.pass_manager import PassManager
    from mutwo.ir.registry import PassRegistry

    workload = _on_cuda(make(batch_size=32) if make is models.cnn else make(batch_size=16, seq_len=64))
    optimizer = torch.optim.Adam(workload.model.parameters())
    captured, binding = capture(workload.model, optimizer, workload.batch, workload.loss_fn)
    graph = from_fx(captured.graph_module, [(s.kind, s.label) for s in captured.slots], captured.gradient_labels)
    original = graph.copy()
    inputs = binding.flat_inputs(workload.batch) + list(captured.constants.values())
    ctx = PassContext()
    ctx.services["profiler"] = lambda g, runs, warmup: profile_graph(g, inputs, runs=runs, warmup=warmup)
    ctx.services["budget"] = parse_budget("min")
    PassManager(PassRegistry().build_pipeline("profile,select,rewrite")).run(graph, ctx)
    assert any(n.origin is not None for n in graph)
    with deterministic_algorithms():
        report = compare_graphs(original, graph, inputs)
    # Bitwise unless the plan replays a batch norm from its statistics, which is exact on CPU only.
    assert report.equivalent and report.bitwise == replays_exact(graph, "cuda"), report.summary()
    measured = measure_iterations(to_fx(graph), inputs, runs=3, warmup=2)
    predicted = ctx.artifacts["plan"].predicted_peak
    assert measured.peak_bytes is not None and measured.peak_bytes <= 1.03 * predicted


def test_cuda_isolated_profile_times_kernels_not_the_hosts_launches() -> None:
    """With ``isolate`` a view (no kernel) measures next to nothing, where without it a view
    measures the host's time between its two events (20-45 µs on the H100's host); the nodes with
    kernels keep most of their time."""
    workload = _on_cuda(models.bert(batch_size=8, seq_len=64))
    optimizer = torch.optim.Adam(workload.model.parameters(), lr=1e-3)
    captured, binding = capture(workload.model, optimizer, workload.batch, workload.loss_fn)
    graph = from_fx(captured.graph_module, [(s.kind, s.label) for s in captured.slots], captured.gradient_labels)
    inputs = binding.flat_inputs(workload.batch) + list(captured.constants.values())
    plain = profile_graph(graph, inputs, runs=3, warmup=1, iteration_runs=1)
    isolated = profile_graph(graph, inputs, runs=3, warmup=1, iteration_runs=1, isolate=True)
    assert isolated.meta["isolated"] and not plain.meta["isolated"]
    views = [n.id for n in graph if n.op_name in ("aten.view.default", "aten.t.default", "aten.transpose.int")]
    assert views
    assert max(isolated.seconds(v) for v in views) < 5e-6 < sorted(plain.seconds(v) for v in views)[len(views) // 2]
    assert sum(p.seconds for p in isolated.nodes.values()) < sum(p.seconds for p in plain.nodes.values())


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_one_cycle_on_the_gpu_is_captured_once_and_trains_like_eager(optimizer: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """OneCycleLR changes the learning rate and momentum (SGD) or betas[0] (AdamW) at every step:
    on CUDA the non-capturable optimizers read them as host numbers fed to the graph, so the step
    is captured once and stays bitwise equal to eager with deterministic kernels."""
    from mutwo.runtime import api

    captures = []
    planning = api.optimize_graph
    monkeypatch.setattr(api, "optimize_graph", lambda *a, **k: captures.append(1) or planning(*a, **k))

    mine, eager = _on_cuda(models.bert()), _on_cuda(models.bert())
    my_opt, eager_opt = (models.OPTIMIZERS[optimizer](w.model.parameters()) for w in (mine, eager))
    schedulers = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.02, total_steps=8) for o in (my_opt, eager_opt)]
    with deterministic_algorithms():
        step = api.optimize(mine.model, my_opt, mine.batch, mine.loss_fn, budget="min", backend="eager")
        for iteration in range(6):
            torch.manual_seed(iteration)
            loss = step(mine.batch)
            torch.manual_seed(iteration)
            expected = models.eager_step(eager, eager_opt)
            for scheduler in schedulers:
                scheduler.step()
            torch.testing.assert_close(loss, expected, rtol=0, atol=0, msg=f"iteration {iteration}")
    assert len(captures) == 1, f"captured {len(captures)} times"
    for (name, p), (_, q) in zip(mine.model.named_parameters(), eager.model.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)


def test_planning_on_the_gpu_leaves_the_random_stream_to_training() -> None:
    """Seeded once: profiling and the check run the graph on the GPU and reseed, and still every
    dropout mask of training is the one eager training draws (the GPU's generator is kept too)."""
    from mutwo.runtime.api import optimize

    torch.manual_seed(0)
    mine = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Dropout(0.5),
                               torch.nn.Linear(256, 8)).cuda()  # fmt: skip
    eager = copy.deepcopy(mine)
    batches = [torch.randn(32, 64, device="cuda") for _ in range(3)]
    my_opt, eager_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (mine, eager))

    def loss_of(output: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
        return output.square().mean()

    with deterministic_algorithms():
        torch.manual_seed(1)
        step = optimize(mine, my_opt, (batches[0],), loss_of, check=True, backend="eager")
        losses = [step((batch,)) for batch in batches]
        torch.manual_seed(1)
        expected = []
        for batch in batches:
            eager_opt.zero_grad()
            loss = loss_of(eager(batch), batch)
            loss.backward()
            eager_opt.step()
            expected.append(loss.detach())
    assert torch.equal(torch.stack(losses), torch.stack(expected))
