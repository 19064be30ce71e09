"""``backend="auto"``, the default (runtime/execution/auto_backend.py, runtime/planning/auto_capture.py).

The choice is a pure function of a few facts about the step, tested here with facts made up for a
GPU; the capture that gathers them on CUDA is tested with a stand-in capture. On the CPU, auto is
``eager``, said in one line, through ``mutwo.optimize`` and mutwo-opt alike.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from mutwo.runtime.api import optimize
from mutwo.runtime.capture.optim import UnsupportedOptimizerError
from mutwo.runtime.execution.auto_backend import BACKEND_CHOICES, StepFacts, choose_backend, early_choice
from mutwo.runtime.planning import auto_capture
from mutwo.tools.config import Config, ConfigError, apply_overrides, load_config
from mutwo.tools.mutwo_opt import EXIT_OK, main
from tests import models

TINY_MLP = Path(__file__).resolve().parents[1] / "examples" / "tiny_mlp.yaml"
UNRECORDABLE = ("CUDA graphs cannot record this step: node item (aten._local_scalar_dense) reads a tensor's value on "
                "the host; use --backend eager or inductor")  # fmt: skip
UNDRAWABLE = ("the inductor backend cannot draw the random numbers of %12 (aten.normal_.default) as eager does: it "
              "fills a tensor the step computes, which Inductor may lay out otherwise; use --backend eager or "
              "cudagraphs, which run aten's kernels on eager's tensors")  # fmt: skip


@pytest.mark.parametrize(("facts", "sentence"), [
    (StepFacts("cpu"), "backend auto: eager (CPU)"),
    (StepFacts("cuda"), "backend auto: inductor-cudagraphs (CUDA, the step can be recorded)"),
    (StepFacts("cuda", unrecordable=UNRECORDABLE),
     "backend auto: inductor (CUDA; CUDA graphs cannot record this step: node item (aten._local_scalar_dense) reads "
     "a tensor's value on the host)"),
    (StepFacts("cuda", undrawable=UNDRAWABLE),
     "backend auto: cudagraphs (CUDA, the step can be recorded; the inductor backend cannot draw the random numbers "
     "of %12 (aten.normal_.default) as eager does: it fills a tensor the step computes, which Inductor may lay out "
     "otherwise)"),
    (StepFacts("cuda", unrecordable=UNRECORDABLE, undrawable=UNDRAWABLE), "backend auto: eager (CUDA; CUDA graphs "
     "cannot record this step: node item (aten._local_scalar_dense) reads a tensor's value on the host; the inductor "
     "backend cannot draw the random numbers of %12 (aten.normal_.default) as eager does: it fills a tensor the step "
     "computes, which Inductor may lay out otherwise)"),
])  # fmt: skip
def test_the_choice_is_the_fastest_backend_the_step_allows(facts: StepFacts, sentence: str) -> None:
    assert choose_backend(facts).sentence() == sentence


def test_the_device_decides_before_the_capture() -> None:
    choice = early_choice(torch.device("cpu"))
    assert choice is not None and choice.backend == "eager"
    assert early_choice(torch.device("cuda", 0)) is None  # the captured step decides, data parallel or not


class _Captures:
    """A stand-in for ``capture_graph`` on a GPU: records how each capture was asked for (``graphed``:
    for a CUDA graph) and refuses a capture for a CUDA graph when ``refused`` says so."""

    def __init__(self, refused: str | None = None) -> None:
        self.refused = refused
        self.graphed: list[bool] = []

    def __call__(self, *args: Any) -> SimpleNamespace:
        graphed = args[-1]
        self.graphed.append(graphed)
        if graphed and self.refused is not None:
            raise UnsupportedOptimizerError(self.refused)
        return SimpleNamespace(graph=None, inputs=[], binding=SimpleNamespace(graphed=graphed))


@pytest.mark.parametrize(("refused", "unrecordable", "graphed", "backend"), [
    (None, None, [True], "inductor-cudagraphs"),
    (None, UNRECORDABLE, [True, False], "inductor"),  # captured again as inductor captures
    ("torch.optim.Adagrad keeps its step on the cpu and has no capturable option, so a CUDA graph would freeze "
     "what it computes from it at recording; train it with the eager or inductor backend", None, [True, False],
     "inductor"),
])  # fmt: skip
def test_auto_on_cuda_captures_for_a_recording_then_as_its_choice_runs(
        refused: str | None, unrecordable: str | None, graphed: list[bool], backend: str,
        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    captures = _Captures(refused)
    monkeypatch.setattr(auto_capture, "capture_graph", captures)

    def facts(graph: Any, inputs: Any, known: str | None) -> StepFacts:
        return StepFacts("cuda", known or unrecordable)

    monkeypatch.setattr(auto_capture, "step_facts", facts)
    optimizer = torch.optim.Adam([torch.nn.Parameter(torch.ones(1))])
    lowered, choice = auto_capture.capture_for_backend("auto", None, optimizer, None, None)
    assert choice is not None and choice.backend == backend
    assert captures.graphed == graphed and lowered.binding.graphed == graphed[-1]
    if refused is not None:
        assert "Adagrad keeps its step on the cpu" in choice.why and "train it with" not in choice.why


GLOO = ("the inductor-cudagraphs backend cannot record this data-parallel step: its process group runs on gloo, "
        "whose collectives run on the host, and a CUDA graph records NCCL's only; use backend='inductor', the "
        "fastest backend that runs it")  # fmt: skip


@pytest.mark.parametrize(("refusal", "graphed", "backend"), [
    (None, [True], "inductor-cudagraphs"),  # NCCL: recorded with its collectives
    (GLOO, [False], "inductor"),  # captured once, as inductor captures
])  # fmt: skip
def test_auto_on_cuda_chooses_for_a_data_parallel_step_from_its_process_group(
        refusal: str | None, graphed: list[bool], backend: str, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    captures = _Captures()
    monkeypatch.setattr(auto_capture, "capture_graph", captures)
    asked: list[str] = []

    def refused(name: str, dp: Any) -> str | None:
        asked.append(name)
        return refusal

    monkeypatch.setattr(auto_capture, "backend_refusal", refused)
    monkeypatch.setattr(auto_capture, "step_facts", lambda graph, inputs, known: StepFacts("cuda", known))
    agreed: list[str] = []  # every rank's choice is compared before any captures again
    monkeypatch.setattr(auto_capture, "require_same_choice", lambda choice, dp, what: agreed.append(choice))
    optimizer = torch.optim.Adam([torch.nn.Parameter(torch.ones(1))])
    lowered, choice = auto_capture.capture_for_backend("auto", None, optimizer, None, None,
                                                       data_parallel=SimpleNamespace())  # fmt: skip
    assert asked == ["inductor-cudagraphs"] and choice is not None and choice.backend == backend
    assert agreed == [backend]
    assert captures.graphed == graphed and lowered.binding.graphed == graphed[-1]
    if refusal is not None:
        assert choice.sentence() == ("backend auto: inductor (CUDA; the inductor-cudagraphs backend cannot record "
                                     "this data-parallel step: its process group runs on gloo, whose collectives "
                                     "run on the host, and a CUDA graph records NCCL's only)")  # fmt: skip


def test_a_named_backend_is_captured_as_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    captures = _Captures()
    monkeypatch.setattr(auto_capture, "capture_graph", captures)
    for backend in ("eager", "inductor", "cudagraphs", "inductor-cudagraphs"):
        assert auto_capture.capture_for_backend(backend, *([None] * 4))[1] is None
    assert captures.graphed == [False, False, True, True]


def test_optimize_chooses_eager_on_the_cpu_and_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    workload = models.mlp(batch_size=8)
    optimizer = torch.optim.Adam(workload.model.parameters(), lr=1e-3)
    step = optimize(workload.model, optimizer, workload.batch, workload.loss_fn, passes="stats", verbose=True)
    assert "mutwo: backend auto: eager (CPU)" in capsys.readouterr().err.splitlines()
    assert step.options["backend"] == "eager" and step.last is not None and step.last.step is not None
    assert step.last.step.backend == "eager"
    assert torch.isfinite(step(workload.batch))


def test_optimize_says_the_choice_once(capsys: pytest.CaptureFixture[str]) -> None:
    workload = models.mlp(batch_size=8)
    optimizer = torch.optim.Adam(workload.model.parameters(), lr=1e-3)
    optimize(workload.model, optimizer, workload.batch, workload.loss_fn, passes="stats", verbose=True,
             accumulation_steps=3)  # three graphs planned, one choice  # fmt: skip
    lines = [line for line in capsys.readouterr().err.splitlines() if "backend auto" in line]
    assert lines == ["mutwo: backend auto: eager (CPU)"], lines


def test_mutwo_opt_takes_auto_and_chooses_eager_on_the_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    code = main(["--device", "cpu", "--batch-size", "64", "-p", "stats", "--backend", "auto", "-o", str(out),
                 str(TINY_MLP)])  # fmt: skip
    err = capsys.readouterr().err
    assert code == EXIT_OK, err
    assert "mutwo-opt: backend auto: eager (CPU)" in err.splitlines()
    assert json.loads((out / "summary.json").read_text())["backend"] == "eager"


def test_mutwo_opt_help_names_auto(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--backend {auto,eager,inductor,cudagraphs,inductor-cudagraphs}" in text
    assert "else auto: on CUDA inductor-cudagraphs when the step can be recorded" in text


def test_the_config_takes_auto_and_defaults_to_it(tmp_path: Path) -> None:
    config = load_config(TINY_MLP)
    assert config.backend == "auto" == Config.backend and BACKEND_CHOICES[0] == "auto"
    assert apply_overrides(config, backend="inductor").backend == "inductor"
    assert apply_overrides(config, backend="auto").backend == "auto"
    with pytest.raises(ConfigError, match="use one of auto, eager, inductor, cudagraphs, inductor-cudagraphs"):
        apply_overrides(config, backend="tensorrt")


@pytest.mark.cuda
def test_cuda_auto_records_a_stock_optimizer_under_inductor(capsys: pytest.CaptureFixture[str]) -> None:
    """On a GPU, with a stock AdamW (float learning rate, not capturable), the default is the
    fastest backend: the step can be recorded (mutwo captures the optimizer's capturable form)."""
    workload = models.mlp(batch_size=64)
    workload.model.cuda()
    workload.batch = tuple(t.cuda() for t in workload.batch)
    optimizer = torch.optim.AdamW(workload.model.parameters(), lr=1e-4)
    step = optimize(workload.model, optimizer, workload.batch, workload.loss_fn, budget=0.9, verbose=True,
                    calibrate_peak=0)  # one compile
    assert "backend auto: inductor-cudagraphs (CUDA, the step can be recorded)" in capsys.readouterr().err
    assert step.options["backend"] == "inductor-cudagraphs"
    assert torch.isfinite(step(workload.batch))


def test_the_state_a_capture_for_a_recording_changed_is_put_back() -> None:
    """auto captures for a CUDA graph first (step counts moved to the device, fresh state made);
    when it then chooses a backend that does not record, the optimizer's state is as it was."""
    from mutwo.runtime.capture.device_state import put_state_back, state_entries

    kept, fresh = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.Adam([kept, fresh])
    step = torch.tensor(3.0)
    optimizer.state[kept].update(step=step, exp_avg=torch.zeros(2))
    before = state_entries(optimizer)
    optimizer.state[kept]["step"] = step.clone()  # as a move to the device replaces it
    optimizer.state[fresh]["step"] = torch.tensor(0.0)  # as a capture's init_state creates it
    put_state_back(optimizer, before)
    assert optimizer.state[kept]["step"] is step and set(optimizer.state[kept]) == {"step", "exp_avg"}
    assert fresh not in optimizer.state
