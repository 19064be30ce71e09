"""The budget is what the process holds (skipped without a GPU): measured as a user's loop measures
it, ``torch.cuda.max_memory_reserved()`` over steady iterations after warm-up stays within the
budget that ``mutwo.optimize`` was given, for the eager executor and under CUDA graphs, and a
memory limit at that budget trains without running out of memory.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch

import mutwo
from mutwo.runtime.execution.cuda_graphs import graphable_optimizer
from mutwo.runtime.measurement.device_memory import apply_memory_limit, lift_memory_limit
from mutwo.runtime.measurement.expandable_segments import (
    ALLOCATOR_VARIABLES,
    apply_settings,
    expandable_segments_on,
    use_expandable_segments,
)
from mutwo.runtime.planning.peak_calibration import failure_peaks
from tests import models

pytestmark = pytest.mark.cuda

DEVICE = torch.device("cuda")


def deep_mlp() -> models.Workload:
    """Eight layers whose activations are 128 MiB each: plans of fine grain (one activation is 5%
    of the peak), so that a budget can be met by a plan, and the allocator's blocks, not the
    plan's granularity, decide what is held over it (a small CNN's plans could not go under the
    34% its allocator held over its allocated peak)."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(8):
        layers += [torch.nn.Linear(2048, 2048), torch.nn.GELU()]
    net = torch.nn.Sequential(*layers, torch.nn.Linear(2048, 10)).to(DEVICE)
    batch = (torch.randn(16384, 2048, device=DEVICE), torch.randint(0, 10, (16384,), device=DEVICE))
    return models.Workload(models.Classifier(net), batch, models.cross_entropy)


@pytest.fixture
def clean_device() -> Iterator[int]:
    """What the process holds before the test makes anything (other tests' leftovers given back),
    and the cap lifted after it."""
    gc.collect()
    torch.cuda.empty_cache()
    yield torch.cuda.memory_reserved(DEVICE)
    lift_memory_limit(DEVICE)
    gc.collect()
    torch.cuda.empty_cache()


def _held_over_steady_steps(step: mutwo.MutwoStep, batch: object, base: int) -> tuple[int, int]:
    """Max reserved and max allocated over 5 steps after 3 warm-up steps, as a plain loop measures."""
    for _ in range(3):
        step(batch)
    torch.cuda.synchronize(DEVICE)
    torch.cuda.reset_peak_memory_stats(DEVICE)
    for _ in range(5):
        step(batch)
    torch.cuda.synchronize(DEVICE)
    return torch.cuda.max_memory_reserved(DEVICE) - base, torch.cuda.max_memory_allocated(DEVICE) - base


@pytest.mark.parametrize("backend", ["eager", "inductor-cudagraphs"])
def test_cuda_the_process_holds_at_most_the_budget(backend: str, clean_device: int) -> None:
    work = deep_mlp()
    batch = work.batch
    optimizer = torch.optim.Adam(work.model.parameters(), lr=1e-3)
    if backend.endswith("cudagraphs"):
        graphable_optimizer(optimizer, DEVICE)
    step = mutwo.optimize(work.model, optimizer, batch, work.loss_fn, budget=0.6, backend=backend)
    optimized = step.last
    assert optimized is not None and optimized.calibration is not None, "calibrated by default on CUDA"
    target = optimized.calibration.target_bytes
    held, allocated = _held_over_steady_steps(step, batch, clean_device)
    assert held <= target, (f"held {held / 2**20:.1f} MiB (allocated {allocated / 2**20:.1f} MiB) over a budget of "
                            f"{target / 2**20:.1f} MiB; {optimized.calibration.summary()}")  # fmt: skip


def test_cuda_a_memory_limit_at_the_budget_trains_without_running_out(clean_device: int) -> None:
    work = deep_mlp()
    batch = work.batch
    optimizer = torch.optim.Adam(work.model.parameters(), lr=1e-3)
    graphable_optimizer(optimizer, DEVICE)
    planned = mutwo.optimize(work.model, optimizer, batch, work.loss_fn, budget=0.6, passes="profile,select",
                             backend="eager")  # its plan's budget only: nothing compiled
    budget = planned.last.plan.budget_bytes  # the same fraction in bytes, for the limit
    del planned
    step = mutwo.optimize(work.model, optimizer, batch, work.loss_fn, budget=budget, backend="inductor-cudagraphs",
                          memory_limit=budget + clean_device)  # fmt: skip
    held, _ = _held_over_steady_steps(step, batch, clean_device)
    assert held <= budget


@pytest.mark.parametrize("keep_grads", [False, True])
def test_cuda_a_recording_at_the_second_call_holds_what_one_at_the_first_holds(keep_grads: bool,
                                                                               clean_device: int) -> None:  # fmt: skip
    """A training loop's step runs its first call unrecorded and records at its second
    (``CudaGraphRunner.defer_recording``): the first call's gradients are let go before that
    recording, so the process holds, at its peak and after, what a step recorded at its first call
    (after a warm-up) holds."""
    mib = 2**20
    held: dict[bool, tuple[int, int]] = {}
    for deferred in (True, False):
        work = deep_mlp()
        optimizer = torch.optim.Adam(work.model.parameters(), lr=1e-3)
        step = mutwo.optimize(work.model, optimizer, work.batch, work.loss_fn, backend="cudagraphs",
                              keep_grads=keep_grads)  # fmt: skip
        assert step.last is not None and step.last.step is not None and step.last.step.compiled is not None
        runner = step.last.step.compiled.run
        assert runner.defer_recording and not runner.ran, "a training loop's step, not run by planning"
        runner.defer_recording = deferred
        torch.cuda.synchronize(DEVICE)
        torch.cuda.reset_peak_memory_stats(DEVICE)
        for call in range(3):
            step(work.batch)
            assert runner.recordings == (call >= 1 if deferred else 1)
        torch.cuda.synchronize(DEVICE)
        held[deferred] = (torch.cuda.max_memory_reserved(DEVICE) - clean_device,
                          torch.cuda.memory_reserved(DEVICE) - clean_device)  # fmt: skip
        del step, runner, work, optimizer
        gc.collect()
        torch.cuda.empty_cache()
    (peak, now), (peak_first, now_first) = held[True], held[False]
    assert now <= now_first + 2 * mib and peak <= peak_first + 2 * mib, (
        f"recorded at the second call: held {now / mib:.0f} MiB, at most {peak / mib:.0f} MiB; recorded at the "
        f"first: {now_first / mib:.0f} MiB, at most {peak_first / mib:.0f} MiB")  # fmt: skip


def test_cuda_failure_peaks_read_what_the_process_held_when_it_ran_out(clean_device: int) -> None:
    """Calibration steps a plan that ran out of memory down by what the process held over its
    allocation by the failure: read from the allocator's peaks after ``torch.OutOfMemoryError``,
    they are what was allocated and held up to it, at most the cap."""
    mib = 2**20
    cap = clean_device + 256 * mib
    apply_memory_limit(DEVICE, cap)
    torch.cuda.reset_peak_memory_stats(DEVICE)
    kept = [torch.empty(64 * mib, dtype=torch.uint8, device=DEVICE) for _ in range(3)]
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(512 * mib, dtype=torch.uint8, device=DEVICE)
    held, allocated = failure_peaks(kept)
    assert held is not None and allocated is not None
    assert 3 * 64 * mib <= allocated <= held <= cap


def test_cuda_a_memory_limit_caps_expandable_segments(clean_device: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """mutwo turns on expandable segments (:mod:`mutwo.runtime.measurement.expandable_segments`);
    a memory limit must still refuse what would take the process past it, as a smaller card would."""
    for name in ALLOCATOR_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    use_expandable_segments(DEVICE)
    assert expandable_segments_on()
    mib = 2**20
    cap = clean_device + 256 * mib
    apply_memory_limit(DEVICE, cap)
    kept = [torch.empty(64 * mib, dtype=torch.uint8, device=DEVICE) for _ in range(3)]
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(512 * mib, dtype=torch.uint8, device=DEVICE)
    assert torch.cuda.memory_reserved(DEVICE) <= cap
    assert any(segment.get("is_expandable") for segment in torch.cuda.memory_snapshot()), "mapped expandably"
    del kept
    apply_settings("expandable_segments:False")  # process-wide: the tests after this one find the allocator as before
    apply_settings("")
