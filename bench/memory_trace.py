"""Where a planned step's measured peak leaves its simulated one: node by node, on the GPU.

Plans a config's step with ``mutwo.optimize`` (eager backend, no calibration), then runs the final
graph once through an ``fx.Interpreter`` that reads ``torch.cuda.memory_allocated`` after each
node, beside the simulated live bytes of the same node (``mutwo.ir.memory.simulate``). Writes the
curve and the nodes where the measured bytes grow past the simulated ones, with what they compute:

    python3 bench/memory_trace.py --config examples/llama_32k.yaml --batch-size 8 --budget 0.5 --out trace.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import fx

import mutwo
from mutwo.ir.memory import simulate
from mutwo.ir.to_fx import to_fx
from mutwo.tools.experiment_measure import build_training


class _Traced(fx.Interpreter):
    """Runs the graph and records the most bytes allocated while each node ran (its operands are
    freed after their last use, as the generated code frees them)."""

    def __init__(self, module: fx.GraphModule, cuda: bool) -> None:
        super().__init__(module, garbage_collect_values=True)
        self.cuda = cuda
        self.peak_during: dict[str, int] = {}

    def run_node(self, node: fx.Node) -> Any:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        result = super().run_node(node)
        # On the CPU (a smoke test of this script) there is nothing to read: 0.
        if self.cuda:
            torch.cuda.synchronize()
        self.peak_during[node.name] = torch.cuda.max_memory_allocated() if self.cuda else 0
        return result


def trace(config: str, batch_size: int, budget: str, device: str = "cuda") -> dict[str, Any]:
    training = build_training(config, batch_size, device=device)
    step = mutwo.optimize(training.model, training.optimizer, training.batch, training.loss_fn, budget=budget,
                          backend="eager", calibrate_peak=0, cache=False)  # fmt: skip
    optimized = step.last
    assert optimized is not None
    graph = optimized.graph
    simulation = simulate(graph)
    module = to_fx(graph)
    inputs = list(optimized.step.flat_inputs(training.batch)) if optimized.step is not None else optimized.inputs
    interpreter = _Traced(module, cuda=device == "cuda")
    # What is allocated before the step runs beyond its inputs (cuBLAS's workspaces, say) stands
    # under every node's measured bytes: recorded, so that an offset from the first node is read as that.
    before_run = torch.cuda.memory_allocated() if device == "cuda" else 0
    with torch.no_grad():
        interpreter.run(*inputs)
    rows = []
    for rank, node in enumerate(graph.nodes):
        if node.op != "call_function" or node.name not in interpreter.peak_during:
            continue
        phase = node.phase.value if node.phase is not None else None
        rows.append({"rank": rank, "id": node.id, "name": node.name, "op": node.op_name, "phase": phase,
                     "simulated": simulation.curve[rank], "measured_peak": interpreter.peak_during[node.name]})
    worst = sorted(rows, key=lambda r: r["measured_peak"] - r["simulated"], reverse=True)[:40]
    return {"config": config, "batch_size": batch_size, "budget": budget, "device": device,
            "simulated_peak": simulation.peak_bytes, "measured_peak": max(interpreter.peak_during.values(), default=0),
            "allocated_before_run": before_run, "simulated_persistent": simulation.persistent_bytes,
            "largest_excess": worst, "curve": rows}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a smoke test, nothing measured")
    parser.add_argument("--budget", default="0.5")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    try:
        row = trace(args.config, args.batch_size, args.budget, args.device)
    except Exception as error:  # a bad config or budget, or an unreachable one: one line, nothing written
        print(f"memory_trace: {(str(error).strip().splitlines() or [type(error).__name__])[0]}", file=sys.stderr)
        return 1
    Path(args.out).write_text(json.dumps(row, indent=1))
    mib = 2**20
    print(f"simulated peak {row['simulated_peak'] / mib:,.1f} MiB, measured {row['measured_peak'] / mib:,.1f} MiB; "
          f"before the run {row['allocated_before_run'] / mib:,.1f} MiB allocated, "
          f"{row['simulated_persistent'] / mib:,.1f} MiB simulated")
    for r in row["largest_excess"][:15]:
        print(f"  %{r['id']} {r['op']} ({r['phase']}): simulated {r['simulated'] / mib:,.1f}, "
              f"measured {r['measured_peak'] / mib:,.1f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
