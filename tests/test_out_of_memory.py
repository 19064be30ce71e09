"""An out-of-memory error names the stage and what was held (runtime/measurement/out_of_memory.py).

``torch.OutOfMemoryError`` is injected where each stage allocates — capturing the step, a
planning pass, compiling, calibration, a training step — and the error the caller gets is still
a ``torch.OutOfMemoryError``, with one note: the stage, the budget and memory limit, what the
process held, and the one fix. mutwo-opt says the note in one line and exits 1. On the CPU no
allocator counts what the process holds; :func:`test_the_note_reads_what_the_process_held` gives
the note a CUDA allocator's numbers.

Also here: a budget in bytes under what the step's inputs hold is refused before anything is
profiled, with that floor (issue 38, item 4).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from mutwo.ir.budget import parse_budget
from mutwo.ir.node import Phase
from mutwo.ir.pass_manager import PipelineFailure
from mutwo.runtime.api import optimize
from mutwo.runtime.execution import step as step_module
from mutwo.runtime.execution.failure import FailureGuard
from mutwo.runtime.measurement import out_of_memory
from mutwo.runtime.measurement.out_of_memory import NOTE_PREFIX, MemorySettings, Stage, describe
from mutwo.runtime.planning import auto_capture, captured, peak_calibration
from mutwo.tools.mutwo_opt import EXIT_FAILURE, main
from tests import models
from tests.test_failed_step import OPTIMIZER_IN_BACKWARD, _computed, _first_parameter_update, _inject_after, _step

#: What torch says when an allocation fails (its first sentences), with the size the note repeats.
TORCH_MESSAGE = "CUDA out of memory. Tried to allocate 3.73 GiB. GPU 0 has a total capacity of 79.19 GiB"
TINY_MLP = Path(__file__).resolve().parents[1] / "examples" / "tiny_mlp.yaml"


def _out_of_memory(*args: Any, **kwargs: Any) -> None:
    raise torch.OutOfMemoryError(TORCH_MESSAGE)


def _mlp() -> tuple[models.Workload, torch.optim.Optimizer]:
    workload = models.mlp(batch_size=64)
    return workload, torch.optim.Adam(workload.model.parameters(), lr=1e-3)


def _note(error: BaseException) -> str:
    """The one note the error got, checked to be one line of this module's."""
    notes = [note for note in getattr(error, "__notes__", []) if note.startswith(NOTE_PREFIX)]
    assert len(notes) == 1 and "\n" not in notes[0], getattr(error, "__notes__", None)
    return notes[0]


def _optimize_out_of_memory(**options: Any) -> str:
    """``optimize`` on the test MLP: it raises ``torch.OutOfMemoryError`` itself; its note."""
    workload, optimizer = _mlp()
    with pytest.raises(torch.OutOfMemoryError) as raised:
        optimize(workload.model, optimizer, workload.batch, workload.loss_fn, **options)
    return _note(raised.value)


def test_running_out_while_capturing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(auto_capture, "capture_graph", _out_of_memory)
    note = _optimize_out_of_memory(budget="16MiB")
    assert note.startswith(f"{NOTE_PREFIX} while capturing the step")
    assert "(asking for 3.73 GiB more), at budget 16.0 MiB and no memory limit" in note
    assert note.endswith(": use a smaller batch")


def test_running_out_in_a_planning_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """The profile out of core (a node's workspace can still be more than the limit leaves): the
    pass manager would report a failure of the pass; the caller gets the error itself."""
    monkeypatch.setattr(captured, "profile_graph", _out_of_memory)
    note = _optimize_out_of_memory(budget=0.5, memory_limit="64MiB", passes="profile{out_of_core=true},select,rewrite")
    assert note.startswith(f"{NOTE_PREFIX} in the planning pass 'profile' (asking for 3.73 GiB more)")
    assert "at budget 0.5 of the unoptimized peak and memory limit 64.0 MiB" in note
    assert note.endswith(": raise the memory limit (memory_limit=, --memory-limit)")


def test_running_out_while_compiling(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(step_module, "compile_step", _out_of_memory)
    note = _optimize_out_of_memory(budget="min", passes="profile,select,rewrite")
    assert note.startswith(f"{NOTE_PREFIX} while compiling the step") and "at budget min" in note


def test_running_out_in_every_round_of_calibration(monkeypatch: pytest.MonkeyPatch) -> None:
    """Calibration measures each plan, and a round that runs out counts as one over the budget;
    when every round did, its own error is a ``torch.OutOfMemoryError`` too, noted."""
    monkeypatch.setattr(peak_calibration, "measured_peak", _out_of_memory)
    workload, optimizer = _mlp()
    with pytest.raises(torch.OutOfMemoryError) as raised:
        optimize(workload.model, optimizer, workload.batch, workload.loss_fn, budget=0.9,
                 passes="profile,select,rewrite", calibrate_peak=1)  # fmt: skip
    assert isinstance(raised.value, peak_calibration.CalibrationOutOfMemory)
    note = _note(raised.value)
    assert note.startswith(f"{NOTE_PREFIX} while calibrating the plan's peak")
    assert note.endswith(": lower the budget (budget=, --budget)")


@pytest.mark.parametrize("phase", [Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER])
def test_running_out_in_a_training_step_names_its_phase(phase: Phase) -> None:
    """The eager backend's markers tell how far the step ran; the exception keeps its type."""
    workload, optimizer = _mlp()
    step = optimize(workload.model, optimizer, workload.batch, workload.loss_fn, passes="stats", backend="eager")
    graph_step, _ = step.prepare(workload.batch)
    _inject_after(graph_step, _computed(graph_step.graph, phase)[-1])
    with pytest.raises(torch.OutOfMemoryError) as raised:
        step(workload.batch)
    assert type(raised.value) is torch.OutOfMemoryError
    words = {Phase.FORWARD: "in the forward", Phase.BACKWARD: "in the backward",
             Phase.OPTIMIZER: "in the optimizer step"}[phase]  # fmt: skip
    note = _note(raised.value)
    assert note.startswith(f"{NOTE_PREFIX} in a training step, {words},"), note
    assert note.endswith(": give a budget under the device's memory (budget=, --budget)")


def test_running_out_after_updates_began_inside_the_backward() -> None:
    """Optimizer-in-backward moves the updates into the backward; the note says so."""
    workload, optimizer, step = _step(passes=OPTIMIZER_IN_BACKWARD)
    graph_step, _ = step.prepare(workload.batch)
    _inject_after(graph_step, _first_parameter_update(graph_step.graph))
    with pytest.raises(torch.OutOfMemoryError) as raised:
        step(workload.batch)
    assert "in a training step, in the backward, once optimizer-in-backward's updates had begun," in _note(raised.value)


def test_a_compiled_step_does_not_tell_its_phase() -> None:
    workload, optimizer = _mlp()
    step = optimize(workload.model, optimizer, workload.batch, workload.loss_fn, passes="stats", backend="eager")
    guard = FailureGuard(step.last.graph, "inductor")  # not marked: it cannot tell how far it ran
    assert guard.where_failed() == "during the step"


def test_the_note_reads_what_the_process_held(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 15_000 * 2**20)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 16_000 * 2**20)
    monkeypatch.setattr(out_of_memory, "process_cap", lambda device: 16 * 2**30)
    settings = MemorySettings(torch.device("cuda", 0), parse_budget("14GiB"), 16 * 2**30)
    note = describe(torch.OutOfMemoryError(TORCH_MESSAGE), Stage("in a training step, in the backward", True),
                    settings)  # fmt: skip
    assert note == (f"{NOTE_PREFIX} in a training step, in the backward (asking for 3.73 GiB more), at budget "
                    "14,336.0 MiB and memory limit 16,384.0 MiB; the process held 15,000.0 MiB allocated and "
                    "16,000.0 MiB reserved on cuda:0, capped at 16,384.0 MiB: lower the budget (budget=, --budget)")


def test_mutwo_opt_says_a_pass_ran_out_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    monkeypatch.setattr(captured, "profile_graph", _out_of_memory)
    out = tmp_path / "out"
    code = main(["-q", "--device", "cpu", "--batch-size", "64", "--budget", "0.9", "--memory-limit", "64MiB",
                 "-p", "profile{out_of_core=true},select,rewrite", "-o", str(out), str(TINY_MLP)])  # fmt: skip
    err = capsys.readouterr().err
    assert code == EXIT_FAILURE and "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("mutwo-opt: failed: out of device memory in the planning pass "
                                                   "'profile' (asking for 3.73 GiB more)"), err  # fmt: skip
    assert lines[0].endswith("raise the memory limit (memory_limit=, --memory-limit)")
    summary = json.loads((out / "summary.json").read_text())
    assert lines[0].endswith(summary["error"])


def test_mutwo_opt_says_compiling_ran_out_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    from mutwo.tools import mutwo_opt

    monkeypatch.setattr(mutwo_opt, "compile_graph", _out_of_memory)
    code = main(["-q", "--device", "cpu", "--batch-size", "64", "-p", "stats", "-o", str(tmp_path / "out"),
                 str(TINY_MLP)])  # fmt: skip
    err = capsys.readouterr().err
    assert code == EXIT_FAILURE and "Traceback" not in err
    assert err.splitlines() == ["mutwo-opt: failed: out of device memory while compiling the step (asking for "
                                "3.73 GiB more), at budget 0.9 of the unoptimized peak and no memory limit; "
                                "the step runs on cpu, whose allocator keeps no count of what the process holds: use a "
                                "smaller batch"]  # fmt: skip


def test_a_budget_under_the_inputs_is_refused_before_profiling(monkeypatch: pytest.MonkeyPatch) -> None:
    """The parameters, Adam's state and the batch stay on the device through the step: a budget under
    them is out of reach whatever the plan, said before the profile runs the step."""
    monkeypatch.setattr(captured, "profile_graph", lambda *a, **k: pytest.fail("profiled an unreachable budget"))
    workload, optimizer = _mlp()
    with pytest.raises(PipelineFailure) as raised:
        optimize(workload.model, optimizer, workload.batch, workload.loss_fn, budget="1KiB")
    message = str(raised.value)
    assert "\n" not in message and message.startswith("pass 'profile' failed as the first pass: budget 1024B (1.0 "
                                                       "KiB) is unreachable: the parameters, buffers, optimizer state "
                                                       "and batch of the step hold ")  # fmt: skip
    assert message.endswith("(refused before profiling); give a budget above "
                            f"{message.split(' hold ')[1].split(' on cpu')[0]}, or 'min' for the lowest peak "
                            "recomputation reaches")  # fmt: skip
    assert not optimizer.state, "the optimizer is left as it was given"


def test_mutwo_opt_refuses_a_budget_under_the_inputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    code = main(["-q", "--device", "cpu", "--batch-size", "64", "--budget", "4KiB", "-o", str(out), str(TINY_MLP)])
    err = capsys.readouterr().err
    assert code == EXIT_FAILURE and len(err.splitlines()) == 1, err
    assert "budget 4096B (4.0 KiB) is unreachable" in err and "(refused before profiling)" in err
    assert not (out / "profile.json").exists()


def test_an_out_of_memory_error_wrapped_by_inductor_is_found() -> None:
    """torch wraps errors raised inside Inductor (InductorError, with ``inner_exception``): an
    out-of-memory error while compiling must stay one, to get its note, not become a CompileError."""
    from mutwo.runtime.execution.backends import _out_of_memory_within

    class Wrapped(RuntimeError):
        def __init__(self, inner: BaseException) -> None:
            super().__init__("wrapped")
            self.inner_exception = inner

    oom = torch.OutOfMemoryError("CUDA out of memory")
    assert _out_of_memory_within(Wrapped(oom)) is oom
    try:
        try:
            raise oom
        except torch.OutOfMemoryError:
            raise ValueError("while autotuning") from None
    except ValueError as chained:
        assert _out_of_memory_within(chained) is oom  # its context
    assert _out_of_memory_within(Wrapped(ValueError("no"))) is None
