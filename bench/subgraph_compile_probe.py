"""How Inductor's compile time grows with a graph's layers, inlined as mutwo's whole-iteration
graph has them, against the same layers as calls of one ``invoke_subgraph`` body (torch's
hierarchical compilation, what ``torch.compiler.nested_compile_region`` emits): whether the body
is compiled once, and what that leaves of the compile.

A first start's time is mostly whole-iteration Inductor compiles (BERT-base b64 on an H200: 74 s of
125 s; ResNet-152-cl: 168 s, and 184 s more for calibration's second plan), whose cost grows with
the graph's nodes; a model's layers are mostly the same graph again. Each mode runs in a fresh
process with Inductor's caches off, on a transformer-like block (layer norm, attention, MLP) of an
inference graph (no autograd), as ``make_fx`` traces it::

    python bench/subgraph_compile_probe.py --layers 6 12 24 --out probe.json

Prints one line per compile and writes the times as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

WIDTH, TOKENS, HEADS = 256, 128, 4


def _block(x: Any, wq: Any, wo: Any, w1: Any, w2: Any, g: Any) -> Any:
    import torch
    import torch.nn.functional as F

    h = F.layer_norm(x, (WIDTH,), g)
    q, k, v = (h @ wq).split(WIDTH, dim=-1)
    heads = [t.view(TOKENS, HEADS, WIDTH // HEADS).transpose(0, 1) for t in (q, k, v)]
    attention = torch.softmax(heads[0] @ heads[1].transpose(1, 2) / (WIDTH // HEADS) ** 0.5, dim=-1)
    x = x + ((attention @ heads[2]).transpose(0, 1).reshape(TOKENS, WIDTH) @ wo)
    h = F.layer_norm(x, (WIDTH,), g)
    return x + F.gelu(h @ w1) @ w2


def _inputs(layers: int) -> list[Any]:
    import torch

    torch.manual_seed(0)
    weights = [(torch.randn(WIDTH, 3 * WIDTH), torch.randn(WIDTH, WIDTH), torch.randn(WIDTH, 4 * WIDTH),
                torch.randn(4 * WIDTH, WIDTH), torch.ones(WIDTH)) for _ in range(layers)]  # fmt: skip
    return [torch.randn(TOKENS, WIDTH)] + [w * 0.02 if w.dim() > 1 else w for layer in weights for w in layer]


def _graph(layers: int, regional: bool) -> Any:
    """The traced graph of ``layers`` blocks and a sum, inlined or as ``invoke_subgraph`` calls."""
    import operator

    import torch
    from torch import fx
    from torch._higher_order_ops.invoke_subgraph import invoke_subgraph
    from torch.fx.experimental.proxy_tensor import make_fx

    inputs = _inputs(layers)
    if not regional:
        def inlined(x: Any, *weights: Any) -> Any:
            for i in range(layers):
                x = _block(x, *weights[5 * i: 5 * i + 5])
            return (x.sum(),)
        return make_fx(inlined)(*inputs), inputs
    traced = make_fx(_block)(*inputs[:6])
    body = fx.Graph()
    env: dict[Any, Any] = {}
    for node in traced.graph.nodes:  # the body returns a tuple, as invoke_subgraph asks
        if node.op == "output":
            body.output((env[node.args[0]],))
        else:
            env[node] = body.node_copy(node, lambda arg: env[arg])
    root = torch.nn.Module()
    root.body = fx.GraphModule({}, body)
    graph = fx.Graph()
    placeholders = [graph.placeholder(f"arg{i}") for i in range(len(inputs))]
    x = placeholders[0]
    for i in range(layers):
        call = graph.call_function(invoke_subgraph, (graph.get_attr("body"), "block", x,
                                                     *placeholders[1 + 5 * i: 6 + 5 * i]))  # fmt: skip
        x = graph.call_function(operator.getitem, (call, 0))
    graph.output((graph.call_function(torch.ops.aten.sum.default, (x,)),))
    return make_fx(fx.GraphModule(root, graph))(*inputs), inputs


def _one(layers: int, mode: str) -> dict[str, Any]:
    """Compile one graph in this process and check it against the inlined graph run eagerly."""
    import torch
    from torch._inductor.compile_fx import compile_fx

    module, inputs = _graph(layers, mode == "regional")
    nodes = sum(1 for _ in module.graph.nodes)
    started = time.perf_counter()
    compiled = compile_fx(module, inputs)
    seconds = time.perf_counter() - started
    expected = _graph(layers, False)[0](*inputs)[0]
    difference = (compiled(*inputs)[0] - expected).abs().item()
    return {"layers": layers, "mode": mode, "nodes": nodes, "compile_seconds": round(seconds, 2),
            "difference": difference, "torch": torch.__version__}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[6, 12, 24])
    parser.add_argument("--out", default=None)
    parser.add_argument("--one", nargs=2, metavar=("LAYERS", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(_one(int(args.one[0]), args.one[1])))
        return
    rows = []
    environment = {**os.environ, "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}
    for layers in args.layers:
        for mode in ("inlined", "regional"):
            done = subprocess.run([sys.executable, __file__, "--one", str(layers), mode], env=environment,
                                  capture_output=True, text=True, check=True)  # fmt: skip
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            row = rows[-1]
            print(f"{layers} layers {mode}: {row['nodes']} nodes, compiled in {row['compile_seconds']:.1f} s, "
                  f"{row['difference']:.2e} from eager", flush=True)  # fmt: skip
    if args.out:
        with open(args.out, "w", encoding="utf-8") as file:
            json.dump(rows, file, indent=1)


if __name__ == "__main__":
    main()
