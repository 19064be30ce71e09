"""``bench/swap_options.py`` on the CPU with the tiny MLP: one profile, a select-swap plan per
option set (a failing set is its own row), and every distinct plan timed once (the GPU run's JSON
has this shape, docs/benchmarks.md, "Copies priced per graph")."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_swap_options_plans_each_option_set_and_times_the_distinct_plans(tmp_path: Path) -> None:
    out = tmp_path / "options.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "swap_options.py"), "--out", str(out), "--model",
                           "tiny:64", "--budget", "0.95", "--options", ";allow=swap;allow=recompute;budget=0.5",
                           "--backend", "eager", "--compile", "3", "--iterations", "1"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert [p["options"] for p in result["plans"]] == ["", "allow=swap", "allow=recompute", "budget=0.5"]
    # What the default keeps (swap or recompute) follows the CPU's timings; each allow set is fixed.
    default, swap, recompute, unreachable = result["plans"]
    assert swap["swapped_tensors"] > 0 == swap["recomputed_tensors"]
    assert recompute["swapped_tensors"] == 0 < recompute["recomputed_tensors"]
    assert swap["plan_id"] != recompute["plan_id"] and "plan_id" in default
    assert "budget 0.5" in unreachable["error"] and "unreachable" in unreachable["error"]
    ids = list(dict.fromkeys(p["plan_id"] for p in result["plans"] if "plan_id" in p))
    assert [t["plan_id"] for t in result["timed"]] == ids  # each distinct plan once, in the order given
    assert all(t["backend"] == "eager" and t["iteration_ms"] > 0 for t in result["timed"])
