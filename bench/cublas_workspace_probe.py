"""Does every CUDA-graph recording of a step leave device memory behind? (tenth session)

A ``bench/compare.py`` row that measured a choice between two plans (five recordings in one
process) peaked 133 MiB more than a row of the same plan with two recordings, on the H100. The
suspect: cuBLAS keeps a workspace per stream it ran on, from the caching allocator, for the
process's life, and the CUDA-graph runner warmed each recording up on a new stream. This records
a small matmul step four times with a new warm-up stream each time (as before) and four times with
``mutwo.runtime.execution.cuda_graphs``' shared one, and prints what stays allocated after each recording
is released. Writes ``--out`` (JSON).

    python bench/cublas_workspace_probe.py --out $OUT/cublas_workspace_probe.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from mutwo.runtime.execution.cuda_graphs import CudaGraphRunner, warmup_stream

MIB = 2**20


def step(weight: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = torch.relu(x @ weight) @ weight.t()
    return y.sum(), y


def allocated_after_recordings(fresh_streams: bool, recordings: int = 4) -> list[float]:
    """MiB allocated after each recording of ``step`` is released (its pool freed)."""
    import mutwo.runtime.execution.cuda_graphs as cuda_graphs

    device = torch.device("cuda")
    weight = torch.randn(2048, 2048, device=device)
    x = torch.randn(4096, 2048, device=device)
    shared = cuda_graphs.warmup_stream
    if fresh_streams:  # the runner before the fix: a new warm-up stream per recording
        cuda_graphs.warmup_stream = lambda device: torch.cuda.Stream(device)
    try:
        after = []
        for _ in range(recordings):
            runner = CudaGraphRunner(step, [True, False])
            runner(weight, x)
            runner.release()
            del runner
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            after.append(torch.cuda.memory_allocated(device) / MIB)
        return after
    finally:
        cuda_graphs.warmup_stream = shared


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    warmup_stream(torch.device("cuda"))  # made once, as the runner does
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "shared_stream_mib": allocated_after_recordings(False),
              "fresh_streams_mib": allocated_after_recordings(True)}  # fmt: skip
    print(json.dumps(result))
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
