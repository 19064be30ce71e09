"""bench/compare.py's own logic, on CPU: which blocks it checkpoints and which budget each mutwo variant plans for."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
import torchvision

from mutwo.ir.budget import Budget

_PATH = Path(__file__).resolve().parent.parent / "bench" / "compare.py"
_SPEC = importlib.util.spec_from_file_location("bench_compare", _PATH)
assert _SPEC is not None and _SPEC.loader is not None
compare = importlib.util.module_from_spec(_SPEC)
sys.modules["bench_compare"] = compare
_SPEC.loader.exec_module(compare)

# held_bytes (max reserved) is what budgets name; peak_bytes (max allocated) is only reported beside it
ROWS = [{"variant": "eager", "peak_bytes": 900, "held_bytes": 1000},
        {"variant": "checkpoint", "peak_bytes": 300, "held_bytes": 400},
        {"variant": "compile-0.5", "peak_bytes": 650, "held_bytes": 700}]


@pytest.fixture(autouse=True)
def no_allocator_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """No allocator settings in the environment, and none left behind: compare.main() sets them
    for its workers."""
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.setenv(name, "")  # remembered as unset, so that it is unset again afterwards
        monkeypatch.delenv(name)


def test_every_variant_gets_the_same_allocator() -> None:
    assert compare.equal_allocators(None) == "expandable_segments:True"  # as mutwo sets it in its own processes
    assert compare.os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"  # the workers inherit it
    del compare.os.environ["PYTORCH_CUDA_ALLOC_CONF"]
    assert compare.equal_allocators("default") == "expandable_segments:False"


def test_allocator_settings_already_given_are_used_and_not_contradicted(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    assert compare.equal_allocators(None) == "max_split_size_mb:128"
    monkeypatch.setattr(sys, "argv", ["compare.py", "--models", "tiny:4", "--variants", "eager", "--allocator",
                                      "expandable"])  # fmt: skip
    with pytest.raises(SystemExit) as exited:
        compare.main()
    error = capsys.readouterr().err
    assert exited.value.code == 2 and "PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:128 is set already" in error


def test_budgets_name_measured_peaks_or_pass_through() -> None:
    assert compare.mutwo_budget("checkpoint", ROWS) == Budget(bytes=400)
    assert compare.mutwo_budget("eager0.5", ROWS) == Budget(bytes=500)
    assert compare.mutwo_budget("0.7", ROWS) == "0.7"
    assert compare.mutwo_budget("min", ROWS) == "min"
    assert compare.mutwo_budget("compile0.5", ROWS) == Budget(bytes=700)


def test_backend_variants_name_their_backend_and_budget() -> None:
    assert compare.mutwo_variant("mutwo-0.5") == ("0.5", "eager", False, False)
    assert compare.mutwo_variant("mutwo+opt-none") == ("none", "eager", True, False)
    assert compare.mutwo_variant("mutwo@inductor-compile0.5") == ("compile0.5", "inductor", False, False)
    assert compare.mutwo_variant("mutwo@inductor-cudagraphs-none") == ("none", "inductor-cudagraphs", False, False)
    assert compare.mutwo_variant("mutwo-swap-eager0.5") == ("eager0.5", "eager", False, True)
    assert compare.mutwo_variant("mutwo-swap@inductor-0.5") == ("0.5", "inductor", False, True)
    assert compare.mutwo_variant("compile-0.5") is None
    assert compare.budget_spec("mutwo@inductor-cudagraphs-compile0.5") == "compile0.5"


def test_compile_variants_name_their_mode_and_activation_budget() -> None:
    assert compare.compile_variant("compile-0.5") == (None, 0.5)
    assert compare.compile_variant("compile@reduce-overhead-0.5") == ("reduce-overhead", 0.5)
    assert compare.compile_variant("compile-1.0") == (None, 1.0)
    assert compare.compile_variant("mutwo@inductor-compile0.5") is None


def test_a_budget_naming_an_unmeasured_variant_is_refused() -> None:
    with pytest.raises(ValueError, match="needs the checkpoint variant measured first"):
        compare.mutwo_budget("checkpoint", ROWS[:1])


def test_a_reference_row_without_held_memory_is_refused_not_read_as_held() -> None:
    old = [{"variant": "checkpoint", "peak_bytes": 400}]  # a row measured before held memory was recorded
    with pytest.raises(ValueError, match="allocated peak but no held memory"):
        compare.mutwo_budget("checkpoint", old)


def test_a_cpu_dry_run_plans_for_the_stand_in_budget_only_where_asked() -> None:
    cpu = [{"variant": "eager", "peak_bytes": None, "held_bytes": None},
           {"variant": "checkpoint", "peak_bytes": None, "held_bytes": None}]
    assert compare.mutwo_budget("checkpoint", cpu, "0.5") == "0.5"
    assert compare.mutwo_budget("checkpoint", ROWS, "0.5") == Budget(bytes=400), "a measured peak wins"
    with pytest.raises(ValueError, match="needs the checkpoint variant measured first"):
        compare.mutwo_budget("checkpoint", cpu)
    with pytest.raises(ValueError, match="needs the checkpoint variant measured first"):
        compare.mutwo_budget("checkpoint", [{"variant": "checkpoint", "error": "out of memory"}], "0.5")


def test_a_model_is_a_known_name_or_a_config_file(tmp_path: Path) -> None:
    assert compare.config_path("bert") == compare.ROOT / "examples" / "bert.yaml"
    assert compare.config_path(str(tmp_path / "my.yaml")) == tmp_path / "my.yaml"


def test_every_residual_block_is_checkpointed_and_the_numbers_stay_the_same() -> None:
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    batch = torch.randn(2, 3, 32, 32)
    model.eval()  # batch norm statistics must not move between the two forwards
    expected = model(batch)
    assert compare.checkpoint_blocks(model) == 8  # resnet18: 4 stages of 2 BasicBlocks
    wrapped = [m for m in model.modules() if isinstance(m, compare.Checkpointed)]
    assert len(wrapped) == 8
    batch.requires_grad_(True)
    output = model(batch)
    assert torch.equal(output, expected)
    output.sum().backward()
    assert batch.grad is not None


def test_variant_names_give_their_budget_and_the_swap_study_compares_both_plans_at_both_peaks() -> None:
    assert compare.budget_spec("mutwo-swap-eager0.5") == "eager0.5"
    assert compare.budget_spec("mutwo+opt-checkpoint") == "checkpoint"
    assert compare.budget_spec("mutwo-0.5") == "0.5"
    assert compare.budget_spec("checkpoint") is None
    study = compare.PRESETS["swap-study"]
    for spec in ("eager0.5", "checkpoint"):
        assert {f"mutwo-{spec}", f"mutwo-swap-{spec}"} <= set(study)
        # the measured variant a budget names runs before it
        reference = "eager" if spec.startswith("eager") else "checkpoint"
        assert study.index(reference) < study.index(f"mutwo-swap-{spec}")
    planned = [i for i, v in enumerate(study) if compare.budget_spec(v) not in (None, "none")]
    assert study.index("mutwo-none") < min(planned)  # it profiles once, the planned variants reuse the profile


def test_bad_iteration_counts_are_usage_errors(monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    monkeypatch.setattr(sys, "argv", ["compare.py", "--models", "tiny:4", "--variants", "eager", "--iterations", "0"])
    with pytest.raises(SystemExit) as exited:
        compare.main()
    assert exited.value.code == 2 and "--iterations at least 1" in capsys.readouterr().err


def test_a_memory_limit_that_is_not_a_size_is_a_usage_error(monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    monkeypatch.setattr(sys, "argv", ["compare.py", "--models", "tiny:4", "--variants", "eager", "--memory-limit",
                                      "sixteen"])  # fmt: skip
    with pytest.raises(SystemExit) as exited:
        compare.main()
    assert exited.value.code == 2 and "--memory-limit: 'sixteen' is not a memory size" in capsys.readouterr().err


def test_the_memory_limit_reaches_every_worker() -> None:
    args = argparse.Namespace(out=None, precision=None, trace=False, isolate_profile=False, calibrate_peak=0,
                              measure_choice=False, warmup=3, iterations=10, memory_limit="12GiB")  # fmt: skip
    for variant in ("eager", "compile-0.5", "mutwo@inductor-cudagraphs-checkpoint"):
        argv = compare.worker_argv(args, "tiny", "4", variant, "")
        assert argv[argv.index("--memory-limit") + 1] == "12GiB", argv
    assert "--memory-limit" not in compare.worker_argv(argparse.Namespace(**{**vars(args), "memory_limit": None}),
                                                       "tiny", "4", "eager", "")  # fmt: skip


def test_the_plain_loop_yardstick_trains_the_config_as_a_user_writes_it() -> None:
    """bench/plain_loop.py on the CPU: its row (memory is measured on CUDA only)."""
    sys.path.insert(0, str(compare.ROOT / "bench"))
    spec = importlib.util.spec_from_file_location("bench_plain_loop", compare.ROOT / "bench" / "plain_loop.py")
    assert spec is not None and spec.loader is not None
    plain = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plain)
    row = plain.plain_loop(str(compare.ROOT / "examples" / "tiny_mlp.yaml"), 8, "eager", warmup=1, steps=3)
    assert len(row["iteration_ms_all"]) == 3 and row["iteration_ms"] > 0
    assert row["peak_bytes"] is None and row["held_bytes"] is None and row["gpu"] == "cpu"


def test_a_cpu_dry_run_of_the_swap_study_plans_and_runs_every_variant_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """What the GPU campaign runs, at a stand-in budget and one measured iteration per variant."""
    out = tmp_path / "study.json"
    monkeypatch.setattr(sys, "argv", ["compare.py", "--models", "tiny:512", "--out", str(out), "--stand-in-budget",
                                      "0.9", "--warmup", "0", "--iterations", "1", "--variants",
                                      "eager,mutwo-none,mutwo-eager0.5,mutwo-swap-eager0.5"])  # fmt: skip
    compare.main()
    written = json.loads(out.read_text())
    assert written["allocator"] == "expandable_segments:True"
    rows = {r["variant"]: r for r in written["runs"]}
    assert all("error" not in r and len(r["iteration_ms_all"]) == 1 for r in rows.values()), rows
    swap = rows["mutwo-swap-eager0.5"]
    assert swap["stand_in_budget"] == "0.9" and "swapped_tensors" in swap and swap["alternative_plan"] is not None
    assert swap["profile_seconds"] == rows["mutwo-none"]["profile_seconds"]  # the profile was reused


@pytest.mark.slow
def test_the_fused_pricing_ab_runs_each_configuration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/fused_pricing_ab.py on the tiny config (CPU, Inductor's C++ backend): a row per
    configuration, each planned and compiled in a worker with its switches set, none failing."""
    spec = importlib.util.spec_from_file_location("fused_pricing_ab", _PATH.parent / "fused_pricing_ab.py")
    assert spec is not None and spec.loader is not None
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    out = tmp_path / "ab.json"
    monkeypatch.setattr(sys, "argv", ["fused_pricing_ab.py", "--out", str(out), "--model", "tiny:4",
                                      "--budget-bytes", str(10**9), "--timeout", "300"])  # fmt: skip
    ab.main()
    rows = json.loads(out.read_text())["runs"]
    assert [row["config"] for row in rows] == list(ab.CONFIGS)
    assert all("error" not in row and row["backend"] == "inductor" for row in rows), rows


def test_parallel_planning_plans_the_rows_together_then_measures_each_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """--parallel-planning on the tiny config: both planned rows reuse mutwo-none's profile and copy
    model, both have planned before either is measured, and they are measured one after the other, in order."""
    out = tmp_path / "parallel.json"
    monkeypatch.setattr(sys, "argv", ["compare.py", "--models", "tiny:512", "--out", str(out), "--stand-in-budget",
                                      "0.9", "--warmup", "0", "--iterations", "1", "--parallel-planning", "2",
                                      "--sample-stacks", str(tmp_path / "stacks"),
                                      "--variants", "eager,mutwo-none,mutwo-eager0.5,mutwo-swap-eager0.5"])  # fmt: skip
    compare.main()
    runs = json.loads(out.read_text())["runs"]
    assert [r["variant"] for r in runs] == ["eager", "mutwo-none", "mutwo-eager0.5", "mutwo-swap-eager0.5"]
    assert all("error" not in r for r in runs), runs
    first, second = runs[2:]
    assert first["planned_in_parallel"] and second["planned_in_parallel"] and "planned_in_parallel" not in runs[1]
    assert first["profile_reused"] and second["profile_reused"] and not runs[1]["profile_reused"]
    assert max(first["planned_at"], second["planned_at"]) <= first["measured_from"]
    assert first["measured_from"] < first["measured_until"] <= second["measured_from"] < second["measured_until"]
    # --sample-stacks: each mutwo row's planning sampled, up to its measurement; none for eager
    for row in runs[1:]:
        folded = Path(row["sampled_stacks"]).read_text()
        assert folded.endswith("\n") and "run_configuration" in folded, folded[:500]
    assert sorted(p.name for p in (tmp_path / "stacks").iterdir()) == sorted(
        f"tiny_b512_{variant}.folded" for variant in ("mutwo-none", "mutwo-eager0.5", "mutwo-swap-eager0.5"))
    assert second["transfer"] == runs[1]["transfer"]  # priced with the copy model mutwo-none measured


@pytest.mark.parametrize(("extra", "message"), [
    (["--variants", "eager,mutwo-eager0.5,mutwo-swap-eager0.5"], "mutwo-eager0.5 would profile beside"),
    (["--variants", "eager,mutwo-none,mutwo@cudagraphs-eager0.5"], "mutwo@cudagraphs-eager0.5 would profile beside"),
    (["--variants", "mutwo@cudagraphs-none,mutwo-none,mutwo@cudagraphs-eager0.5"], "would profile beside"),
    (["--variants", "eager", "--parallel-planning", "0"], "must be at least 1"),
])  # fmt: skip
def test_parallel_planning_refuses_rows_that_would_measure_while_others_compile(
        extra: list[str], message: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    argv = ["compare.py", "--models", "tiny:4", "--parallel-planning", "2", *extra]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exited:
        compare.main()
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_planning_groups_join_consecutive_planned_rows_only() -> None:
    variants = ["eager", "mutwo-none", "mutwo-eager0.5", "mutwo-swap-eager0.5", "checkpoint", "mutwo-checkpoint"]
    assert compare.planning_groups(variants, 4) == [["eager"], ["mutwo-none"],
                                                    ["mutwo-eager0.5", "mutwo-swap-eager0.5"],
                                                    ["checkpoint"], ["mutwo-checkpoint"]]  # fmt: skip
    assert compare.planning_groups(variants, 1) == [[v] for v in variants]


def test_parallel_planning_keeps_the_variants_order_with_a_refused_budget_and_a_relative_out(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A budget naming an unmeasured variant is refused in its place among the rows planned
    together, and an --out relative to a folder other than the repository's is where the workers
    share their profile and wait at their gates (they run in the repository)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["compare.py", "--models", "tiny:512", "--out", "rel.json", "--stand-in-budget",
                                      "0.9", "--warmup", "0", "--iterations", "1", "--parallel-planning", "2",
                                      "--variants", "eager,mutwo-none,mutwo-eager0.5,mutwo-checkpoint,"
                                      "mutwo-swap-eager0.5"])  # fmt: skip
    compare.main()
    runs = json.loads((tmp_path / "rel.json").read_text())["runs"]
    assert [r["variant"] for r in runs] == ["eager", "mutwo-none", "mutwo-eager0.5", "mutwo-checkpoint",
                                            "mutwo-swap-eager0.5"]  # fmt: skip
    assert "needs the checkpoint variant measured first" in runs[3]["error"]
    assert all("error" not in r and r["planned_in_parallel"] for r in (runs[2], runs[4])), runs
    assert (tmp_path / "rel" / "tiny_mlp" / "b512" / "profile.json").is_file()
    assert not (compare.ROOT / "rel").exists()


def test_calibration_and_the_measured_choice_reach_the_workers() -> None:
    args = argparse.Namespace(out=None, precision=None, trace=False, isolate_profile=False, calibrate_peak=1,
                              measure_choice=True, warmup=3, iterations=10)  # fmt: skip
    argv = compare.worker_argv(args, "tiny", "4", "mutwo-swap@inductor-cudagraphs-0.5", "")
    assert "--measure-choice" in argv and argv[argv.index("--calibrate-peak") + 1] == "1"
    assert "--measure-choice" not in compare.worker_argv(argparse.Namespace(**{**vars(args), "measure_choice": False}),
                                                         "tiny", "4", "mutwo-0.5", "")  # fmt: skip


def test_an_unplanned_row_after_one_of_its_capture_reuses_its_profile_and_plans_beside_the_others() -> None:
    variants = ["eager", "mutwo@cudagraphs-none", "mutwo@inductor-cudagraphs-none", "mutwo@inductor-cudagraphs-0.5",
                "mutwo-swap@inductor-cudagraphs-0.5", "mutwo-none", "mutwo@inductor-none"]  # fmt: skip
    reusing = [compare.reuses_profile(v, variants[:i]) for i, v in enumerate(variants)]
    assert reusing == [False, False, True, True, True, False, True]
    assert not compare.reuses_profile("mutwo@inductor-none", ["mutwo@cudagraphs-none"])  # another capture
    assert compare.planning_groups(variants, 4) == [["eager"], ["mutwo@cudagraphs-none"], variants[2:5],
                                                    ["mutwo-none"], ["mutwo@inductor-none"]]  # fmt: skip
    assert compare.unplanned_reusing(variants) == [False, False, True, False, False, False, True]
    # by position: of a variant named twice, only the later one reuses
    assert compare.unplanned_reusing(["mutwo-none", "mutwo-0.5", "mutwo-none"]) == [False, False, True]
    args = argparse.Namespace(out=None, precision=None, trace=False, isolate_profile=False, calibrate_peak=0,
                              measure_choice=False, warmup=3, iterations=10)  # fmt: skip
    assert "--reuse-profile" in compare.worker_argv(args, "tiny", "4", variants[2], "", True)
    assert "--reuse-profile" not in compare.worker_argv(args, "tiny", "4", variants[1], "")


def test_a_compiled_rows_prediction_is_anchored_to_its_backends_unplanned_step() -> None:
    anchor = {"model": "m", "batch_size": 2, "variant": "mutwo@inductor-none", "iteration_ms": 90.0}
    choice = {"kept": "recompute only", "candidates": [{"plan": "swap+recompute", "predicted_iteration_ms": 110.0},
                                                       {"plan": "recompute only", "predicted_iteration_ms": 120.0}]}
    row = {"model": "m", "batch_size": 2, "variant": "mutwo-swap@inductor-0.5", "profiled_iteration_ms": 100.0,
           "predicted_iteration_ms": 120.0, "measured_choice": choice}  # fmt: skip
    fields = compare.anchored_prediction(row, [anchor])
    assert fields["anchor_variant"] == "mutwo@inductor-none" and fields["anchor_iteration_ms"] == 90.0
    assert fields["predicted_anchored_ms"] == 108.0  # 90 ms x 120 / 100
    assert [c["predicted_anchored_ms"] for c in fields["measured_choice"]["candidates"]] == [99.0, 108.0]
    assert fields["measured_choice"]["kept"] == "recompute only"
    # no anchor of that backend, model and batch; an eager row; an error row: nothing to anchor
    assert compare.anchored_prediction(row, [{**anchor, "variant": "mutwo@inductor-cudagraphs-none"}]) == {}
    assert compare.anchored_prediction(row, [{**anchor, "batch_size": 4}]) == {}
    assert compare.anchored_prediction({**row, "variant": "mutwo-0.5"}, [anchor]) == {}
    assert compare.anchored_prediction({**row, "error": "out of memory"}, [anchor]) == {}
    plus = {**row, "variant": "mutwo+opt@inductor-0.5"}
    assert compare.anchored_prediction(plus, [anchor]) == {}  # the optimizer passes make another graph
    assert compare.anchored_prediction(plus, [{**anchor, "variant": "mutwo+opt@inductor-none"}])


def test_parallel_planning_measures_the_unplanned_compiled_step_and_anchors_the_compiled_rows(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """On the tiny config: mutwo@inductor-none reuses mutwo-none's profile (which stays as it was),
    compiles beside the planned inductor row, and that row's prediction is anchored to it."""
    out = tmp_path / "anchor.json"
    monkeypatch.setattr(sys, "argv", ["compare.py", "--models", "tiny:512", "--out", str(out), "--stand-in-budget",
                                      "0.9", "--warmup", "0", "--iterations", "1", "--parallel-planning", "2",
                                      "--variants", "eager,mutwo-none,mutwo@inductor-none,mutwo@inductor-eager0.5"])
    compare.main()
    runs = json.loads(out.read_text())["runs"]
    assert all("error" not in r for r in runs), runs
    profiled, anchor, planned = runs[1:]
    assert not profiled["profile_reused"] and anchor["profile_reused"] and planned["profile_reused"]
    assert anchor["planned_in_parallel"] and planned["planned_in_parallel"]
    assert anchor["backend"] == "inductor" and "transfer" not in anchor  # the copy model stays mutwo-none's
    assert planned["anchor_iteration_ms"] == round(anchor["iteration_ms"], 3)
    expected = anchor["iteration_ms"] * planned["predicted_iteration_ms"] / planned["profiled_iteration_ms"]
    assert planned["predicted_anchored_ms"] == pytest.approx(expected, abs=1e-3)
