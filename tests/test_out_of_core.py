"""Profiling a step that does not fit: the out-of-core run (runtime/measurement/out_of_core.py).

On the CPU the "device" and the host are the same memory, but the run moves storages between a
device copy and a home copy exactly as it does on a GPU, so what matters is checked here: the
run computes bitwise what the whole graph computes (loss, gradients, and the inputs' in-place
updates: optimizer state, batch-norm statistics, dropout drawn from the same generator), leaves
the caller's tensors as they were, and keeps at most the limit of the iteration's own values
resident wherever one node's own inputs and outputs fit in it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.utils import _pytree as pytree

import mutwo.runtime.planning.captured as captured
from mutwo.ir.memory import simulate
from mutwo.ir.to_fx import to_fx
from mutwo.runtime.measurement.device_memory import apply_memory_limit, device_capacity
from mutwo.runtime.measurement.equivalence import deterministic_algorithms
from mutwo.runtime.measurement.out_of_core import (
    OutOfCoreError,
    OutOfCoreInterpreter,
    profiling_limit,
    run_out_of_core,
)
from mutwo.runtime.measurement.profiler import profile_graph
from mutwo.runtime.planning.captured import CapturedGraph, capture_graph
from mutwo.tools.cli import EXIT_USAGE
from mutwo.tools.mutwo_opt import main
from tests import models

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _captured(name: str) -> CapturedGraph:
    workload = getattr(models, name)()
    optimizer = torch.optim.Adam(workload.model.parameters(), lr=1e-3)
    return capture_graph(workload.model, optimizer, workload.batch, workload.loss_fn)


@pytest.mark.parametrize("name", ["mlp", "cnn", "bert"])
def test_out_of_core_run_is_bitwise_the_whole_graph_and_leaves_the_inputs(name: str) -> None:
    lowered = _captured(name)
    simulation = simulate(lowered.graph)
    limit = (simulation.peak_bytes - simulation.persistent_bytes) // 4
    before = [t.clone() for t in lowered.inputs]
    expected_state = [t.clone() for t in lowered.inputs]
    torch.manual_seed(1)  # dropout draws the same masks in both runs
    with torch.no_grad():
        expected = to_fx(lowered.graph)(*expected_state)
    torch.manual_seed(1)
    outputs, state, residency = run_out_of_core(lowered.graph, lowered.inputs, limit)
    for got, want in zip(pytree.tree_leaves(outputs), pytree.tree_leaves(expected), strict=True):
        assert torch.equal(got, want)
    for got, want in zip(state, expected_state, strict=True):  # Adam's state, running statistics
        assert torch.equal(got, want)
    for now, then in zip(lowered.inputs, before, strict=True):  # the caller's model is untouched
        assert torch.equal(now, then)
    assert residency.copied_in > 0 and residency.copied_out > 0  # it did move values


def test_an_op_failing_after_it_wrote_an_input_leaves_the_caller_s_tensors_as_they_were(
        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Adam's step count is written in place; the op then runs out of memory (as a multi-tensor update
    can, half-way): the run stops in one sentence, without running the op twice, and every input is
    restored from its snapshot."""
    lowered = _captured("mlp")
    simulation = simulate(lowered.graph)
    before = [t.clone() for t in lowered.inputs]
    ran = OutOfCoreInterpreter.call_function
    calls: list[object] = []

    def write_then_fail(self: OutOfCoreInterpreter, target: object, args: tuple[object, ...],
                        kwargs: dict[str, object]) -> object:  # fmt: skip
        result = ran(self, target, args, kwargs)
        if target is torch.ops.aten.add_.Tensor and any(args[0] is t for t in lowered.inputs):
            calls.append(target)
            raise torch.OutOfMemoryError("CUDA out of memory (after the op wrote its operand)")
        return result

    monkeypatch.setattr(OutOfCoreInterpreter, "call_function", write_then_fail)
    with pytest.raises(OutOfCoreError, match="writes in place or draws random numbers, so it is not run again"):
        run_out_of_core(lowered.graph, lowered.inputs, (simulation.peak_bytes - simulation.persistent_bytes) // 4)
    assert len(calls) == 1
    for now, then in zip(lowered.inputs, before, strict=True):
        assert torch.equal(now, then)


def test_out_of_core_stays_within_the_limit_when_each_node_fits() -> None:
    lowered = _captured("bert")
    simulation = simulate(lowered.graph)
    iteration_values = simulation.peak_bytes - simulation.persistent_bytes
    for share in (2, 4):
        _, _, residency = run_out_of_core(lowered.graph, lowered.inputs, iteration_values // share)
        assert residency.largest_node_bytes <= residency.limit  # so the limit is reachable here
        assert residency.max_resident_bytes <= residency.limit
    # More room, fewer copies: Belady's order sends home what is read again last.
    _, _, roomy = run_out_of_core(lowered.graph, lowered.inputs, iteration_values)
    _, _, tight = run_out_of_core(lowered.graph, lowered.inputs, iteration_values // 4)
    assert roomy.copied_in < tight.copied_in


def test_out_of_core_profile_times_every_node() -> None:
    lowered = _captured("cnn")
    simulation = simulate(lowered.graph)
    limit = (simulation.peak_bytes - simulation.persistent_bytes) // 3
    in_memory = profile_graph(lowered.graph, lowered.inputs, runs=1, warmup=0)
    out_of_core = profile_graph(lowered.graph, lowered.inputs, runs=1, warmup=0, device_limit=limit)
    assert out_of_core.nodes.keys() == in_memory.nodes.keys()
    assert out_of_core.iteration is None  # the whole iteration would not fit: its time is the nodes' summed
    report = out_of_core.meta["out_of_core"]
    assert report["device_limit_bytes"] == limit and report["copied_to_device_bytes"] > 0


def test_the_profile_runs_in_memory_when_the_step_fits_and_out_of_core_when_not() -> None:
    mib = 2**20
    assert profiling_limit(100 * mib, 50 * mib, None, None).device_limit is None
    assert profiling_limit(100 * mib, 50 * mib, 1000 * mib, None).device_limit is None
    choice = profiling_limit(100 * mib, 50 * mib, 120 * mib, None)
    assert choice.device_limit == int(70 * mib * 0.9) and "out of core" in choice.reason
    assert profiling_limit(100 * mib, 50 * mib, 120 * mib, False).device_limit is None  # asked for in memory
    assert profiling_limit(10 * mib, 5 * mib, 1000 * mib, True).device_limit is not None  # asked for out of core
    with pytest.raises(OutOfCoreError, match="leaving nothing"):
        profiling_limit(100 * mib, 130 * mib, 120 * mib, None)
    with pytest.raises(OutOfCoreError, match="needs a memory limit"):
        profiling_limit(100 * mib, 50 * mib, None, True)


def test_mutwo_opt_plans_out_of_core_under_a_memory_limit(tmp_path: Path) -> None:
    """The tiny MLP's unoptimized step (900 KiB with its 105 KiB of inputs, which profiling in
    memory would clone) under a 1.2 MiB limit with an 800 KiB budget: the profile runs out of core
    by itself, the plan recomputes to meet the budget, and the check passes bitwise."""
    out = tmp_path / "out"
    assert main([str(EXAMPLES / "tiny_mlp.yaml"), "-o", str(out), "-q", "--check", "--memory-limit", "1.2MiB",
                 "--budget", "800KiB", "--device", "cpu"]) == 0  # fmt: skip
    profile = json.loads((out / "profile.json").read_text())
    assert "out of core" in profile["meta"]["memory"]
    assert profile["meta"]["out_of_core"]["max_resident_bytes"] <= profile["meta"]["out_of_core"]["device_limit_bytes"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["equivalent"] is True and summary["recomputed"] and summary["peak_bytes_after"] <= 800 * 2**10


def test_mutwo_opt_profiles_in_memory_when_asked(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert main([str(EXAMPLES / "tiny_mlp.yaml"), "-o", str(out), "-q", "--memory-limit", "1.2MiB", "--device", "cpu",
                 "-p", "profile{out_of_core=false},select,rewrite", "--budget", "1MiB"]) == 0  # fmt: skip
    profile = json.loads((out / "profile.json").read_text())
    assert profile["meta"]["memory"].startswith("in memory (asked for)") and "out_of_core" not in profile["meta"]


@pytest.mark.parametrize("limit,message", [
    ("lots", "--memory-limit: 'lots' is not a memory size"),
    ("0GiB", "--memory-limit: '0GiB' is not a memory size"),
])  # fmt: skip
def test_mutwo_opt_refuses_a_bad_memory_limit(limit: str, message: str, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    out = tmp_path / "out"
    assert main([str(EXAMPLES / "tiny_mlp.yaml"), "-o", str(out), "--memory-limit", limit, "--device", "cpu"]) == \
        EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not out.exists()  # nothing half-written


def test_mutwo_opt_says_when_the_limit_leaves_no_room(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    code = main([str(EXAMPLES / "tiny_mlp.yaml"), "-o", str(out), "-q", "--memory-limit", "100KiB",
                 "--budget", "90KiB", "--device", "cpu"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1, err
    assert "leaving nothing" in err[0] and "raise the budget or the memory limit" in err[0]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_out_of_core_on_the_gpu_holds_the_limit_and_computes_the_same_numbers() -> None:
    """On the GPU the device copies are real: the allocator's peak during the run stays within what
    the process held before (the model, its state and the batch) plus the limit plus the largest
    workspace a node allocated; and the numbers are the whole graph's (deterministic kernels)."""
    with deterministic_algorithms():
        workload = models.cnn(batch_size=64)
        model = workload.model.cuda()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, capturable=True)
        batch = tuple(t.cuda() for t in workload.batch)
        lowered = capture_graph(model, optimizer, batch, workload.loss_fn)
        simulation = simulate(lowered.graph)
        limit = (simulation.peak_bytes - simulation.persistent_bytes) // 3
        expected_state = [t.clone() for t in lowered.inputs]
        torch.manual_seed(1)
        with torch.no_grad():
            expected = to_fx(lowered.graph)(*expected_state)
        expected = [t.cpu() for t in pytree.tree_leaves(expected)]
        del expected_state
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        held = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        torch.manual_seed(1)
        outputs, _, residency = run_out_of_core(lowered.graph, lowered.inputs, limit)
        peak = torch.cuda.max_memory_allocated()
        for got, want in zip(pytree.tree_leaves(outputs), expected, strict=True):
            assert torch.equal(got, want)
        assert residency.max_resident_bytes <= max(limit, residency.largest_node_bytes)
        profile = profile_graph(lowered.graph, lowered.inputs, runs=1, warmup=0, device_limit=limit)
        workspace = max((p.workspace for p in profile.nodes.values()), default=0)
        assert peak <= held + max(limit, residency.largest_node_bytes) + workspace + 2**20


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_memory_limit_caps_the_process_and_planning_reads_it_back() -> None:
    device = torch.device("cuda")  # no index: the current device's cap
    total = torch.cuda.get_device_properties(device).total_memory
    try:
        apply_memory_limit(device, total // 2)
        assert abs(device_capacity(device) - total // 2) <= 1024
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(total // 2 + 2**30, dtype=torch.uint8, device=device)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, torch.cuda.current_device())
        torch.cuda.empty_cache()


def test_running_out_of_memory_while_profiling_in_memory_says_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    lowered = _captured("mlp")
    context = captured.pass_context(lowered, None)

    def out_of_memory(*args: object, **kwargs: object) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.73 GiB")

    monkeypatch.setattr(captured, "profile_graph", out_of_memory)
    with pytest.raises(OutOfCoreError, match=r"profiling in memory ran out of device memory \(in memory \(no memory "
                                             r"limit\); .*profile\{out_of_core=true\}"):  # fmt: skip
        context.services["profiler"](lowered.graph, runs=1, warmup=0)


def test_a_fraction_budget_over_the_memory_limit_plans_for_the_limit(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """tiny_mlp.yaml's budget is 0.9 of its 896 KiB unoptimized peak (806 KiB): over a 760 KiB limit,
    select plans for the limit and says so."""
    out = tmp_path / "out"
    assert main([str(EXAMPLES / "tiny_mlp.yaml"), "-o", str(out), "--memory-limit", "760KiB", "--device", "cpu"]) == 0
    assert "is over the memory limit: planning for the limit, 760.0 KiB" in capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["recomputed"] and summary["peak_bytes_after"] <= 760 * 2**10
