"""How long capturing a model's training step takes, by optimizer (issue 40: setup at every start).

Capture traces the whole iteration with ``make_fx``, one fake-tensor dispatch per op, so its time
follows the graph's size; a branch the optimizer takes in Python on a number mutwo keeps in the
graph (SGD's ``momentum != 0``, asked once per parameter) also runs part of the graph traced so
far to decide it. This times :func:`~mutwo.runtime.planning.captured.capture_graph` of one
torchvision model under each named optimizer, a fresh model per optimizer, and writes the seconds,
the nodes and the guards (branches decided while tracing):

    python bench/capture_time_probe.py --model resnet152 --batch-size 2 --out capture.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torchvision
from torch.nn import functional as F

from mutwo.runtime.planning.captured import capture_graph

#: The optimizers timed, by name: what a ResNet is usually trained with, and Adam both ways.
OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3, foreach=False),
    "adam-foreach": lambda params: torch.optim.Adam(params, lr=1e-3, foreach=True),
}


def time_capture(model_name: str, batch_size: int, optimizer: str) -> dict[str, Any]:
    """Capture ``model_name``'s step at ``batch_size`` under ``optimizer``: seconds, nodes, guards."""
    torch.manual_seed(0)
    model = getattr(torchvision.models, model_name)()
    batch = (torch.randn(batch_size, 3, 224, 224), torch.randint(0, 1000, (batch_size,)))
    started = time.perf_counter()
    captured = capture_graph(model, OPTIMIZERS[optimizer](model.parameters()), batch, F.cross_entropy)
    seconds = time.perf_counter() - started
    return {"optimizer": optimizer, "capture_seconds": round(seconds, 2), "nodes": len(captured.graph),
            "guards": len(captured.captured.guards)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet152", help="a torchvision model's name")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS), help=f"some of {', '.join(OPTIMIZERS)}")
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    args = parser.parse_args()
    rows = []
    for name in args.optimizers.split(","):
        rows.append(time_capture(args.model, args.batch_size, name))
        print(json.dumps(rows[-1]), flush=True)
    result = {"model": args.model, "batch_size": args.batch_size, "torch": torch.__version__,
              "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d"), "rows": rows}  # fmt: skip
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
