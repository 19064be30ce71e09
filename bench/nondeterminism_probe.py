"""Which ops of a captured iteration give different bits from run to run on this device.

``mutwo-opt --check`` on CUDA first runs the original graph twice from the same state; when the
two runs differ (bf16 BERT on the H100, even with deterministic algorithms on), it cannot compare
bit for bit. This probe finds where the difference starts: it runs the original graph twice from
clones of the same state, in deterministic mode, and fingerprints every node's tensor outputs (the
exact integer sum of their bit patterns: order-free, so the fingerprint itself is deterministic).
The first node whose fingerprint differs while all of its inputs' match is a kernel that is not
deterministic; later differences may only be inherited. (An op that writes into a view marks the
view as differing, not its base: a later reader of the base may then be listed as a cause too.)

    python bench/nondeterminism_probe.py examples/bert_bf16.yaml --batch-size 32 \\
        --out bench/results/bf16_h100/nondeterminism_bert.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.fx

from mutwo.ir.graph import Graph
from mutwo.ir.pass_base import write_atomic
from mutwo.ir.to_fx import NODE_ID_META, to_fx
from mutwo.runtime.capture.optim import UnsupportedOptimizerError
from mutwo.runtime.capture.tracing import CaptureError
from mutwo.runtime.measurement.equivalence import deterministic_algorithms
from mutwo.runtime.planning.captured import capture_graph
from mutwo.tools.config import ConfigError, load_config
from mutwo.tools.workloads import build_optimizer, build_workload, target_device, to_device, training_options

# Deterministic cuBLAS needs this before cuBLAS starts (mutwo-opt sets it at startup too).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fingerprint(value: Any) -> list[int]:
    """The exact sum of the bit patterns of each tensor in ``value`` (a tensor or a tuple/list)."""
    tensors = [value] if isinstance(value, torch.Tensor) else [v for v in value if isinstance(v, torch.Tensor)] \
        if isinstance(value, (tuple, list)) else []  # fmt: skip
    prints = []
    for tensor in tensors:
        if tensor.numel() == 0 or tensor.dtype == torch.bool:
            prints.append(int(tensor.sum()) if tensor.numel() else 0)
            continue
        real = torch.view_as_real(tensor) if tensor.is_complex() else tensor
        bits = real.detach().contiguous().view(_BITS[real.element_size()]).to(torch.int64)
        prints.append(int(bits.sum()))
    return prints


class Fingerprinter(torch.fx.Interpreter):
    """Runs a graph module and records every node's output fingerprint and, for an op that writes
    into its operands (``add_``, ``_foreach_addcmul_``, a training batch norm's running statistics:
    the IR's :attr:`mutwo.ir.node.Node.mutated_operands`), theirs after it ran (values are freed as usual)."""

    def __init__(self, module: torch.fx.GraphModule, graph: Graph) -> None:
        super().__init__(module)
        self.ir = graph
        self.by_name = {node.name: node for node in module.graph.nodes}  # to_fx keeps the IR's names
        self.prints: dict[str, list[int]] = {}
        self.writes: dict[str, dict[str, list[int]]] = {}

    def run_node(self, node: torch.fx.Node) -> Any:
        result = super().run_node(node)
        self.prints[node.name] = fingerprint(result)
        if node.op == "call_function":
            written = [self.by_name[operand.name] for operand in self.ir.node(node.meta[NODE_ID_META]).mutated_operands]
            if written:
                self.writes[node.name] = {arg.name: fingerprint(self.env[arg]) for arg in written}
        return result


def probe(graph: Graph, inputs: list[Any], seed: int = 0) -> list[dict[str, Any]]:
    """The nodes whose outputs (or the values they write into) differ between two runs of ``graph``
    from clones of ``inputs``, in execution order; ``first_cause`` marks those whose inputs all
    matched when they ran."""
    module = to_fx(graph)
    runs = []
    for _ in range(2):
        state = [t.clone() if isinstance(t, torch.Tensor) else t for t in inputs]
        torch.manual_seed(seed)
        interpreter = Fingerprinter(module, graph)
        with torch.no_grad():
            interpreter.run(*state)
        runs.append(interpreter)
    first, second = runs
    differing: set[str] = set()  # values that differ by now (a value written in place differs from then on)
    rows = []
    for node in module.graph.nodes:
        inherited = any(arg.name in differing for arg in node.all_input_nodes)
        output_differs = first.prints.get(node.name) != second.prints.get(node.name)
        writes = first.writes.get(node.name, {})
        written_differ = [name for name in writes if writes[name] != second.writes[node.name][name]]
        if not output_differs and not written_differ:
            continue
        differing.update([node.name] if output_differs else [])
        differing.update(written_differ)
        ir_node = graph.node(node.meta[NODE_ID_META])
        tensors = [t for t in ir_node.tensors if t is not None]
        rows.append({"node": node.name, "target": str(node.target), "first_cause": not inherited,
                     "phase": ir_node.phase.value, "kind": ir_node.kind.value, "writes_differ": written_differ[:5],
                     "shapes": [list(t.shape) for t in tensors][:5],
                     "dtypes": sorted({str(t.dtype) for t in tensors})})  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="a mutwo-opt YAML config")
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    args = parser.parse_args()
    try:  # bad input is one line and exit code 2, as in mutwo-opt
        config = load_config(args.config)
        if args.batch_size is not None:
            config = dataclasses.replace(config, batch_size=args.batch_size)
        device = target_device(config)
        workload = build_workload(config)
        model = workload.model.to(device)
        batch = to_device(workload.batch, device)
        lowered = capture_graph(model, build_optimizer(config, model), batch, workload.loss_fn,
                                training_options(config, device))  # fmt: skip
    except (ConfigError, CaptureError, UnsupportedOptimizerError) as error:
        parser.error(str(error))
    with deterministic_algorithms():
        rows = probe(lowered.graph, [*lowered.inputs])
    causes = [row for row in rows if row["first_cause"]]
    result = {"config": args.config, "batch_size": config.batch_size, "device": str(device),
              "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None, "torch": torch.__version__,
              "nodes": len(lowered.graph), "differing": len(rows), "first_causes": causes,
              "differing_nodes": rows[:200]}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out, json.dumps(result, indent=1))
    print(f"{len(rows)} of {len(lowered.graph)} nodes differ between two runs; first causes:")
    for row in causes:
        print(f"  {row['node']}: {row['target']} ({row['phase']}, {row['kind']}) {row['shapes']} {row['dtypes']}")


if __name__ == "__main__":
    main()
