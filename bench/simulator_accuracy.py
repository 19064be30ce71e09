"""Simulated vs measured peak memory of captured iterations on CUDA (the analyses issue's check).

For each model and batch size: capture the whole iteration on the GPU, run the GraphModule for
whole iterations (peak = torch.cuda.max_memory_allocated of the iteration's own memory, time =
median), profile every node, and simulate the peak with and without the profiled workspace.

    python bench/simulator_accuracy.py --out bench/results/simulator_accuracy.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mutwo.ir import from_fx  # noqa: E402
from mutwo.ir.memory import simulate  # noqa: E402
from mutwo.ir.to_fx import to_fx  # noqa: E402
from mutwo.runtime.capture.iteration import capture  # noqa: E402
from mutwo.runtime.measurement.iterations import measure_iterations
from mutwo.runtime.measurement.profiler import profile_graph  # noqa: E402
from mutwo.tools.config import apply_overrides, load_config  # noqa: E402
from mutwo.tools.workloads import build_optimizer, build_workload  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CASES = {
    "resnet152": ("examples/resnet152.yaml", [16, 32, 64], {}),
    "bert-base-512": ("examples/bert.yaml", [4, 8, 16], {}),
}


def run_case(config_path: str, batch_size: int) -> dict[str, object]:
    config = apply_overrides(load_config(ROOT / config_path), batch_size=batch_size, device="cuda")
    device = torch.device("cuda")
    workload = build_workload(config)
    model = workload.model.to(device)
    batch = torch.utils._pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, workload.batch)
    optimizer = build_optimizer(config, model)
    start = time.perf_counter()
    captured, binding = capture(model, optimizer, batch, workload.loss_fn)
    graph = from_fx(captured.graph_module, [(s.kind, s.label) for s in captured.slots], captured.gradient_labels)
    capture_seconds = time.perf_counter() - start
    inputs = binding.flat_inputs(batch) + list(captured.constants.values())
    measured = measure_iterations(to_fx(graph), inputs, runs=8, warmup=3)
    start = time.perf_counter()
    profile = profile_graph(graph, inputs, runs=3, warmup=1, iteration_runs=0)
    profile_seconds = time.perf_counter() - start
    plain = simulate(graph)
    with_workspace = simulate(graph, workspace=profile.workspace())
    result = {
        "model": config.model.name, "batch_size": batch_size, "nodes": len(graph),
        "capture_seconds": round(capture_seconds, 2), "profile_seconds": round(profile_seconds, 2),
        "measured_peak_bytes": measured.peak_bytes, "iteration_ms": round(measured.seconds * 1e3, 2),
        "simulated_peak_bytes": plain.peak_bytes, "simulated_peak_with_workspace_bytes": with_workspace.peak_bytes,
        "persistent_bytes": plain.persistent_bytes, "peak_phase": with_workspace.peak_phase,
        "peak_node": graph.node(with_workspace.peak_node).op_name,
        "workspace_at_peak_bytes": with_workspace.breakdown.get("workspace", 0),
        "error_pct": round(100 * (with_workspace.peak_bytes - measured.peak_bytes) / measured.peak_bytes, 2),
        "error_without_workspace_pct": round(100 * (plain.peak_bytes - measured.peak_bytes) / measured.peak_bytes, 2),
    }
    del model, optimizer, captured, binding, graph, inputs, profile, batch, workload
    gc.collect()
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               "date": time.strftime("%Y-%m-%d"), "runs": []}  # fmt: skip
    for name in args.cases.split(","):
        config_path, batches, _ = CASES[name]
        for batch_size in batches:
            try:
                row = run_case(config_path, batch_size)
            except Exception as error:  # record and go on: one failure must not lose the campaign
                row = {"model": name, "batch_size": batch_size, "error": f"{type(error).__name__}: {error}"[:500]}
            print(json.dumps(row), flush=True)
            results["runs"].append(row)
            Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
