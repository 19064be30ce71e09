"""bench/data_parallel.py on CPU: two gloo ranks under torchrun, the tiny MLP, every variant, with DDP and
with FSDP2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.test_distributed import _free_port

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "bench" / "data_parallel.py"


def test_two_ranks_measure_eager_ddp_and_mutwo(tmp_path: Path) -> None:
    out = tmp_path / "dp.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(_free_port()), str(SCRIPT), "--models", "tiny:64:0.95", "--out", str(out)]  # fmt: skip
    env = {**{k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")},
           "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}  # gloo on CPU, GPU or not
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"stdout:\n{done.stdout[-2000:]}\nstderr:\n{done.stderr[-3000:]}"
    result = json.loads(out.read_text())
    assert result["world_size"] == 2 and result["backend"] == "gloo"
    assert result["allocator"] == "expandable_segments:True"  # every variant's, eager DDP's too
    variants = [row["variant"] for row in result["runs"]]
    assert variants == ["eager DDP", "mutwo 0.95 x mutwo's simulated peak", "mutwo no recompute"]
    for row in result["runs"]:
        assert row["global_batch"] == 128 and len(row["ranks"]) == 2
        assert row["iteration_ms"] == max(r["iteration_ms"] for r in row["ranks"]) > 0
    planned = result["runs"][1]
    assert planned["recomputed_tensors"] >= 1 and planned["predicted_peak"] <= planned["budget_bytes"]
    assert planned["backend"] == "eager" and planned["calibration"] is None  # the CPU's defaults
    assert planned["collectives"] >= 2 * planned["buckets"]  # an all-reduce and a wait per bucket


def test_two_ranks_measure_eager_fsdp2_and_mutwo_sharded(tmp_path: Path) -> None:
    out = tmp_path / "fsdp2.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(_free_port()), str(SCRIPT), "--sharding", "fsdp2", "--models", "tiny:64:0.95", "--out",
               str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"stdout:\n{done.stdout[-2000:]}\nstderr:\n{done.stderr[-3000:]}"
    runs = json.loads(out.read_text())["runs"]
    assert [row["variant"] for row in runs] == ["eager FSDP2", "eager FSDP2 + per-layer checkpointing",
                                                "mutwo FSDP2 0.95 x mutwo's simulated peak",
                                                "mutwo FSDP2 no recompute"]  # fmt: skip
    assert all(row["sharding"] == "fsdp2" and row["iteration_ms"] > 0 and len(row["ranks"]) == 2 for row in runs)
    planned = runs[2]
    assert planned["recomputed_tensors"] >= 1 and planned["predicted_peak"] <= planned["budget_bytes"]
    assert planned["all_gathers"] >= 1


def test_without_torchrun_it_says_how_to_launch() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    done = subprocess.run([sys.executable, str(SCRIPT)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 2 and "torchrun --nproc-per-node N" in done.stderr.splitlines()[-1]
