"""``mutwo-experiment`` (:mod:`mutwo.tools.experiment` and the modules it measures, plans and plots
with), on CPU.

One real end-to-end run of ``examples/tiny_mlp.yaml`` (every configuration in its own worker
process, so it takes a few seconds per configuration), shared by the tests that read its output;
everything else runs in-process: :func:`measure_step` with fake steps, the plots from a synthetic
``results.json``, the catalogue of bad arguments and the out-of-memory skipping with a fake worker.
"""

from __future__ import annotations

import argparse
import io
import json
import math
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import mutwo.runtime.planning.captured as captured
import mutwo.runtime.planning.plan_choice as plan_choice
import mutwo.tools.experiment as experiment
import mutwo.tools.experiment_plots as experiment_plots
from mutwo.ir.registry import PassRegistry
from mutwo.runtime.planning.plan_choice import choose_measured
from mutwo.tools.cli import EXIT_OK, EXIT_USAGE
from mutwo.tools.experiment import main
from mutwo.tools.experiment_configuration import run_configuration
from mutwo.tools.experiment_measure import OUT_OF_MEMORY, device_turn, measure_step
from mutwo.tools.experiment_planning import TRANSFER_FILE
from mutwo.tools.experiment_plots import plot_all

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "examples" / "tiny_mlp.yaml"
PLOTS = ("peak_vs_batch.png", "latency_vs_batch.png", "simulated_vs_measured.png")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def rows_by_key(results: dict[str, Any]) -> dict[tuple[int, str], dict[str, Any]]:
    return {(row["batch_size"], row["variant"]): row for row in results["runs"]}


# -- an end-to-end CPU run ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, Path, dict[str, Any]]:
    """``mutwo-experiment examples/tiny_mlp.yaml --batch-sizes 32,64 --budgets 0.95``, run once."""
    out = tmp_path_factory.mktemp("experiment") / "x"
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(REPO)
        code = main(["examples/tiny_mlp.yaml", "--batch-sizes", "32,64", "--budgets", "0.95", "-o", str(out)])
    return code, out, json.loads((out / "results.json").read_text(encoding="utf-8"))


def test_cpu_run_writes_one_row_per_batch_size_and_variant(cpu_run: tuple[int, Path, dict[str, Any]]) -> None:
    code, _, results = cpu_run
    assert code == EXIT_OK
    assert results["device"] == "cpu"
    assert results["config"] == "examples/tiny_mlp.yaml"
    assert (results["warmup"], results["iterations"], results["memory_limit_bytes"]) == (3, 10, None)
    assert [(r["batch_size"], r["variant"]) for r in results["runs"]] == [
        (32, "eager"), (32, "none"), (32, "0.95"), (64, "eager"), (64, "none"), (64, "0.95")]  # fmt: skip
    for row in results["runs"]:
        if "error" in row:  # the only result allowed to be an error: a budget the tiny MLP cannot reach
            assert row["variant"] == "0.95" and "unreachable" in row["error"], row
            continue
        assert row["iteration_ms"] > 0, row
        assert len(row["iteration_ms_all"]) == 10
        assert row["peak_bytes"] is None  # no measured peak on CPU
        if row["variant"] != "eager":
            assert row["simulated_peak_bytes"] > 0, row
            assert row["planning_seconds"] > 0, row
    rows = rows_by_key(results)
    assert "error" not in rows[(64, "0.95")]  # at batch 64 the budget is reachable: a full mutwo row
    assert rows[(64, "0.95")]["simulated_peak_bytes"] < rows[(64, "none")]["simulated_peak_bytes"]


def test_cpu_run_budgets_reuse_the_profile_of_none(cpu_run: tuple[int, Path, dict[str, Any]]) -> None:
    _, out, results = cpu_run
    rows = rows_by_key(results)
    for batch in (32, 64):
        assert (out / f"b{batch}" / "profile.json").is_file()
        assert rows[(batch, "0.95")]["profile_seconds"] == rows[(batch, "none")]["profile_seconds"]


def test_cpu_run_draws_only_the_latency_plot(cpu_run: tuple[int, Path, dict[str, Any]]) -> None:
    _, out, _ = cpu_run
    latency = out / "latency_vs_batch.png"
    assert latency.is_file() and latency.read_bytes().startswith(PNG_MAGIC)
    assert not (out / "peak_vs_batch.png").exists()  # no measured peaks on CPU
    assert not (out / "simulated_vs_measured.png").exists()


def test_cpu_run_exits_ok_when_a_budget_is_unreachable_at_a_small_batch(
        cpu_run: tuple[int, Path, dict[str, Any]]) -> None:  # fmt: skip
    code, _, results = cpu_run
    row = rows_by_key(results)[(32, "0.95")]
    assert "unreachable" in row.get("error", "") and row["error_kind"] == "unreachable"
    assert code == EXIT_OK


def test_cpu_run_names_the_failed_pass_after_the_reused_profile(cpu_run: tuple[int, Path, dict[str, Any]]) -> None:
    """The budget run plans with the profile of ``none``: select fails after it, not "as the first pass"."""
    _, _, results = cpu_run
    error = rows_by_key(results)[(32, "0.95")]["error"]
    assert error.startswith("pass 'select' failed after [profile (from b32/profile.json),chunk]: budget 0.95 "), error
    assert "first pass" not in error


def test_budget_run_skips_profiling_when_none_saved_a_matching_profile(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """In-process: the budget run's pipeline is chunk,select,rewrite, not profile,chunk,select,rewrite."""
    pipelines: list[str] = []
    build_pipeline = PassRegistry.build_pipeline

    def spy(self: PassRegistry, passes: str, *args: Any, **kwargs: Any) -> Any:
        pipelines.append(passes)
        return build_pipeline(self, passes, *args, **kwargs)

    monkeypatch.setattr(PassRegistry, "build_pipeline", spy)
    monkeypatch.chdir(REPO)
    none = run_configuration(CONFIG, 64, "none", tmp_path, device="cpu")
    budget = run_configuration(CONFIG, 64, "0.95", tmp_path, device="cpu")
    assert pipelines == ["profile", "chunk,select,rewrite"]
    assert "error" not in none and "error" not in budget, (none, budget)
    assert budget["profile_seconds"] == none["profile_seconds"]
    assert budget["iteration_ms"] > 0


def test_the_unbudgeted_run_saves_the_copy_model_the_swap_runs_reuse(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The run that profiles replaces an older transfer.json with the copy model it measures; a swap
    run reusing its profile plans with that model, not one it measures itself."""
    monkeypatch.chdir(REPO)
    stale = {"d2h_bytes_per_second": 1.0, "h2d_bytes_per_second": 1.0, "latency_seconds": 0.0, "overlap": False,
             "device": "cpu", "compute_slowdown": 0.0}  # fmt: skip
    (tmp_path / "b64").mkdir()
    (tmp_path / "b64" / TRANSFER_FILE).write_text(json.dumps(stale))
    none = run_configuration(CONFIG, 64, "none", tmp_path, device="cpu", warmup=0, iterations=1)
    saved = json.loads((tmp_path / "b64" / TRANSFER_FILE).read_text())
    assert saved == none["transfer"] and saved != stale
    monkeypatch.setattr(captured, "measure_transfers", lambda device: pytest.fail("the copies were measured again"))
    swap = run_configuration(CONFIG, 64, "0.95", tmp_path, device="cpu", warmup=0, iterations=1, swap=True)
    assert "error" not in swap and swap["profile_reused"] and swap["transfer"] == saved, swap


def test_an_unplanned_run_reusing_the_profile_runs_no_pass_and_leaves_the_saved_files_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """reuse_profile (compare.py's mutwo@<backend>-none after mutwo-none): no profile pass, and
    profile.json, timing.json and transfer.json stay the profiling run's, byte for byte; a later
    profiling run first removes them, so that a failure before it saves leaves no stale profile."""
    monkeypatch.chdir(REPO)
    run_configuration(CONFIG, 64, "none", tmp_path, device="cpu", warmup=0, iterations=1)
    folder = tmp_path / "b64"
    names = ("profile.json", "timing.json", TRANSFER_FILE)
    saved = {name: (folder / name).read_bytes() for name in names}
    monkeypatch.setattr(captured, "measure_transfers", lambda device: pytest.fail("the copies were measured again"))
    reusing = run_configuration(CONFIG, 64, "none", tmp_path, device="cpu", warmup=0, iterations=1,
                                reuse_profile=True)  # fmt: skip
    assert "error" not in reusing and reusing["profile_reused"] and reusing["iteration_ms"] > 0, reusing
    assert "transfer" not in reusing and reusing["select_rewrite_seconds"] == 0
    assert {name: (folder / name).read_bytes() for name in names} == saved

    def fail_to_profile(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("profiling failed")

    monkeypatch.setattr(captured, "capture_graph", fail_to_profile)
    with pytest.raises(RuntimeError, match="profiling failed"):
        run_configuration(CONFIG, 64, "none", tmp_path, device="cpu", warmup=0, iterations=1)
    assert not any((folder / name).exists() for name in names)


# -- measure_step ---------------------------------------------------------------------------------
@pytest.mark.parametrize("failing_call", [2, 5], ids=["during-warmup", "while-measuring"])
def test_measure_step_records_out_of_memory(failing_call: int) -> None:
    calls = 0

    def step() -> None:
        nonlocal calls
        calls += 1
        if calls == failing_call:
            raise torch.OutOfMemoryError("CUDA out of memory")

    assert measure_step(step, torch.device("cpu"), warmup=3, iterations=10) == {"error": "out of memory"}
    assert calls == failing_call  # it stopped at the failure


def test_measure_step_times_every_iteration() -> None:
    calls = 0

    def step() -> None:
        nonlocal calls
        calls += 1

    row = measure_step(step, torch.device("cpu"), warmup=3, iterations=10)
    assert calls == 13
    assert row["iteration_ms"] >= 0 and "error" not in row
    assert len(row["iteration_ms_all"]) == 10
    assert row["peak_bytes"] is None


def test_measure_step_lets_other_errors_through() -> None:
    def step() -> None:
        raise ValueError("a bug in the model")

    with pytest.raises(ValueError, match="a bug in the model"):
        measure_step(step, torch.device("cpu"), warmup=3, iterations=10)


@pytest.mark.parametrize("planned", [True, False])
def test_only_a_planned_step_has_the_cache_emptied_before_it_is_measured(planned: bool,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A user's eager loop empties no cache: what its first steps left cached counts in what it holds."""
    import mutwo.tools.experiment_measure as experiment_measure

    freed: list[torch.device] = []
    monkeypatch.setattr(experiment_measure, "free_planning_leftovers", freed.append)
    row = experiment_measure.measure_after_planning(lambda: None, torch.device("cpu"), None, warmup=1, iterations=2,
                                                    planned=planned)  # fmt: skip
    assert len(row["iteration_ms_all"]) == 2
    assert freed == ([torch.device("cpu")] if planned else [])


# -- the plots, from synthetic results -------------------------------------------------------------
def synthetic_results() -> dict[str, Any]:
    mib = 2**20
    runs: list[dict[str, Any]] = []
    for batch, scale in ((8, 1), (16, 2)):
        runs.append({"batch_size": batch, "variant": "eager", "peak_bytes": 120 * scale * mib,
                     "iteration_ms": 10.0 * scale})  # fmt: skip
        runs.append({"batch_size": batch, "variant": "none", "peak_bytes": 100 * scale * mib,
                     "simulated_peak_bytes": 95 * scale * mib, "iteration_ms": 11.0 * scale})  # fmt: skip
    runs.append({"batch_size": 8, "variant": "0.5", "peak_bytes": 55 * mib, "simulated_peak_bytes": 50 * mib,
                 "iteration_ms": 13.0})  # fmt: skip
    runs.append({"batch_size": 16, "variant": "0.5", "error": OUT_OF_MEMORY})
    return {"model": "synthetic", "device": "NVIDIA H100", "memory_limit_bytes": 200 * mib, "runs": runs}


def test_plot_all_writes_the_three_plots(tmp_path: Path) -> None:
    written = plot_all(synthetic_results(), tmp_path)
    assert written == list(PLOTS)
    for name in PLOTS:
        data = (tmp_path / name).read_bytes()
        assert len(data) > 1000 and data.startswith(PNG_MAGIC), name


def test_plot_all_without_eager_and_without_peaks(tmp_path: Path) -> None:
    results = synthetic_results()
    results["runs"] = [{**row, "peak_bytes": None} for row in results["runs"] if row["variant"] != "eager"]
    assert plot_all(results, tmp_path) == ["latency_vs_batch.png"]  # overheads against "none"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latency_vs_batch.png"]


# -- --help ----------------------------------------------------------------------------------------
def test_help_states_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    """The defaults a sweep depends on are in --help, with the values the parser really uses."""
    assert main(["--help"]) == EXIT_OK
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps to the terminal's width
    parser = experiment.build_parser()
    for option in ("budgets", "warmup", "iterations", "timeout"):
        assert f"(default: {parser.get_default(option)})" in text, option
    assert "(default: 0.7,0.5)" in text
    for default in ("default: no cap", "(default: mutwo-out/experiment-<config name>)", "(default: the config's)"):
        assert default in text, default
    assert "``" not in text  # the description is plain text, not reStructuredText


def crowded_results() -> dict[str, Any]:
    """16 long batch sizes of one variant, with peaks in the hundred thousands of MiB: narrow bars, long labels."""
    runs = [{"batch_size": batch, "variant": "none", "peak_bytes": batch * 2**20 // 10,
             "simulated_peak_bytes": batch * 2**20 // 11, "iteration_ms": batch / 1e3}
            for batch in range(100_000, 1_700_000, 100_000)]  # fmt: skip
    return {"model": "crowded", "device": "NVIDIA H100", "memory_limit_bytes": None, "runs": runs}


def drawn_figures(results: dict[str, Any], out: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The figures plot_all draws, by file name, kept open to read their tick labels."""
    figures: list[Any] = []
    monkeypatch.setattr(experiment_plots.plt, "close", figures.append)
    written = plot_all(results, out)
    monkeypatch.undo()
    return dict(zip(written, figures, strict=True))


def colliding_xticks(figure: Any) -> list[tuple[str, str]]:
    """Neighbouring x tick labels whose text overlaps: their boxes, when level; when turned, they are parallel and
    apart by the ticks' spacing times the angle's sine, which must exceed the text's height."""
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    axes = figure.axes[0]
    low, high = sorted(axes.get_xlim())
    labels = sorted(((label.get_position()[0], label) for label in axes.get_xticklabels()
                     if label.get_visible() and label.get_text() and low <= label.get_position()[0] <= high),
                    key=lambda item: item[0])  # fmt: skip
    collisions = []
    for (x_a, a), (x_b, b) in pairwise(labels):
        angle = math.radians(a.get_rotation())
        if angle == 0:
            apart = a.get_window_extent(renderer).x1 < b.get_window_extent(renderer).x0
        else:
            spacing = axes.transData.transform((x_b, 0))[0] - axes.transData.transform((x_a, 0))[0]
            apart = spacing * math.sin(angle) > a.get_fontsize() * figure.dpi / 72
        if not apart:
            collisions.append((a.get_text(), b.get_text()))
    return collisions


def test_plots_keep_crowded_x_labels_apart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Many long batch sizes (and MiB values): the labels turn rather than overlap; the bars stay."""
    figures = drawn_figures(crowded_results(), tmp_path, monkeypatch)
    try:
        assert list(figures) == list(PLOTS)
        for name, figure in figures.items():
            assert colliding_xticks(figure) == [], name
        peaks = figures["peak_vs_batch.png"].axes[0]
        assert {label.get_rotation() for label in peaks.get_xticklabels()} == {45.0}  # turned, every batch named
        assert [label.get_text() for label in peaks.get_xticklabels()] == [str(b) for b in range(100_000, 1_700_000,
                                                                                                  100_000)]  # fmt: skip
        assert [bar.get_height() for bar in peaks.patches] == [b / 10 for b in range(100_000, 1_700_000, 100_000)]
    finally:
        experiment_plots.plt.close("all")


def test_x_labels_too_many_to_turn_are_thinned() -> None:
    """Upright labels that still overlap: every k-th is kept, the first among them; no bar is dropped."""
    figure, axes = experiment_plots.plt.subplots(figsize=(3, 2))
    try:
        axes.bar(range(60), range(60))
        axes.set_xticks(range(60), [str(1000 + i) for i in range(60)])
        figure.tight_layout()
        assert experiment_plots._readable_xticks(figure, axes)
        labels = axes.get_xticklabels()
        assert {label.get_rotation() for label in labels} == {90.0}
        assert 1 < len(labels) < 60 and labels[0].get_text() == "1000"
        assert colliding_xticks(figure) == []
        assert len(axes.patches) == 60
    finally:
        experiment_plots.plt.close("all")


def test_plots_leave_few_x_labels_level(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    figures = drawn_figures(synthetic_results(), tmp_path, monkeypatch)
    try:
        for name, figure in figures.items():
            assert {label.get_rotation() for label in figure.axes[0].get_xticklabels()} == {0.0}, name
            assert colliding_xticks(figure) == [], name
    finally:
        experiment_plots.plt.close("all")


# -- bad input: one line, exit code 2, nothing written -------------------------------------------
# (arguments, words the error line must contain)
BAD_INPUT = {
    "missing-config": (["{tmp}/nope.yaml", "--batch-sizes", "32"], ["nope.yaml", "does not exist"]),
    "batch-size-zero": (["{config}", "--batch-sizes", "0"], ["--batch-sizes", "positive integer, got 0"]),
    "batch-sizes-not-numbers": (["{config}", "--batch-sizes", "a,b"], ["--batch-sizes", "positive integer"]),
    "ambiguous-budget": (["{config}", "--batch-sizes", "32", "--budgets", "2.5"], ["--budgets", "ambiguous"]),
    "negative-budget": (["{config}", "--batch-sizes", "32", "--budgets", "-1"], ["--budgets", "positive"]),
    "memory-limit-fraction": (["{config}", "--batch-sizes", "32", "--memory-limit", "0.5"],
                              ["--memory-limit", "is not a memory size: give bytes with a unit", "16GiB"]),
    "memory-limit-on-cpu": (["{config}", "--batch-sizes", "32", "--device", "cpu", "--memory-limit", "16GiB"],
                            ["--memory-limit caps CUDA memory", "on the CPU", "drop --memory-limit", "--device cuda"]),
    "warmup-too-small": (["{config}", "--batch-sizes", "32", "--warmup", "1"], ["--warmup must be at least 3"]),
    "iterations-too-few": (["{config}", "--batch-sizes", "32", "--iterations", "5"], ["--iterations at least 10"]),
    "accumulation-steps": (["{accumulating}", "--batch-sizes", "32"],
                           ["accumulation_steps: 2", "whole optimizer steps", "set it to 1", "mutwo-opt"]),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_input(case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                   capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    template, words = BAD_INPUT[case]
    accumulating = tmp_path / "accumulating.yaml"  # the tiny config, stepping the optimizer every 2 batches
    accumulating.write_text(CONFIG.read_text(encoding="utf-8") + "accumulation_steps: 2\n", encoding="utf-8")
    argv = [a.format(tmp=tmp_path, config=CONFIG, accumulating=accumulating) for a in template]
    out = tmp_path / "out"
    monkeypatch.chdir(tmp_path)  # so that a default output folder would land here too
    code = main([*argv, "-o", str(out)])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    lines = captured.err.splitlines()
    assert len(lines) == 1, f"expected exactly one line on stderr, got:\n{captured.err}"
    assert lines[0].startswith("mutwo-experiment: error: "), lines[0]
    for word in words:
        assert word in lines[0], lines[0]
    assert code == EXIT_USAGE
    assert captured.out == ""
    assert not out.exists()
    assert not (tmp_path / "mutwo-out").exists()


# -- out of memory: larger batches of that variant are skipped -------------------------------------
@pytest.fixture
def fake_worker(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, str]]:
    """Replace the worker process: eager runs out of memory at batch 32, everything else runs."""
    calls: list[tuple[int, str]] = []

    def run_worker(args: argparse.Namespace, batch_size: int, variant: str, out: Path) -> dict[str, Any]:
        calls.append((batch_size, variant))
        if variant == "eager" and batch_size == 32:
            return {"batch_size": batch_size, "variant": variant, "error": OUT_OF_MEMORY}
        return {"batch_size": batch_size, "variant": variant, "iteration_ms": 1.0, "peak_bytes": None}

    monkeypatch.setattr(experiment, "_run_worker", run_worker)
    monkeypatch.chdir(REPO)
    return calls


def test_out_of_memory_skips_larger_batches(fake_worker: list[tuple[int, str]], tmp_path: Path) -> None:
    out = tmp_path / "x"
    code = main(["examples/tiny_mlp.yaml", "--batch-sizes", "32,64", "--budgets", "0.95", "-o", str(out)])
    assert code == EXIT_OK  # running out of memory is a result, not a failure
    assert fake_worker == [(32, "eager"), (32, "none"), (32, "0.95"), (64, "none"), (64, "0.95")]
    rows = rows_by_key(json.loads((out / "results.json").read_text(encoding="utf-8")))
    assert len(rows) == 6
    assert rows[(32, "eager")]["error"] == OUT_OF_MEMORY
    assert rows[(64, "eager")]["error"].startswith("skipped")
    assert rows[(64, "none")]["iteration_ms"] == 1.0 and rows[(64, "0.95")]["iteration_ms"] == 1.0
    assert (out / "latency_vs_batch.png").is_file()


def test_keep_going_after_oom_measures_larger_batches(fake_worker: list[tuple[int, str]], tmp_path: Path) -> None:
    out = tmp_path / "x"
    code = main(["examples/tiny_mlp.yaml", "--batch-sizes", "32,64", "--budgets", "0.95", "-o", str(out),
                 "--keep-going-after-oom"])  # fmt: skip
    assert code == EXIT_OK
    assert (64, "eager") in fake_worker
    rows = rows_by_key(json.loads((out / "results.json").read_text(encoding="utf-8")))
    assert rows[(64, "eager")] == {"batch_size": 64, "variant": "eager", "iteration_ms": 1.0, "peak_bytes": None}


class Terminal(io.StringIO):
    """A stderr that says it is a terminal."""

    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("terminal", [False, True], ids=["log-file", "terminal"])
def test_progress_redraws_a_bar_only_on_a_terminal(terminal: bool, fake_worker: list[tuple[int, str]], tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """Off a terminal (a log file, CI), one plain line per configuration and no carriage return."""
    stderr = Terminal() if terminal else io.StringIO()
    monkeypatch.setattr("sys.stderr", stderr)
    code = main(["examples/tiny_mlp.yaml", "--batch-sizes", "16", "--budgets", "0.95", "-o", str(tmp_path / "x")])
    assert code == EXIT_OK
    text = stderr.getvalue()
    plain = ["mutwo-experiment: [1/3] batch 16, eager", "mutwo-experiment: [2/3] batch 16, none",
             "mutwo-experiment: [3/3] batch 16, 0.95"]  # fmt: skip
    if terminal:
        assert "\r" in text and "3/3" in text and not any(line in text for line in plain)
    else:
        assert "\r" not in text, text
        assert text.splitlines()[:3] == plain
        assert text.splitlines()[3].startswith("mutwo-experiment: wrote ")
    assert capsys.readouterr().out.splitlines()[0].startswith("batch   16    eager: ")  # each result, on stdout


def test_out_of_memory_while_planning_also_skips(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls: list[tuple[int, str]] = []

    def run_worker(args: argparse.Namespace, batch_size: int, variant: str, out: Path) -> dict[str, Any]:
        calls.append((batch_size, variant))
        if variant == "none":
            return {"batch_size": batch_size, "variant": variant, "error": f"{OUT_OF_MEMORY} while planning"}
        return {"batch_size": batch_size, "variant": variant, "iteration_ms": 1.0, "peak_bytes": None}

    monkeypatch.setattr(experiment, "_run_worker", run_worker)
    monkeypatch.chdir(REPO)
    code = main(["examples/tiny_mlp.yaml", "--batch-sizes", "16,32", "--budgets", "", "--no-eager",
                 "-o", str(tmp_path / "x")])  # fmt: skip
    assert code == EXIT_OK
    assert calls == [(16, "none")]
    rows = rows_by_key(json.loads((tmp_path / "x" / "results.json").read_text(encoding="utf-8")))
    assert rows[(32, "none")]["error"].startswith("skipped")


# -- the measured choice between select-swap's plan and recompute only ------------------------------
FAST_COPIES = {"d2h_bytes_per_second": 1e13, "h2d_bytes_per_second": 1e13, "latency_seconds": 0.0, "overlap": True,
               "device": "cpu", "compute_slowdown": 0.0}  # fmt: skip


@pytest.mark.parametrize("faster", ["recompute only", "swap+recompute"])
def test_a_measured_choice_keeps_the_plan_that_ran_faster(
        faster: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        evenly_timed: Callable[[ModuleType], None]) -> None:  # fmt: skip
    """With copies priced free (a GPU's copy model on the CPU), select-swap's plan swaps; the
    measured choice compiles the recompute-only plan at its budget too, measures both, and the row
    and the measured step are those of the plan measured faster (here made so by scaling the
    measured times: the CPU's own would decide by noise)."""
    monkeypatch.chdir(REPO)
    evenly_timed(captured)  # every node at 1 ms: the swaps are predicted faster whatever this machine's load
    none = run_configuration(CONFIG, 512, "none", tmp_path, device="cpu", warmup=0, iterations=1)
    assert "error" not in none, none
    (tmp_path / "b512" / TRANSFER_FILE).write_text(json.dumps(FAST_COPIES))
    measured = plan_choice.measure_iterations
    seconds = {"swap+recompute": 1.0, "recompute only": 1.0}
    seconds[{"recompute only": "swap+recompute", "swap+recompute": "recompute only"}[faster]] = 3.0
    order = iter(["swap+recompute", "recompute only"])  # the order the choice measures its candidates in

    def scaled(run: Any, inputs: list[torch.Tensor], **kwargs: Any) -> Any:
        result = measured(run, inputs, **kwargs)
        return type(result)(seconds[next(order)], result.peak_bytes, result.runs)

    monkeypatch.setattr(plan_choice, "measure_iterations", scaled)
    row = run_configuration(CONFIG, 512, "0.85", tmp_path, device="cpu", warmup=0, iterations=1, swap=True,
                            backend="inductor", measure_choice=True)  # fmt: skip
    assert "error" not in row, row
    choice = row["measured_choice"]
    assert choice["kept"] == faster, choice
    assert [c["plan"] for c in choice["candidates"]] == ["swap+recompute", "recompute only"]
    assert choice["candidates"][0]["swapped_tensors"] > 0 and choice["candidates"][1]["swapped_tensors"] == 0
    assert ("swapped_tensors" in row) == (faster == "swap+recompute")  # the row describes the kept plan
    assert row["iteration_ms"] > 0


def test_a_measured_choice_is_refused_for_the_eager_backend(tmp_path: Path) -> None:
    row = run_configuration(CONFIG, 64, "0.9", tmp_path, device="cpu", warmup=0, iterations=1, swap=True,
                            measure_choice=True)  # fmt: skip
    assert row["error_kind"] == "backend" and "for compiled backends" in row["error"]


@pytest.mark.parametrize(("peaks", "times", "kept"), [
    ([100, 100], [2.0, 1.0], 1),  # both fit: the faster
    ([100, 100], [1.0, 2.0], 0),
    ([100, 100], [1.0, 1.0], 1),  # a tie: recompute only (last)
    ([103, 90], [1.0, 2.0], 0),  # 3% over the budget still fits
    ([104, 90], [1.0, 2.0], 1),  # over it: the one that fits, though slower
    ([120, 110], [1.0, 2.0], 1),  # neither fits: the lower peak
    ([None, None], [2.0, 1.0], 1),  # no peaks measured (the CPU): by time
])  # fmt: skip
def test_choose_measured(peaks: list[int | None], times: list[float], kept: int) -> None:
    measured = [{"peak_bytes": p, "iteration_ms": t} for p, t in zip(peaks, times, strict=True)]
    assert choose_measured(measured, 100, 0.03) == kept


@pytest.mark.cuda
def test_cuda_a_measured_choice_under_cuda_graphs_calibrates_and_measures_both_plans(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """On the GPU under inductor-cudagraphs: both plans are calibrated (their recordings' peaks
    measured, each recording released before the next), both measured alone, and the kept one is
    recorded again and measured; the row carries both measurements and the calibration."""
    monkeypatch.chdir(REPO)
    none = run_configuration(CONFIG, 512, "none", tmp_path, device="cuda", warmup=1, iterations=2,
                             backend="cudagraphs")  # fmt: skip
    assert "error" not in none, none
    (tmp_path / "b512" / TRANSFER_FILE).write_text(json.dumps({**FAST_COPIES, "device": "cuda:0"}))
    row = run_configuration(CONFIG, 512, "0.85", tmp_path, device="cuda", warmup=1, iterations=3, swap=True,
                            backend="inductor-cudagraphs", calibrate_peak=1, measure_choice=True)  # fmt: skip
    assert "error" not in row, row
    choice = row["measured_choice"]
    assert choice["kept"] in ("swap+recompute", "recompute only"), choice
    assert all(c["peak_bytes"] > 0 and c["iteration_ms"] > 0 for c in choice["candidates"]), choice
    assert row["calibration"]["rounds"] and row["peak_bytes"] > 0 and row["iteration_ms"] > 0


def test_device_turn_lets_one_process_measure_at_a_time(tmp_path: Path) -> None:
    """Two processes planning side by side: the second waits for the first's lock on the file."""
    import subprocess
    import sys
    import time

    lock = tmp_path / "device.lock"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom pathlib import Path\n"
                               "from mutwo.tools.experiment_measure import device_turn\n"
                               f"with device_turn(Path({str(lock)!r})):\n"
                               "    print('held', flush=True)\n    time.sleep(1.5)\n"],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    started = time.monotonic()
    with device_turn(lock):
        waited = time.monotonic() - started
    holder.wait(timeout=30)
    assert waited > 0.5, waited
    with device_turn(None):  # nothing to share the device with: no file, no wait
        pass
