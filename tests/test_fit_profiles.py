"""``--fit``'s profiles: the batch it returns (and every batch it measures) is planned from a profile
measured at that batch, with tensors of that size, in memory or out of core; the search's other
tries scale the nearest profile; each batch size is profiled at most once.

The profiler is wrapped (``Spy``) to see which batch each profile ran on (the length of the
targets among its inputs) and, in some tests, to make per-op costs grow other than linearly with
the batch, so that a linearly scaled profile and a measured one disagree."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import mutwo
from mutwo.ir.budget import readable_bytes
from mutwo.ir.memory import simulate
from mutwo.runtime.measurement.out_of_core import OutOfCoreError
from mutwo.runtime.measurement.profiler import NodeProfile, Profile, profile_graph
from mutwo.runtime.planning import fit_planner
from mutwo.runtime.planning.captured import CapturedGraph, capture_graph
from mutwo.runtime.planning.fit import FitError, FitPoint, FitResult, Measure, Measured
from tests import models

LIMIT = 256 * 2**10
BUDGET = int(LIMIT * 0.9)  # the default margin


def _batch_of(inputs: list[torch.Tensor]) -> int:
    """The batch size a profile ran at: the MLP's targets are its only 1-D int64 input."""
    return next(t.shape[0] for t in inputs if t.dtype == torch.int64 and t.dim() == 1)


class Spy:
    """Wraps the fit's profiler: records the batch and the out-of-core limit of each call, and
    passes the real profile through ``change(profile, batch)``."""

    def __init__(self, change: Callable[[Profile, int], Profile | None] = lambda profile, batch: None) -> None:
        self.change = change
        self.calls: list[tuple[int, int | None]] = []

    def __call__(self, graph: Any, inputs: list[torch.Tensor], **options: Any) -> Profile:
        batch = _batch_of(inputs)
        self.calls.append((batch, options.get("device_limit")))
        profile = profile_graph(graph, inputs, **options)
        return self.change(profile, batch) or profile

    @property
    def batches(self) -> list[int]:
        return [batch for batch, _ in self.calls]


def _fit(monkeypatch: pytest.MonkeyPatch, spy: Spy, start: int = 64, measure: Measure | None = None) -> FitResult:
    monkeypatch.setattr(fit_planner, "profile_graph", spy)
    workload = models.mlp()
    optimizer = models.OPTIMIZERS["adam"](workload.model.parameters())

    def make_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 16), torch.randint(0, 5, (n,))

    return mutwo.fit_batch(workload.model, optimizer, make_batch, workload.loss_fn, LIMIT, start=start,
                           measure=measure)  # fmt: skip


def _constant_times(profile: Profile, batch: int) -> None:
    """Every op takes 1 ms whatever the batch: the launch-bound regime in which scaling a small
    batch's times linearly is most wrong."""
    for node in profile.nodes.values():
        node.seconds, node.replay_seconds = 1e-3, None


def _scaled_and_own(result: FitResult, batch: int) -> tuple[FitPoint, FitPoint]:
    """The search's plan of ``batch`` (from a scaled profile) and its plan from its own profile."""
    scaled = next(p for p in result.tried if p.batch_size == batch and p.profiled_at != batch)
    own = next(p for p in result.tried if p.batch_size == batch and p.profiled_at == batch)
    return scaled, own


def test_the_batch_found_is_planned_from_a_profile_measured_at_its_size(monkeypatch: pytest.MonkeyPatch) -> None:
    spy = Spy()
    result = _fit(monkeypatch, spy)
    best = result.best
    assert best is not None and best.fits and best.batch_size > 64
    assert best.profiled_at == best.batch_size and best.profile == f"measured at batch {best.batch_size}, out of core"
    # The profiler ran on tensors of that size, out of core (its unoptimized step is over the
    # limit: that is why its plan recomputes), after the starting batch's, in memory.
    assert spy.batches == [64, best.batch_size]
    assert spy.calls[0][1] is None and spy.calls[1][1] is not None
    assert [(p.batch_size, p.memory) for p in result.profiles] == [(64, "in memory"), (best.batch_size, "out of core")]
    assert result.profiles[1].reason.startswith("out of core (the unoptimized step needs ")
    assert all(p.nodes > 0 and p.iteration_seconds > 0 for p in result.profiles)
    # The search's other tries were planned from the starting batch's profile, scaled, and say so.
    others = [p for p in result.tried if p.batch_size not in (64, best.batch_size)]
    assert others and all(p.profiled_at == 64 and ", scaled ×" in p.profile for p in others)
    assert best.predicted_seconds is not None and best.predicted_seconds > 0
    assert "profiled at its own size" in result.assumptions


def test_the_time_reported_is_the_measured_profiles_not_a_linear_scaling(monkeypatch: pytest.MonkeyPatch) -> None:
    """With every op as fast at any batch, the search's scaled profile predicts the batch found
    its size / 64 times slower than the start; planned again from its own profile, it is not, and
    that is the prediction the fit returns."""
    result = _fit(monkeypatch, Spy(_constant_times))
    best = result.best
    assert best is not None and best.batch_size >= 128
    scaled, own = _scaled_and_own(result, best.batch_size)
    assert best == own and scaled.fits
    assert scaled.predicted_seconds is not None and own.predicted_seconds is not None
    assert scaled.predicted_seconds == pytest.approx(own.predicted_seconds * best.batch_size / 64, rel=0.05)
    start = next(p for p in result.tried if p.batch_size == 64)
    assert own.predicted_seconds == pytest.approx(start.predicted_seconds, rel=0.05), "as fast as the start's ops"


def test_a_batch_that_no_longer_fits_at_its_own_profile_steps_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each op's workspace grows with the square of the batch: scaled linearly from batch 64 it
    looks small, measured at the batch the search finds it does not fit, and the fit steps back
    below that batch at the same budget, to one that fits from its own profile."""

    def workspace(profile: Profile, batch: int) -> None:
        for node in profile.nodes.values():
            node.workspace = batch * batch  # bytes: 4 KiB at batch 64, 81 KiB at 288

    spy = Spy(workspace)
    result = _fit(monkeypatch, spy)
    best = result.best
    assert best is not None and best.profiled_at == best.batch_size and best.predicted_peak <= BUDGET
    first = result.profiles[1].batch_size  # the first batch the search found
    scaled, own = _scaled_and_own(result, first)
    assert scaled.fits and not own.fits and own.budget == scaled.budget == BUDGET
    assert own.predicted_peak > BUDGET or own.needs > BUDGET
    assert best.batch_size < first
    # The workspace measured at the batch returned is in its predicted peak.
    assert best.predicted_peak >= best.batch_size**2
    assert len(spy.batches) == len(set(spy.batches)), "each batch size is profiled once"
    assert spy.batches == [p.batch_size for p in result.profiles]


def test_a_batch_profiled_before_is_not_profiled_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Started from the batch it would find, the fit profiles that batch once, for the search and
    for the answer."""
    first = _fit(monkeypatch, Spy()).best
    assert first is not None
    spy = Spy()
    again = _fit(monkeypatch, spy, start=first.batch_size).best
    assert again is not None and again.batch_size == first.batch_size and again.profiled_at == first.batch_size
    assert spy.batches == [first.batch_size]


def test_every_measured_batch_is_profiled_at_its_size_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run that fails steps back (a lower budget, a smaller batch): every batch measured is planned
    from its own profile, and no batch size is profiled twice."""
    runs: list[int] = []

    def measure(batch: int, lowered: CapturedGraph, limit: int) -> Measured:
        runs.append(batch)
        if len(runs) == 1:
            return Measured(None, None, "out of memory under the cap")
        return Measured(simulate(lowered.graph).peak_bytes, 0.01)

    spy = Spy()
    result = _fit(monkeypatch, spy, measure=measure)
    assert len(result.attempts) >= 2 and not result.attempts[0].fits and result.attempts[-1].fits
    for attempt in result.attempts:
        assert attempt.profile.startswith(f"measured at batch {attempt.batch_size}, ")
        assert attempt.batch_size in spy.batches
    assert len(spy.batches) == len(set(spy.batches))
    assert result.best is not None and result.best.profiled_at == result.best.batch_size == runs[-1]


def test_a_batch_that_cannot_be_profiled_within_the_limit_does_not_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    """An op whose own inputs and outputs do not fit the limit cannot run in the step either."""

    def refuse_large(profile: Profile, batch: int) -> None:
        if batch > 200:
            raise OutOfCoreError("out of core: node addmm (aten.addmm.default) ran out of device memory")

    spy = Spy(refuse_large)
    result = _fit(monkeypatch, spy)
    best = result.best
    assert best is not None and best.batch_size <= 200 and best.profiled_at == best.batch_size
    refused = [p for p in result.tried if "cannot be profiled within the limit (out of core: node addmm" in p.note]
    assert refused and not any(p.fits for p in refused) and refused[0].profile.startswith("not measured at batch")
    # The search cannot learn from a profile that failed: it bisects down to the largest batch that
    # fit from its own profile (here the start's) rather than stepping down one batch at a time.
    assert len(spy.calls) <= 4, spy.batches


def test_a_starting_batch_that_cannot_be_profiled_fails_in_one_sentence(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(profile: Profile, batch: int) -> None:
        raise OutOfCoreError("out of core: node addmm (aten.addmm.default) ran out of device memory; raise the limit")

    with pytest.raises(FitError) as error:
        _fit(monkeypatch, Spy(refuse))
    message = str(error.value)
    assert message.startswith(f"the starting batch size 64 cannot be profiled within {readable_bytes(LIMIT)} (out "
                              "of core: node addmm")  # fmt: skip
    assert message.endswith("); start the search from a smaller batch size") and "\n" not in message


def test_profiling_that_runs_out_of_device_memory_fails_in_one_sentence(monkeypatch: pytest.MonkeyPatch) -> None:
    def out_of_memory(profile: Profile, batch: int) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.73 GiB")

    with pytest.raises(FitError) as error:
        _fit(monkeypatch, Spy(out_of_memory))
    message = str(error.value)
    assert message.startswith("profiling batch 64 ran out of device memory, in memory (the unoptimized step needs ")
    assert message.endswith("the device has less memory free than the limit: give a limit it has free")
    assert "\n" not in message


def test_when_not_even_batch_one_fits_at_its_own_profile_the_fit_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the starting batch (512, too large to fit) measures no workspace; every other batch
    measures more than the limit. The search scales the start's profile down, finds each batch it
    plans from its own profile too large, and steps back to batch 1, which does not fit either."""

    def workspace(profile: Profile, batch: int) -> None:
        for node in profile.nodes.values():
            node.workspace = 0 if batch == 512 else 4 * LIMIT

    with pytest.raises(FitError) as error:
        _fit(monkeypatch, Spy(workspace), start=512)
    message = str(error.value)
    assert message.startswith("not even batch size 1 fits: ")
    assert f"the limit is {readable_bytes(LIMIT)} ({readable_bytes(BUDGET)} to plan for after the margin), planned " \
           "from its own profile; give it more memory or train a smaller model; planning batch 1: " in message
    assert "\n" not in message


def test_a_profile_measured_again_for_another_capture_keeps_its_numbers() -> None:
    """The profile a batch was measured with names the nodes of one capture; planned on another
    capture of the same size (or scaled to another size) it keeps each node's numbers, by position."""
    workload = models.mlp()
    optimizer = models.OPTIMIZERS["adam"](workload.model.parameters())
    graphs = [capture_graph(workload.model, optimizer, (torch.randn(n, 16), torch.randint(0, 5, (n,))),
                            workload.loss_fn).graph for n in (8, 8, 16)]  # fmt: skip
    nodes = {n.id: NodeProfile(float(i), workspace=10 * i, replay_seconds=i + 1.0)
             for i, n in enumerate(graphs[0].nodes)}  # fmt: skip
    profile = Profile("cpu", "x", nodes, 1)
    same = fit_planner.scaled_profile(profile, graphs[0], graphs[1], 1.0)
    double = fit_planner.scaled_profile(profile, graphs[0], graphs[2], 2.0)
    for index, (a, b) in enumerate(zip(graphs[1].nodes, graphs[2].nodes, strict=True)):
        assert same.nodes[a.id].seconds == index and same.nodes[a.id].workspace == 10 * index
        assert double.nodes[b.id].seconds == 2 * index and double.nodes[b.id].replay_seconds == 2 * index + 2

