"""Rewritten ResNet-152 and BERT-base on the GPU: measured peak against the budget, with --check.

Each configuration runs ``mutwo-opt -p profile,select,rewrite --check --budget B`` in a fresh
process and the summaries and plans are collected into one JSON file.

    python bench/recompute_gpu.py --out bench/results/recompute_h100.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNS = [
    ("examples/resnet152.yaml", 64, ["0.7", "0.5", "min"]),
    ("examples/bert.yaml", 16, ["0.7", "0.5", "min"]),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", default="", help="comma-separated config stems to run")
    args = parser.parse_args()
    rows = []
    for config, batch, budgets in RUNS:
        if args.only and Path(config).stem not in args.only.split(","):
            continue
        for budget in budgets:
            with tempfile.TemporaryDirectory() as out:
                command = [sys.executable, "-m", "mutwo.tools.mutwo_opt", "-q", "-p", "profile,select,rewrite",
                           "--check",
                           "--budget", budget, "--batch-size", str(batch), "--device", "cuda", "-o", out, config]
                start = time.perf_counter()
                done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
                row = {"config": config, "batch_size": batch, "budget": budget, "exit": done.returncode,
                       "wall_seconds": round(time.perf_counter() - start, 1), "stderr": done.stderr.strip()[-600:]}
                summary_path, plan_path = Path(out) / "summary.json", Path(out) / "plan.json"
                plan = json.loads(plan_path.read_text()) if plan_path.exists() else None
                if summary_path.exists():
                    summary = json.loads(summary_path.read_text())
                    row.update({k: summary.get(k) for k in (
                        "peak_bytes_before", "peak_bytes_after", "measured_peak_bytes_before",
                        "measured_peak_bytes_after", "iteration_seconds_before", "iteration_seconds_after",
                        "recomputed", "equivalent", "pass_seconds", "peak_phase_after", "torch_version")})
                    plan = plan or summary.get("unmet_plan")  # a budget out of reach writes no plan.json
                if plan is not None:
                    row.update(budget_bytes=plan["budget_bytes"], predicted_peak=plan["predicted_peak"],
                               predicted_added_seconds=plan["added_seconds"], planned=len(plan["entries"]))
                if row.get("measured_peak_bytes_after") and row.get("budget_bytes"):
                    row["measured_over_budget_pct"] = round(
                        100 * (row["measured_peak_bytes_after"] / row["budget_bytes"] - 1), 2)
                print(json.dumps({k: v for k, v in row.items() if k != "stderr"}), flush=True)
                rows.append(row)
                Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "runs": rows}, indent=2))


if __name__ == "__main__":
    main()
