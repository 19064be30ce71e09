"""``bench/plan_stability.py`` on the CPU with the tiny MLP: it profiles, plans from each profile as
measured and pooled, attributes the plans, and times every distinct plan (the GPU run's JSON has
this shape, docs/benchmarks.md, "Why one budget gives several plans")."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_plan_stability_writes_plans_attribution_and_timings(tmp_path: Path) -> None:
    out = tmp_path / "stability.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "plan_stability.py"), "--out", str(out), "--model",
                           "tiny:64", "--budget", "0.9", "--profiles", "2", "--inductor", "0", "--iterations", "1",
                           "--attribute", "--profile-options", "runs=2"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["profile"] == "profile{pool=false,runs=2}"
    assert [(p["profile"], p["times"]) for p in result["plans"]] == [(0, "measured"), (0, "pooled"),
                                                                      (1, "measured"), (1, "pooled")]  # fmt: skip
    assert all(p["recomputed_tensors"] > 0 and len(p["plan_id"]) == 10 for p in result["plans"])
    assert "pooling" in result["plans"][1] and "pooling" not in result["plans"][0]
    (attribution,) = result["attribution"]
    ids = {p["plan_id"] for p in result["plans"]}
    # On the CPU the memory readings are the simulator's, equal in both profiles: the mixed
    # profiles are the times' own, so they make the times' plans.
    assert attribution["memory_fields_differing"] == {"allocated_before": 0, "allocated_after": 0, "peak": 0,
                                                      "workspace": 0}  # fmt: skip
    measured = {p["profile"]: p["plan_id"] for p in result["plans"] if p["times"] == "measured"}
    assert (attribution["times 1, memory 0"], attribution["times 0, memory 1"]) == (measured[1], measured[0])
    assert {t["plan_id"] for t in result["timed"]} == ids  # every distinct plan timed, once (eager only)
    assert all(t["backend"] == "eager" and t["iteration_ms"] > 0 for t in result["timed"])
