"""``mutwo-opt --sharding fsdp2`` (:mod:`mutwo.runtime.parallel.sharding`): a config's model
sharded with FSDP2 as its users shard it, one ``fully_shard`` per repeated block, then captured
and planned with its all-gathers and reduce-scatters, under torchrun on two gloo ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torchvision
from torch import nn

from mutwo.runtime.parallel.sharding import repeated_blocks
from mutwo.tools.mutwo_opt import EXIT_USAGE, main
from tests.test_distributed import _free_port

REPO = Path(__file__).resolve().parent.parent


def test_the_repeated_blocks_are_the_layers_users_shard() -> None:
    resnet = torchvision.models.resnet18()
    assert [name for name, _ in repeated_blocks(resnet)] == [
        "layer1.0", "layer1.1", "layer2.0", "layer2.1", "layer3.0", "layer3.1", "layer4.0", "layer4.1"]  # fmt: skip
    # a Sequential of unlike layers (Linear, ReLU) is not a stack of blocks; nested stacks count once
    mlp = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    assert repeated_blocks(mlp) == []
    nested = nn.Sequential(*(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)) for _ in range(3)))
    assert [name for name, _ in repeated_blocks(nested)] == ["0", "1", "2"]


def test_fsdp2_sharding_outside_torchrun_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["--sharding", "fsdp2", "-o", str(tmp_path / "out"), str(REPO / "examples" / "tiny_mlp.yaml")])
    error = capsys.readouterr().err.strip()
    assert code == EXIT_USAGE and error.count("\n") == 0 and "--sharding fsdp2 applies to data-parallel runs" in error
    assert not (tmp_path / "out").exists()


def test_mutwo_opt_shards_a_config_model_with_fsdp2_under_torchrun(tmp_path: Path) -> None:
    out = tmp_path / "out"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(_free_port()), "-m", "mutwo.tools.mutwo_opt", "--sharding", "fsdp2", "--check", "--device", "cpu",
               "--budget", "0.9", "-o", str(out), "examples/gpt2_tiny.yaml"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("sharded 2 repeated blocks and the model with fully_shard over 2 ranks") == 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["equivalent"] is True and summary["recomputed"] >= 1
    parallel = summary["data_parallel"]
    assert parallel["sharding"] == "fsdp2" and parallel["sharded_blocks"] == ["transformer.h.0", "transformer.h.1"]
    assert parallel["world_size"] == 2 and parallel["global_batch_size"] == 2 * summary["batch_size"]
    final = (out / "final.ir.txt").read_text()
    assert "all_gather_into_tensor" in final and "reduce_scatter_tensor" in final


def test_bucket_cap_with_fsdp2_is_refused_on_every_rank(tmp_path: Path) -> None:
    """Each rank refuses in one line. The ranks run as torchrun would start them (its environment),
    without torchrun's agent: the agent stops the other rank once one fails, and whether that rank
    had said its line by then was a race (one rank's line only, once in CI)."""
    port = str(_free_port())
    command = [sys.executable, "-m", "mutwo.tools.mutwo_opt", "--sharding", "fsdp2", "--bucket-cap-mb", "1",
               "--device", "cpu", "-o", str(tmp_path / "out"), "examples/tiny_mlp.yaml"]  # fmt: skip
    ranks = [subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(rank), "LOCAL_RANK": str(rank),
                                   "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": port})
             for rank in range(2)]  # fmt: skip
    for rank in ranks:
        _, stderr = rank.communicate(timeout=300)
        assert rank.returncode == EXIT_USAGE, stderr
        assert stderr == ("mutwo-opt: error: --bucket-cap-mb sets DDP's gradient buckets; a --sharding fsdp2 run "
                          "communicates per fully_shard block, so drop it\n"), stderr  # one line, no traceback
