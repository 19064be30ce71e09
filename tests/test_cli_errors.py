"""A catalogue of bad inputs to ``mutwo-opt``, each driven in-process through :func:`tools.mutwo_opt.main`.

Every case checks the exit code (2 for bad usage, config or pipeline), that stderr is exactly one
``mutwo-opt: error: ...`` line with no traceback, that the line names both the problem and the fix,
and that nothing was written to the output folder. Configs are tiny: a python-source model written
into ``tmp_path`` (a single Linear layer), so each case runs in well under a second once torch is
imported.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import mutwo.ir.registry as registry_module
from mutwo.ir.registry import BUILTIN_PASSES, ENTRY_POINT_GROUP, PassRegistry
from mutwo.runtime.execution.backends import BackendError
from mutwo.tools.cli import OutputFolder
from mutwo.tools.config import DEFAULT_PIPELINE
from mutwo.tools.mutwo_opt import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, main
from mutwo.tools.mutwo_opt_report import plan_fingerprint

REPO = Path(__file__).resolve().parent.parent

TINY_MODEL = '''\
import torch
from torch import nn
from torch.nn import functional as F


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x, labels):
        return self.fc(x)


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x, labels):
        if x.sum() > 0:
            return self.fc(x)
        return self.fc(-x)


def loss(output, batch):
    return F.cross_entropy(output, batch[1])


def _batch(batch_size):
    return (torch.randn(batch_size, 4), torch.randint(0, 3, (batch_size,)))


def make(batch_size):
    return Tiny(), _batch(batch_size), loss


def only_model(batch_size):
    return Tiny()


def branchy(batch_size):
    return Branchy(), _batch(batch_size), loss


def explodes(batch_size):
    raise RuntimeError("the dataset server is down")
'''

#: Passes for --load-passes: a typed option, and a requirement nobody before it provides.
TEST_PASSES = '''\
from dataclasses import dataclass

from mutwo.ir.pass_base import Pass, option


@dataclass(frozen=True)
class CountedPass(Pass):
    """Return its int option (test pass)."""

    name = "counted"
    times: int = option(1, "how many times")

    def run(self, graph, ctx):
        return self.times


@dataclass(frozen=True)
class NeedsPlanPass(Pass):
    """Needs a plan (test pass)."""

    name = "needs-plan"
    requires = ("plan",)

    def run(self, graph, ctx):
        return None


@dataclass(frozen=True)
class MakesPlanPass(Pass):
    """Provides a plan (test pass)."""

    name = "makes-plan"
    provides = ("plan",)

    def run(self, graph, ctx):
        ctx.artifacts["plan"] = []
'''


# -- helpers -------------------------------------------------------------------------------------
@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """tmp_path holding tiny.py (the model factories) and test_cli_passes.py (extra passes)."""
    (tmp_path / "tiny.py").write_text(TINY_MODEL)
    (tmp_path / "test_cli_passes.py").write_text(TEST_PASSES)
    return tmp_path


def write_config(folder: Path, text: str, name: str = "case.yaml") -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return path


def good_config(folder: Path) -> Path:
    return write_config(folder, """\
        model: {source: python, name: tiny.py:make}
        batch_size: 2
        optimizer: {name: sgd, lr: 0.1}
        passes: stats
        """, "good.yaml")  # fmt: skip


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_line(err: str, kind: str = "error") -> str:
    """The single stderr line, checked to be a ``mutwo-opt: <kind>:`` line with no traceback."""
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, f"expected exactly one line on stderr, got:\n{err}"
    assert lines[0].startswith(f"mutwo-opt: {kind}: "), lines[0]
    return lines[0]


def assert_nothing_written(out: Path) -> None:
    """Not even an empty output folder."""
    assert not out.exists(), sorted(p.name for p in out.iterdir())


def expect_usage_error(capsys: pytest.CaptureFixture[str], out: Path, *argv: str | Path) -> str:
    code, stdout, err = run_cli(capsys, "-q", "-o", out, *argv)
    line = one_line(err)
    assert code == EXIT_USAGE, line
    assert stdout == ""
    assert_nothing_written(out)
    return line


# -- a control: the tiny config itself works ----------------------------------------------------
def test_the_tiny_config_used_by_the_catalogue_runs(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = workdir / "out"
    code, _, err = run_cli(capsys, "-q", "-o", out, good_config(workdir))
    assert code == EXIT_OK, err
    assert err == ""
    assert (out / "summary.json").is_file()


@pytest.mark.parametrize("optimizer", ["{name: sgd, lr: 0.01, momentum: 0.9, dampening: 0.5}",
                                       "{name: rmsprop, lr: 0.01, centered: true}", "{name: radam, lr: 0.01}"])
def test_training_keys_run_and_check_bitwise(optimizer: str, workdir: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    config = write_config(workdir, f"""\
        model: {{source: python, name: tiny.py:make}}
        batch_size: 4
        optimizer: {optimizer}
        precision: bf16-autocast
        max_grad_norm: 0.5
        passes: stats
        """)  # fmt: skip
    out = workdir / "out"
    code, stdout, err = run_cli(capsys, "-q", "--check", "-o", out, config)
    assert code == EXIT_OK, err
    assert "equivalent" in (stdout + err + (out / "summary.json").read_text()).lower()


def test_accumulation_steps_plans_the_last_micro_batch_and_checks_bitwise(
        workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """The last micro-batch reads the gradients accumulated before it (zeros here) and steps."""
    config = write_config(workdir, """\
        model: {source: python, name: tiny.py:make}
        batch_size: 4
        optimizer: {name: adam, lr: 0.01}
        accumulation_steps: 3
        passes: stats
        """)  # fmt: skip
    out = workdir / "out"
    code, stdout, err = run_cli(capsys, "--check", "-o", out, config)
    assert code == EXIT_OK, err
    assert "capturing the last micro-batch of gradient accumulation (accumulation_steps=3)" in err
    assert "equivalent" in (stdout + err).lower()
    ir = (out / "input.ir.txt").read_text(encoding="utf-8")
    assert '"fc.weight:accumulated_grad"' in ir and '"fc.bias:accumulated_grad"' in ir


# -- the config file -----------------------------------------------------------------------------
def test_missing_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = expect_usage_error(capsys, tmp_path / "out", tmp_path / "nope.yaml")
    assert "nope.yaml" in line and "does not exist" in line
    assert "pass the path of a YAML file" in line


def test_config_that_is_a_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = expect_usage_error(capsys, tmp_path / "out", tmp_path)
    assert f"config file '{tmp_path}' is a directory, not a file" in line
    assert "pass the path of a YAML file" in line


def test_no_config_given(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = expect_usage_error(capsys, tmp_path / "out")
    assert "no config file given" in line
    assert "CONFIG.yaml" in line and "--help" in line


def test_yaml_syntax_error_names_the_line(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(workdir, "model: {source: python, name: tiny.py:make\nbatch_size: [2\n")
    line = expect_usage_error(capsys, workdir / "out", config)
    assert "is not valid YAML" in line
    assert "line 2" in line and "column" in line


def test_config_that_is_a_list(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(workdir, "- model\n- batch_size\n")
    line = expect_usage_error(capsys, workdir / "out", config)
    assert "must hold a YAML mapping" in line
    assert "'model'" in line


# (config text, words the message must contain)
CONFIG_ERRORS = {
    "unknown-top-level-key": (
        "model: {source: python, name: tiny.py:make}\nbatch_szie: 2\n",
        ["unknown key 'batch_szie'", "did you mean 'batch_size'?"],
    ),
    "unknown-nested-key": (
        "model: {source: python, nmae: tiny.py:make}\n",
        ["unknown key 'model.nmae'", "did you mean 'name'?"],
    ),
    "wrong-type": (
        'model: {source: python, name: tiny.py:make}\nbatch_size: "two"\n',
        ["'batch_size' must be a positive integer", "'two'"],
    ),
    "unknown-model-source": (
        "model: {source: pytorch, name: tiny.py:make}\n",
        ["unknown model source 'pytorch'", "use one of torchvision, transformers, python"],
    ),
    "unknown-backend": (
        "model: {source: python, name: tiny.py:make}\nbackend: inductr\n",
        ["unknown backend 'inductr'", "use one of auto, eager, inductor, cudagraphs, inductor-cudagraphs"],
    ),
    "unknown-precision": (
        "model: {source: python, name: tiny.py:make}\nprecision: bf16\n",
        ["unknown precision 'bf16'", "use one of fp32, bf16-autocast, fp16-autocast"],
    ),
    "non-positive-max-grad-norm": (
        "model: {source: python, name: tiny.py:make}\nmax_grad_norm: 0\n",
        ["'max_grad_norm' must be a positive number", "got 0"],
    ),
    "accumulation-steps-zero": (
        "model: {source: python, name: tiny.py:make}\naccumulation_steps: 0\n",
        ["'accumulation_steps' must be a whole number of micro-batches per optimizer step, 1 or more", "got 0"],
    ),
    "accumulation-steps-not-whole": (
        "model: {source: python, name: tiny.py:make}\naccumulation_steps: 1.5\n",
        ["'accumulation_steps' must be a whole number of micro-batches", "got 1.5"],
    ),
    "accumulation-steps-a-bool": (
        "model: {source: python, name: tiny.py:make}\naccumulation_steps: true\n",
        ["'accumulation_steps' must be a whole number of micro-batches", "got True"],
    ),
    "grad-scaler-not-a-bool": (
        "model: {source: python, name: tiny.py:make}\ngrad_scaler: 1\n",
        ["'grad_scaler' must be true or false"],
    ),
    "unknown-optimizer-key": (
        "model: {source: python, name: tiny.py:make}\noptimizer: {name: adam, lr: 0.01, fused: true}\n",
        ["unknown key 'optimizer.fused'", "valid keys:", "betas"],
    ),
}


@pytest.mark.parametrize("case", sorted(CONFIG_ERRORS))
def test_config_errors(case: str, workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text, words = CONFIG_ERRORS[case]
    line = expect_usage_error(capsys, workdir / "out", write_config(workdir, text))
    for word in words:
        assert word in line


# -- building the model --------------------------------------------------------------------------
MODEL_ERRORS = {
    "unknown-torchvision-model": (
        "model: {source: torchvision, name: resnet1522}\n",
        ["unknown torchvision model 'resnet1522'", "did you mean 'resnet152'"],
    ),
    "non-classification-torchvision-model": (
        "model: {source: torchvision, name: fasterrcnn_resnet50_fpn}\n",
        ["'fasterrcnn_resnet50_fpn' is not an image classifier", "use source: python"],
    ),
    "unknown-transformers-class": (
        "model: {source: transformers, name: BertForMaskedLMM}\n",
        ["unknown transformers model class 'BertForMaskedLMM'", "did you mean 'BertForMaskedLM'"],
    ),
    "python-file-not-found": (
        "model: {source: python, name: nothere.py:make}\n",
        ["model file 'nothere.py' does not exist", "looked beside the config"],
    ),
    "python-function-not-found": (
        "model: {source: python, name: tiny.py:nothere}\n",
        ["'tiny.py' has no function 'nothere'", "check model.name"],
    ),
    "python-file-named-as-a-module": (
        "model: {source: python, name: tiny:make}\n",
        ["cannot import model module 'tiny'", "a file is named with its .py: model.name: tiny.py:make"],
    ),
    "python-module-not-found": (
        "model: {source: python, name: not_a_module_mutwo:make}\n",
        ["cannot import model module 'not_a_module_mutwo'", "name an installed module, or a file as "
         "'path/to/file.py:function'"],
    ),
    "python-factory-returns-a-model": (
        "model: {source: python, name: tiny.py:only_model}\n",
        ["tiny.py:only_model must return (model, batch, loss_fn)", "it returned Tiny"],
    ),
    "python-name-without-function": (
        "model: {source: python, name: tiny.py}\n",
        ["'tiny.py' must be", "'path/to/file.py:function'"],
    ),
}


@pytest.mark.parametrize("case", sorted(MODEL_ERRORS))
def test_model_errors(case: str, workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text, words = MODEL_ERRORS[case]
    line = expect_usage_error(capsys, workdir / "out", write_config(workdir, text))
    for word in words:
        assert word in line


def test_forward_with_data_dependent_control_flow(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(workdir, "model: {source: python, name: tiny.py:branchy}\n")
    line = expect_usage_error(capsys, workdir / "out", config)
    lineno = TINY_MODEL.splitlines().index("        if x.sum() > 0:") + 1
    assert "data-dependent control flow" in line
    assert f"tiny.py:{lineno}" in line  # the file and the line of the branch
    assert "if x.sum() > 0:" in line
    assert "torch.where" in line  # the fix


def test_python_factory_that_raises(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(workdir, "model: {source: python, name: tiny.py:explodes}\n")
    line = expect_usage_error(capsys, workdir / "out", config)
    assert "tiny.py:explodes" in line and "the dataset server is down" in line


# -- the optimizer -------------------------------------------------------------------------------
OPTIMIZER_ERRORS = {
    "sgd-negative-momentum": (
        "{name: sgd, lr: 0.01, momentum: -1}",
        ["optimizer sgd", "Invalid momentum value: -1"],
    ),
    "sgd-nesterov-without-momentum": (
        "{name: sgd, lr: 0.01, nesterov: true}",
        ["optimizer sgd", "Nesterov momentum requires a momentum"],
    ),
    "unknown-optimizer": (
        "{name: lion, lr: 0.01}",
        ["unknown optimizer 'lion'", "use one of sgd, adam, adamw"],
    ),
    "non-positive-lr": (
        "{name: adam, lr: 0}",
        ["'optimizer.lr' must be positive", "got 0"],
    ),
}


@pytest.mark.parametrize("case", sorted(OPTIMIZER_ERRORS))
def test_unsupported_optimizer_options(case: str, workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    options, words = OPTIMIZER_ERRORS[case]
    config = write_config(workdir, f"model: {{source: python, name: tiny.py:make}}\noptimizer: {options}\n")
    line = expect_usage_error(capsys, workdir / "out", config)
    for word in words:
        assert word in line


def test_adam_betas_with_one_element(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(workdir, "model: {source: python, name: tiny.py:make}\n"
                                   "optimizer: {name: adam, lr: 0.01, betas: [0.9]}\n")  # fmt: skip
    line = expect_usage_error(capsys, workdir / "out", config)
    assert "betas" in line and "two numbers" in line


# -- command-line overrides ----------------------------------------------------------------------
def test_batch_size_zero(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = expect_usage_error(capsys, workdir / "out", "--batch-size", "0", good_config(workdir))
    assert "batch size must be a positive integer, got 0" in line


def test_batch_size_not_an_integer(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = expect_usage_error(capsys, workdir / "out", "--batch-size", "two", good_config(workdir))
    assert "--batch-size" in line and "invalid int value: 'two'" in line
    assert "see mutwo-opt --help" in line


@pytest.mark.parametrize("argv", [["--budget", "-0.5"], ["--budget=-1GiB"]], ids=["fraction", "bytes"])
def test_negative_budget(argv: list[str], workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = expect_usage_error(capsys, workdir / "out", *argv, good_config(workdir))
    assert "budget must be positive" in line
    assert argv[-1].removeprefix("--budget=") in line


def test_budget_with_unknown_unit(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = expect_usage_error(capsys, workdir / "out", "--budget", "6XB", good_config(workdir))
    assert "unknown unit 'XB'" in line and "use B, KiB, MiB, GiB" in line


def test_infinite_budget(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = expect_usage_error(capsys, workdir / "out", "--budget", "1e999", good_config(workdir))
    assert "budget" in line


def test_unknown_device_choice(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = expect_usage_error(capsys, workdir / "out", "--device", "gpu", good_config(workdir))
    assert "invalid choice: 'gpu'" in line and "'cuda'" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: --device cuda is valid here")
def test_cuda_requested_without_a_gpu(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = expect_usage_error(capsys, workdir / "out", "--device", "cuda", good_config(workdir))
    assert "CUDA was requested but no GPU is visible" in line
    assert "use --device cpu or auto" in line


def test_unknown_backend_choice(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = expect_usage_error(capsys, workdir / "out", "--backend", "tensorrt", good_config(workdir))
    assert "invalid choice: 'tensorrt'" in line and "'inductor'" in line


@pytest.mark.parametrize("backend", ["cudagraphs", "inductor-cudagraphs"])
def test_cuda_graphs_of_a_cpu_step(backend: str, workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = expect_usage_error(capsys, workdir / "out", "--device", "cpu", "--backend", backend, good_config(workdir))
    assert f"--backend {backend} needs a CUDA device" in line and "use --backend eager or inductor" in line


@pytest.mark.parametrize("pipeline", ["profile,select{fused=true},rewrite",
                                      "profile,select-swap{fused=true},insert-swap"])
def test_fused_pricing_for_a_backend_that_does_not_fuse(pipeline: str, workdir: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    line = expect_usage_error(capsys, workdir / "out", "--device", "cpu", "--budget", "0.9", "-p", pipeline,
                              good_config(workdir))  # fmt: skip
    assert "{fused=true} prices recomputes as Inductor fuses them, but --backend is eager" in line
    assert "use --backend inductor, or drop fused=true" in line


def test_fit_with_a_compiled_backend(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = expect_usage_error(capsys, workdir / "out", "--device", "cpu", "--backend", "inductor", "--fit", "1GiB",
                              good_config(workdir))  # fmt: skip
    assert "--fit searches with the eager backend, not inductor" in line and "without --backend" in line


@pytest.mark.parametrize("option", [["-p", "profile,select,rewrite"], ["--plan-from", "plan.json"],
                                    ["--profile-from", "profile.json"]],
                         ids=["passes", "plan-from", "profile-from"])  # fmt: skip
def test_fit_with_what_it_would_not_use(option: list[str], workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (workdir / option[1]).write_text("{}")  # the file is not read: --fit is refused first
    value = option[1] if option[0] == "-p" else str(workdir / option[1])
    line = expect_usage_error(capsys, workdir / "out", "--device", "cpu", "--fit", "1GiB", option[0], value,
                              good_config(workdir))  # fmt: skip
    assert "--fit profiles once and plans every batch size with its own pipeline (optimizer,select{lowest=false})" \
           f", so {option[0]} would go unused" in line


def test_output_folder_under_a_regular_file(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = workdir / "file.txt"
    blocker.write_text("keep me\n")
    line = expect_usage_error(capsys, blocker / "out", good_config(workdir))
    assert f"output folder '{blocker / 'out'}' is not writable (it is under the file '{blocker}')" in line
    assert "choose another with -o DIR" in line
    assert blocker.read_text() == "keep me\n"


def test_output_folder_that_is_a_regular_file(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = workdir / "afile"
    blocker.write_text("keep me\n")
    code, stdout, err = run_cli(capsys, "-q", "-o", blocker, good_config(workdir))
    line = one_line(err)
    assert code == EXIT_USAGE and stdout == ""
    assert f"output folder '{blocker}' is a file, not a folder; choose another with -o DIR" in line
    assert blocker.read_text() == "keep me\n"


# -- the pipeline ----------------------------------------------------------------------------
def test_unknown_pass_suggests_and_lists(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = expect_usage_error(capsys, workdir / "out", "-p", "stat", good_config(workdir))
    assert "unknown pass 'stat'" in line
    assert "did you mean 'stats'?" in line
    valid = line.split("valid passes: ", 1)[1].split(", ")
    assert set(BUILTIN_PASSES) <= set(valid)


def test_unknown_pass_in_the_config(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(workdir, "model: {source: python, name: tiny.py:make}\npasses: stats,dcee\n")
    line = expect_usage_error(capsys, workdir / "out", config)
    assert "unknown pass 'dcee'" in line and "did you mean 'dce'?" in line


def test_bad_pass_option_name(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = expect_usage_error(capsys, workdir / "out", "-p", "stats{foo=1}", good_config(workdir))
    assert "pass 'stats' has no option 'foo'" in line
    assert "its options: none" in line


def test_bad_value_for_a_typed_option(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = expect_usage_error(capsys, workdir / "out", "--load-passes", workdir / "test_cli_passes.py",
                              "-p", "counted{times=abc}", good_config(workdir))  # fmt: skip
    assert "pass 'counted': option 'times' must be int, got 'abc'" in line


@pytest.mark.parametrize("pipeline,words", [
    ("profile,select{budget=banana},rewrite", ["pass 'select'", "budget 'banana'", "'6GiB'", "'min'"]),
    ("profile,select{budget=-0.5},rewrite", ["pass 'select'", "budget must be positive"]),
    ("profile{runs=0},select,rewrite", ["pass 'profile'", "runs must be at least 1"]),
    ("peak-consumers{top=0}", ["pass 'peak-consumers': top must be at least 1"]),
    ("profile,select-swap{allow=teleport},insert-swap", ["pass 'select-swap'", "allow must list swap and/or "
                                                         "recompute", "'teleport'"]),
    ("profile,select-swap{bandwidth=-3},insert-swap", ["pass 'select-swap'", "bandwidth must be a positive"]),
    ("profile,select-swap{refine=-1},insert-swap", ["pass 'select-swap'", "refine must be a number of recomputations"]),
    ("profile,select-swap{budget=lots},insert-swap", ["pass 'select-swap'", "budget 'lots'", "'min'"]),
    ("profile,select-swap{contention=-0.1},insert-swap", ["pass 'select-swap'", "contention must be a fraction"]),
    ("profile,select-swap{offload_window=0},insert-swap", ["pass 'select-swap'", "offload_window must be a fraction"]),
    ("profile,select-swap{offload_window=2},insert-swap", ["pass 'select-swap'", "offload_window must be a fraction"]),
    ("profile,insert-swap", ["pass 'insert-swap' needs swap-plan", "run select-swap before it"]),
], ids=["select-budget-word", "select-budget-negative", "profile-runs-zero", "loaded-pass", "swap-allow-word",
        "swap-bandwidth-negative", "swap-refine-negative", "swap-budget-word", "swap-contention-negative",
        "swap-offload-window-zero", "swap-offload-window-over-one", "insert-swap-without-plan"])  # fmt: skip
def test_bad_option_value_is_refused_before_capture(pipeline: str, words: list[str], workdir: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    # Caught when the pipeline is built: the forward below would fail capture if it were reached.
    config = write_config(workdir, "model: {source: python, name: tiny.py:branchy}\n")
    line = expect_usage_error(capsys, workdir / "out", "--load-passes", REPO / "examples/passes/peak_consumers.py",
                              "-p", pipeline, config)  # fmt: skip
    for word in words:
        assert word in line


def test_debug_prints_the_traceback_behind_the_one_line(workdir: Path, capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setenv("MUTWO_DEBUG", "")  # restored afterwards: --debug sets it for the process
    config = write_config(workdir, "model: {source: python, name: tiny.py:branchy}\n")
    code, _, err = run_cli(capsys, "-q", "--debug", "-o", workdir / "out", config)
    assert code == EXIT_USAGE
    assert "Traceback" in err and "direct cause" in err  # torch's own error, then mutwo's sentence
    assert err.splitlines()[-1].startswith("mutwo-opt: error: the model's forward has data-dependent control flow")


def test_good_value_for_a_typed_option_is_accepted(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = workdir / "out"
    code, _, err = run_cli(capsys, "-q", "-o", out, "--load-passes", workdir / "test_cli_passes.py",
                           "-p", "counted{times=3}", good_config(workdir))  # fmt: skip
    assert code == EXIT_OK, err
    assert '"counted{times=3}"' in (out / "summary.json").read_text()


@pytest.mark.parametrize(("pipeline", "words"), [
    ("stats,,dce", ["bad pipeline", "empty pass name at character 7"]),
    ("stats{", ["bad pipeline", "unclosed '{'", "pass 'stats'"]),
    ("stats,", ["bad pipeline", "ends with a comma"]),
    ("stats}", ["bad pipeline", "unexpected '}'"]),
    ("stats{a=1,a=2}", ["bad pipeline", "option 'a'", "given twice"]),
], ids=["empty-name", "unclosed-brace", "trailing-comma", "stray-brace", "duplicate-option"])  # fmt: skip
def test_malformed_pipeline(pipeline: str, words: list[str], workdir: Path,
                            capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    line = expect_usage_error(capsys, workdir / "out", "-p", pipeline, good_config(workdir))
    for word in words:
        assert word in line


def test_unmet_pass_requirement(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = expect_usage_error(capsys, workdir / "out", "--load-passes", workdir / "test_cli_passes.py",
                              "-p", "stats,needs-plan", good_config(workdir))  # fmt: skip
    assert "pass 'needs-plan' needs plan, which no earlier pass provides" in line
    assert "run makes-plan or select before it" in line  # the fix: the passes that provide it


def test_requirement_provided_later_is_still_unmet(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = expect_usage_error(capsys, workdir / "out", "--load-passes", workdir / "test_cli_passes.py",
                              "-p", "needs-plan,makes-plan", good_config(workdir))  # fmt: skip
    assert "needs plan, which no earlier pass provides" in line


def test_print_ir_after_an_unknown_pass(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = expect_usage_error(capsys, workdir / "out", "--print-ir-after", "dec", good_config(workdir))
    assert "--print-ir-after names unknown pass 'dec'; did you mean 'dce'?" in line and "--list-passes" in line


def test_load_passes_of_a_missing_file(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = expect_usage_error(capsys, workdir / "out", "--load-passes", workdir / "missing_passes.py",
                              good_config(workdir))  # fmt: skip
    assert "--load-passes" in line and "no such file" in line and "missing_passes.py" in line


def test_load_passes_of_a_file_that_fails_to_import(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    broken = workdir / "broken_passes.py"
    broken.write_text("import definitely_not_a_module_mutwo\n")
    line = expect_usage_error(capsys, workdir / "out", "--load-passes", broken, good_config(workdir))
    assert "importing it failed" in line and "definitely_not_a_module_mutwo" in line


def test_load_passes_of_a_module_name_that_is_a_file_here(workdir: Path, capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.chdir(workdir)
    line = expect_usage_error(capsys, workdir / "out", "--load-passes", "test_cli_passes", good_config(workdir))
    assert "No module named 'test_cli_passes'" in line
    assert "to load the file test_cli_passes.py, give its path: --load-passes test_cli_passes.py" in line


def test_load_passes_of_an_unknown_module(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = expect_usage_error(capsys, workdir / "out", "--load-passes", "not_a_module_mutwo", good_config(workdir))
    assert "No module named 'not_a_module_mutwo'" in line and "give the path of a .py file" in line


def test_the_same_passes_file_given_twice_is_loaded_once(workdir: Path, capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.chdir(workdir)
    out = workdir / "out"
    code, _, err = run_cli(capsys, "-q", "-o", out, "--load-passes", "test_cli_passes.py", "--load-passes",
                           workdir / "test_cli_passes.py", "-p", "counted{times=2}", good_config(workdir))  # fmt: skip
    assert code == EXIT_OK, err
    assert '"counted{times=2}"' in (out / "summary.json").read_text()


@pytest.mark.parametrize(("argv", "words"), [
    (["--budgte", "0.5"], ["unrecognized option '--budgte'; did you mean '--budget'?", "--help"]),
    (["--budgte=0.5"], ["unrecognized option '--budgte'; did you mean '--budget'?"]),
    (["--dump-dots"], ["unrecognized option '--dump-dots'; did you mean '--dump-dot'?"]),
    (["--frobnicate"], ["unrecognized option '--frobnicate' (see mutwo-opt --help)"]),
], ids=["spaced-value", "joined-value", "plural", "nothing-close"])  # fmt: skip
def test_a_misspelt_option_gets_the_closest_one(argv: list[str], words: list[str], workdir: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    line = expect_usage_error(capsys, workdir / "out", *argv, good_config(workdir))
    for word in words:
        assert word in line


# -- reusing a profile or a plan ------------------------------------------------------------------
TINY_MLP = REPO / "examples" / "tiny_mlp.yaml"


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The output folder of a tiny MLP planned at the tightest budget (its profile.json, plan.json)."""
    out = tmp_path_factory.mktemp("planned") / "out"
    assert main(["-q", "--device", "cpu", "--batch-size", "64", "-p", "profile,select{budget=min},rewrite",
                 "-o", str(out), str(TINY_MLP)]) == EXIT_OK  # fmt: skip
    return out


def test_plan_from_gives_the_same_final_graph(planned: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    out = tmp_path / "again"
    code, _, err = run_cli(capsys, "-q", "--device", "cpu", "--batch-size", "64", "-p", "rewrite", "--plan-from",
                           planned / "plan.json", "--check", "-o", out, TINY_MLP)  # fmt: skip
    assert code == EXIT_OK, err
    assert json.loads((planned / "summary.json").read_text())["recomputed"], "the plan recomputes nothing"
    assert (out / "final.ir.txt").read_text() == (planned / "final.ir.txt").read_text()
    assert json.loads((out / "summary.json").read_text())["equivalent"] is True


@pytest.mark.parametrize(("option", "artifact", "pipeline", "maker"), [
    ("--plan-from", "plan.json", "profile,select,rewrite", "select"),
    ("--profile-from", "profile.json", "profile,select,rewrite", "profile"),
], ids=["plan-beside-select", "profile-beside-profile"])  # fmt: skip
def test_a_reused_file_beside_the_pass_that_remakes_it(option: str, artifact: str, pipeline: str, maker: str,
                                                       planned: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    line = expect_usage_error(capsys, tmp_path / "out", "--device", "cpu", "--batch-size", "64", "-p", pipeline,
                              option, planned / artifact, TINY_MLP)  # fmt: skip
    assert f"the pipeline's '{maker}' pass would make a new one and leave the file unused" in line
    assert f"drop {maker} from --passes" in line


def test_a_plan_of_another_graph(planned: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = expect_usage_error(capsys, tmp_path / "out", "--device", "cpu", "--batch-size", "8", "-p", "rewrite",
                              "--plan-from", planned / "plan.json", TINY_MLP)  # fmt: skip
    assert "belongs to a different graph" in line and "run the select pass again" in line


def test_a_plan_file_that_is_missing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = expect_usage_error(capsys, tmp_path / "out", "--device", "cpu", "--batch-size", "64", "-p", "rewrite",
                              "--plan-from", tmp_path / "nowhere.json", TINY_MLP)  # fmt: skip
    assert (f"--plan-from: '{tmp_path / 'nowhere.json'}' does not exist; give the plan.json or swap_plan.json an "
            "earlier run wrote") in line


@pytest.mark.parametrize("option", ["--plan-from", "--profile-from"])
def test_a_reused_file_is_checked_before_the_capture(option: str, workdir: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    # The model's forward cannot be captured: an error about the file shows it was checked first.
    config = write_config(workdir, "model: {source: python, name: tiny.py:branchy}\n")
    pipeline = "rewrite" if option == "--plan-from" else "select,rewrite"
    line = expect_usage_error(capsys, workdir / "out", "-p", pipeline, option, workdir / "nothere.json", config)
    assert f"{option}: '{workdir / 'nothere.json'}' does not exist; give the " in line
    line = expect_usage_error(capsys, workdir / "out", "-p", pipeline, option, workdir, config)
    assert f"{option}: '{workdir}' is a directory, not a file" in line


def test_a_reused_plan_sets_the_summarys_budget(planned: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    out = tmp_path / "again"
    code, _, err = run_cli(capsys, "-q", "--device", "cpu", "--batch-size", "64", "-p", "rewrite", "--plan-from",
                           planned / "plan.json", "-o", out, TINY_MLP)  # fmt: skip
    assert code == EXIT_OK, err
    assert json.loads((out / "summary.json").read_text())["budget"] == "min"  # the plan's, not the config's 0.9


def test_a_plan_no_pass_reads(planned: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = expect_usage_error(capsys, tmp_path / "out", "--device", "cpu", "--batch-size", "64", "-p", "stats",
                              "--plan-from", planned / "plan.json", TINY_MLP)  # fmt: skip
    assert "--plan-from gives a plan.json, but no pass of this pipeline (stats) reads it" in line
    assert "-p rewrite --plan-from FILE" in line


@pytest.fixture(scope="module")
def swap_planned(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The output folder of the tiny MLP planned with swaps (select-swap cannot keep recompute only)."""
    out = tmp_path_factory.mktemp("swap_planned") / "out"
    assert main(["-q", "--device", "cpu", "--batch-size", "64", "--budget", "0.85", "-p",
                 "profile,select-swap{allow=swap},insert-swap", "-o", str(out), str(TINY_MLP)]) == EXIT_OK  # fmt: skip
    return out


def test_a_swap_plan_is_reloaded_and_gives_the_same_final_graph(
        swap_planned: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    out = tmp_path / "again"
    code, _, err = run_cli(capsys, "-q", "--device", "cpu", "--batch-size", "64", "-p", "insert-swap", "--plan-from",
                           swap_planned / "swap_plan.json", "--check", "-o", out, TINY_MLP)  # fmt: skip
    assert code == EXIT_OK, err
    assert json.loads((swap_planned / "summary.json").read_text())["swapped"], "the plan swaps nothing"
    assert (out / "final.ir.txt").read_text() == (swap_planned / "final.ir.txt").read_text()
    assert json.loads((out / "summary.json").read_text())["equivalent"] is True


def test_a_reused_file_of_the_wrong_kind_is_named(planned: Path, swap_planned: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """A swap plan for a pipeline that applies select's plans, a plan where a profile is wanted: each
    named for what it is, before the capture."""
    line = expect_usage_error(capsys, tmp_path / "out", "--device", "cpu", "--batch-size", "64", "-p", "rewrite",
                              "--plan-from", swap_planned / "swap_plan.json", TINY_MLP)  # fmt: skip
    assert ("gives a swap_plan.json, but no pass of this pipeline (extract,insert-recompute,share-gathers) reads "
            "it") in line
    assert "insert-swap applies it (-p insert-swap --plan-from FILE)" in line
    line = expect_usage_error(capsys, tmp_path / "out", "--device", "cpu", "--batch-size", "64", "-p",
                              "select,rewrite", "--profile-from", planned / "plan.json", TINY_MLP)  # fmt: skip
    assert f"{planned / 'plan.json'} is a plan.json written by the select pass, not a profile.json" in line
    line = expect_usage_error(capsys, tmp_path / "out", "--device", "cpu", "--batch-size", "64", "-p", "rewrite",
                              "--plan-from", planned / "profile.json", TINY_MLP)  # fmt: skip
    assert "is a profile.json written by the profile pass, not a plan.json or swap_plan.json" in line
    line = expect_usage_error(capsys, tmp_path / "out", "--device", "cpu", "--batch-size", "64", "-p", "insert-swap",
                              "--plan-from", planned / "profile.json", TINY_MLP)  # fmt: skip
    assert "is a profile.json written by the profile pass" in line  # named before what insert-swap needs


def test_a_backend_refusal_after_the_passes_leaves_nothing_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """A backend refuses the final graph only once the passes have written their files (Inductor and
    an eager plan's generator-state replays, say): the run is staged, so the refusal leaves no new
    folder, and an output folder holding an earlier run's files (the same names) stays as it was.
    (The refusal is forced here: whether a plan replays a random op depends on its profile.)"""
    from mutwo.tools import mutwo_opt

    argv = ["--device", "cpu", "--budget", "0.85", TINY_MLP]
    earlier = tmp_path / "earlier"
    code, _, err = run_cli(capsys, "-q", "-o", earlier, *argv)
    assert code == EXIT_OK, err
    (earlier / "notes.txt").write_text("mine")
    before = {p.name: p.read_bytes() for p in earlier.iterdir()}

    def refuse(*args: object) -> None:
        raise BackendError("the inductor backend cannot run this plan (refused by the test)")

    monkeypatch.setattr(mutwo_opt, "compile_graph", refuse)
    line = expect_usage_error(capsys, tmp_path / "new" / "out", *argv[:2], "--budget", "0.95", TINY_MLP)
    assert "cannot run this plan (refused by the test)" in line
    assert not (tmp_path / "new").exists(), "the parent folder the run made is left"
    code, _, err = run_cli(capsys, "-q", "-o", earlier, "--device", "cpu", "--budget", "0.95", TINY_MLP)
    assert code == EXIT_USAGE, err
    assert {p.name: p.read_bytes() for p in earlier.iterdir()} == before, "the earlier run's files changed"
    assert not list(tmp_path.glob("**/*staging*")), "a staging folder is left"


#: A run that stages its output and waits to be killed: prints its staging folder, then sleeps.
STAGE_AND_WAIT = """\
import sys, time
from pathlib import Path
from mutwo.tools.cli import OutputFolder
output = OutputFolder.make(Path(sys.argv[1]))
(output.staging / "half-written.txt").write_text("cut off")
print(output.staging, flush=True)
time.sleep(600)
"""


def test_a_killed_run_s_staging_folder_is_removed_by_the_next_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """A run killed with SIGKILL cleans nothing up: its hidden staging folder stays. The next run for
    the same output removes it, its process being gone, and keeps what may still be in use: a
    live process's stage, another host's, another output's, and one named before stages held
    their owner. What the run commits is only what it wrote."""
    out = tmp_path / "out"
    live = OutputFolder.make(out)  # this process's, alive throughout
    assert live.staging.name.startswith(f".out.mutwo-staging-{os.getpid()}@{socket.gethostname()}-")
    killed = subprocess.Popen([sys.executable, "-c", STAGE_AND_WAIT, str(out)], stdout=subprocess.PIPE, text=True)
    assert killed.stdout is not None
    stage = Path(killed.stdout.readline().strip())
    killed.kill()
    killed.wait()
    assert (stage / "half-written.txt").is_file() and stage.parent == tmp_path  # no output folder yet
    assert stage.name.startswith(f".out.mutwo-staging-{killed.pid}@")
    kept = [live.staging, tmp_path / f".out.mutwo-staging-{killed.pid}@elsewhere.example-a1b2",
            tmp_path / f".other.mutwo-staging-{killed.pid}@{socket.gethostname()}-a1b2",
            tmp_path / ".out.mutwo-staging-a1b2"]  # fmt: skip
    for folder in kept[1:]:
        folder.mkdir()
    code, _, err = run_cli(capsys, "-q", "--device", "cpu", "-p", "stats", "-o", out, TINY_MLP)
    assert code == EXIT_OK, err
    assert not stage.exists(), "the killed run's staging folder is left"
    assert all(folder.is_dir() for folder in kept), "a staging folder that may be in use was removed"
    assert {p.name for p in tmp_path.iterdir()} == {"out", *(folder.name for folder in kept)}
    summary = json.loads((out / "summary.json").read_text())
    assert {p.name for p in out.iterdir()} == set(summary["files"]), "the output holds what the run did not write"
    live.discard()


def test_a_quiet_compiled_run_prints_nothing(tmp_path: Path) -> None:
    """-q with Inductor on the CPU: stderr stays empty. (torch.utils.cpp_extension, imported by
    Inductor's C++ builder, warns once per process about CUDA_HOME on a machine with a CUDA toolkit
    and no GPU; a fresh process, so that the first import is the run's.)"""
    run = subprocess.run([sys.executable, "-m", "mutwo.tools.mutwo_opt", "-q", "--device", "cpu", "--backend",
                          "inductor", "--budget", "0.85", "-o", str(tmp_path / "out"), str(TINY_MLP)],
                         capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
    assert run.returncode == EXIT_OK and run.stderr == "", run.stderr


def test_print_ir_after_an_alias_prints_after_its_last_pass(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    code, stdout, err = run_cli(capsys, "-q", "--device", "cpu", "--batch-size", "64", "--budget", "min",
                                "--print-ir-after", "rewrite", "-o", tmp_path / "out", TINY_MLP)  # fmt: skip
    assert code == EXIT_OK, err
    assert "IR after share-gathers" in stdout and "IR after insert-recompute" not in stdout


def test_print_ir_after_an_alias_of_which_the_pipeline_runs_one_pass(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    code, stdout, err = run_cli(capsys, "-q", "--device", "cpu", "-p", "optimizer-in-backward", "--print-ir-after",
                                "optimizer", "-o", tmp_path / "out", TINY_MLP)  # fmt: skip
    assert code == EXIT_OK, err
    assert "IR after optimizer-in-backward" in stdout


def test_print_ir_after_a_pass_the_pipeline_does_not_run(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = expect_usage_error(capsys, workdir / "out", "--print-ir-after", "dce", good_config(workdir))
    assert "--print-ir-after names 'dce', which this pipeline does not run (stats); name one of its passes" in line


# -- failures (exit 1) ---------------------------------------------------------------------------
def test_a_pass_that_raises_exits_1_and_records_the_error(workdir: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    failing = workdir / "failing_passes.py"
    failing.write_text(textwrap.dedent('''\
        from dataclasses import dataclass
        from mutwo.ir.pass_base import Pass, PassFailure

        @dataclass(frozen=True)
        class Refuses(Pass):
            """Always fails (test pass)."""
            name = "refuses"
            def run(self, graph, ctx):
                raise PassFailure("no plan fits the budget\\nsecond line")
        '''))
    out = workdir / "out"
    code, _, err = run_cli(capsys, "-q", "-o", out, "--load-passes", failing, "-p", "stats,refuses",
                           good_config(workdir))  # fmt: skip
    line = one_line(err, "failed")
    assert code == EXIT_FAILURE
    assert "pass 'refuses' failed after [stats]: no plan fits the budget" in line
    summary = json.loads((out / "summary.json").read_text())
    assert summary["error"].startswith("pass 'refuses' failed after [stats]")
    assert summary["equivalent"] is None


CRASHING_PASS = '''\
from dataclasses import dataclass
from mutwo.ir.pass_base import Pass, option

@dataclass(frozen=True)
class BigActs(Pass):
    """Crashes on demand (test pass)."""
    name = "big-acts"
    crash: bool = option(False, "crash")

    def run(self, graph, ctx):
        if self.crash:
            return {}["boom"]
        return None
'''


def test_a_pass_that_crashes_names_the_exception_and_its_line(workdir: Path, capsys: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setenv("MUTWO_DEBUG", "")  # restored afterwards: --debug sets it for the process
    crashing = workdir / "crashing_passes.py"
    crashing.write_text(CRASHING_PASS)
    lineno = CRASHING_PASS.splitlines().index('            return {}["boom"]') + 1
    out = workdir / "out"
    argv = ["-o", out, "--load-passes", crashing, "-p", "big-acts{crash=true}", good_config(workdir)]
    code, _, err = run_cli(capsys, "-q", *argv)
    line = one_line(err, "failed")
    assert code == EXIT_FAILURE
    assert (f"pass 'big-acts' failed as the first pass: KeyError: 'boom' (raised at {crashing}:{lineno} in run: "
            'return {}["boom"]); run again with --debug for the traceback') in line
    assert json.loads((out / "summary.json").read_text())["error"].startswith("pass 'big-acts' failed")
    code, _, err = run_cli(capsys, "-q", "--debug", *argv)
    assert code == EXIT_FAILURE
    assert "Traceback" in err and 'KeyError: \'boom\'' in err and f"{crashing}\", line {lineno}" in err
    assert "--debug" not in err.splitlines()[-1]


def test_an_unreachable_budget_names_the_fix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    tiny = ["--device", "cpu", "--batch-size", "64"]
    code, _, err = run_cli(capsys, "-q", "-p", "profile,select,rewrite", "--budget", "0.05", *tiny, "-o", out,
                           TINY_MLP)  # fmt: skip
    line = one_line(err, "failed")
    assert code == EXIT_FAILURE
    assert "budget 0.05 (" in line and "is unreachable" in line
    suggested = re.search(r"; ask for budget 'min' or a budget of at least ([0-9.]+) \((.+)\)$", line)
    assert suggested is not None, line
    # No file reads like a result: summary.json records the failure and the plan that missed.
    summary = json.loads((out / "summary.json").read_text())
    assert summary["error"] in line and summary["equivalent"] is None and summary["peak_bytes_after"] is None
    plan = summary["unmet_plan"]
    assert plan["met"] is False and plan["budget"] == "0.05"
    written = {p.name for p in out.iterdir()}
    assert set(summary["files"]) == written == {"summary.json", "input.ir.txt", "profile.json", "nodes.csv",
                                                "activations.csv"}  # fmt: skip
    # The budget it names is reached, from the same profile.
    again = tmp_path / "again"
    code, _, err = run_cli(capsys, "-q", "-p", "select,rewrite", "--profile-from", out / "profile.json", "--budget",
                           suggested.group(1), *tiny, "-o", again, TINY_MLP)  # fmt: skip
    assert code == EXIT_OK, err
    reached = json.loads((again / "plan.json").read_text())
    assert reached["met"] and reached["predicted_peak"] <= reached["budget_bytes"]


def test_the_plan_is_logged_as_a_prefixed_line_then_rows(planned: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    tiny = ["--device", "cpu", "--batch-size", "64", "-p", "select,rewrite", "--profile-from",
            planned / "profile.json", TINY_MLP]  # fmt: skip
    for budget, rows in (("1", 0), ("min", len(json.loads((planned / "plan.json").read_text())["entries"]))):
        code, _, err = run_cli(capsys, "--budget", budget, "-o", tmp_path / budget, *tiny)
        assert code == EXIT_OK, err
        lines = err.splitlines()
        summary = [i for i, line in enumerate(lines) if line.startswith("mutwo-opt: select: recompute ")]
        assert len(summary) == 1, err
        at = summary[0]
        noun = "activation" if rows == 1 else "activations"
        assert lines[at].startswith(f"mutwo-opt: select: recompute {rows} {noun}: predicted peak "), lines[at]
        table = lines[at + 1:at + 2 + rows] if rows else []
        assert all(not line.startswith("mutwo-opt: ") for line in table) and len(table) == (rows + 1 if rows else 0)
        assert all(line.startswith("mutwo-opt: ") for line in lines[:at] + lines[at + 1 + len(table):]), err
        assert ("storage producer" in err) == bool(rows)


def test_one_profile_makes_one_plan_and_summary_json_names_it(planned: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    tiny = ["-q", "--device", "cpu", "--batch-size", "64", "-p", "select,rewrite", "--profile-from",
            planned / "profile.json", TINY_MLP]  # fmt: skip
    fingerprints = {}
    for run, budget in (("first", "min"), ("again", "min"), ("none", "1")):
        code, _, err = run_cli(capsys, "--budget", budget, "-o", tmp_path / run, *tiny)
        assert code == EXIT_OK, err
        summary = json.loads((tmp_path / run / "summary.json").read_text())
        fingerprints[run] = summary["plan_fingerprint"]
        assert re.fullmatch(r"[0-9a-f]{12}", fingerprints[run]), summary
    assert fingerprints["first"] == fingerprints["again"] != fingerprints["none"]
    # It is the recomputed storages themselves, not how many there are.
    chosen = {entry["storage"] for entry in json.loads((tmp_path / "first" / "plan.json").read_text())["entries"]}
    assert chosen and fingerprints["first"] == plan_fingerprint(chosen, set())
    assert fingerprints["none"] == plan_fingerprint(set(), set())


# -- --list-passes and --help --------------------------------------------------------------------
def test_list_passes_prints_every_pass_with_its_summary(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "--list-passes")
    assert code == EXIT_OK
    assert err == ""
    registry = PassRegistry()
    lines = out.splitlines()
    for name in registry.names():
        cls = registry.get(name)
        summary = cls.summary()
        assert summary, f"pass {name} has no summary"
        kind = "[transform]" if cls.is_transform else "[analysis]"
        matching = [line for line in lines if line.split()[:1] == [name]]
        assert len(matching) == 1, out
        assert kind in matching[0] and summary in matching[0]
    assert {"stats", "dce"} <= set(registry.names())


def test_list_passes_includes_loaded_passes_and_their_options(workdir: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    code, out, _ = run_cli(capsys, "-q", "--load-passes", workdir / "test_cli_passes.py", "--list-passes")
    assert code == EXIT_OK
    assert "Return its int option (test pass)." in out
    assert "    times: int = 1  how many times" in out
    assert "needs-plan" in out and "makes-plan" in out


def test_a_broken_entry_point_is_a_one_line_error(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    class BrokenEntryPoint:
        name = "broken-plugin"

        def load(self) -> type:
            raise ImportError("No module named 'mutwo_plugin_gone'")

    monkeypatch.setattr(registry_module, "entry_points",
                        lambda group: [BrokenEntryPoint()] if group == ENTRY_POINT_GROUP else [])  # fmt: skip
    code, _, err = run_cli(capsys, "--list-passes")
    line = one_line(err)
    assert code == EXIT_USAGE
    assert "broken-plugin" in line and "mutwo_plugin_gone" in line


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "--help")
    assert code == EXIT_OK
    assert out.startswith("usage: mutwo-opt")
    for flag in ("--passes", "--list-passes", "--load-passes", "--check", "--budget", "--dump-dot"):
        assert flag in out
    assert err == ""
    text = " ".join(out.split())  # argparse wraps the help
    assert "``" not in text and "mutwo-opt: capture a model's training iteration" in text
    assert f"(default: the config's 'passes', else {DEFAULT_PIPELINE})" in text
    assert "or 'min' (the lowest peak recomputation reaches); default: the config's 'budget', else" in text


def test_unknown_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = expect_usage_error(capsys, tmp_path / "out", "--frobnicate", "x.yaml")
    assert "unrecognized option '--frobnicate'" in line and "--help" in line


def test_a_stray_argument(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = expect_usage_error(capsys, tmp_path / "out", "x.yaml", "y.yaml")
    assert "unrecognized arguments: y.yaml" in line and "--help" in line
