"""bench/pipeline_timing.py on CPU: each pipeline planned and trained in a fresh process, one row
each; a pipeline whose process fails gives a row naming the error in one line, and exit code 1."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "bench" / "pipeline_timing.py"


def _run(tmp_path: Path, budget: str, *passes: str) -> tuple[int, dict]:
    out = tmp_path / "rows.json"
    command = [sys.executable, str(SCRIPT), "--config", str(REPO / "examples" / "tiny_mlp.yaml"), "--batch-size", "8",
               "--budget", budget, "--steps", "2", "--out", str(out)]  # fmt: skip
    for spec in passes:
        command += ["--passes", spec]
    done = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=600)
    return done.returncode, json.loads(out.read_text())


def test_each_pipeline_gets_a_timed_row(tmp_path: Path) -> None:
    code, result = _run(tmp_path, "1GiB", "profile,optimizer,chunk,select,rewrite", "profile,select,rewrite")
    assert code == 0 and result["budget"] == "1GiB"
    assert [row["passes"] for row in result["rows"]] == ["profile,optimizer,chunk,select,rewrite",
                                                          "profile,select,rewrite"]  # fmt: skip
    for row in result["rows"]:
        assert row["iteration_ms"] > 0 and len(row["iteration_ms_all"]) == 2
        assert row["recomputed"] == 0 and row["sliced"] is None  # 1 GiB: nothing to save on a tiny MLP


def test_a_failing_pipeline_is_a_row_naming_its_error(tmp_path: Path) -> None:
    code, result = _run(tmp_path, "banana", "profile,select,rewrite")
    (row,) = result["rows"]
    assert code == 1 and "budget 'banana'" in row["error"] and "\n" not in row["error"]
