"""Python's garbage collector during one Inductor compile of a model's captured step: its seconds
and full collections, and the process's peak resident memory, with full collections as usual or
deferred for the length of the compile (mutwo.runtime.planning.collector.full_collections_deferred).

The heap before the compile is frozen, as ``optimize()`` freezes what existed before setup; one
full collection after the compile, in both modes, is what the deferred one costs. Run each mode in
a fresh process with its own empty Inductor cache (a cache hit compiles nothing):

    TORCHINDUCTOR_CACHE_DIR=/tmp/c1 python3 bench/compile_collector.py --config \\
        examples/resnet152_channels_last.yaml --batch-size 2 --device cpu --out as_is.json
    TORCHINDUCTOR_CACHE_DIR=/tmp/c2 python3 bench/compile_collector.py --config \\
        examples/resnet152_channels_last.yaml --batch-size 2 --device cpu --deferred --out deferred.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import resource
import time
from pathlib import Path

from collector_time import CollectorTime  # bench/ is on sys.path when this runs as a script

from mutwo.runtime.execution.backends import compile_graph
from mutwo.runtime.planning.captured import capture_graph
from mutwo.runtime.planning.collector import full_collections_deferred
from mutwo.tools.experiment_measure import build_training


def _peak_resident_mib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024  # KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--deferred", action="store_true", help="defer full collections while compiling")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    training = build_training(args.config, args.batch_size, device=args.device)
    lowered = capture_graph(training.model, training.optimizer, training.batch, training.loss_fn)
    gc.collect()
    gc.freeze()
    before = _peak_resident_mib()
    started = time.perf_counter()
    with CollectorTime() as collector:
        with full_collections_deferred() if args.deferred else contextlib.nullcontext():
            compile_graph(lowered.graph, lowered.inputs, args.backend)
        compiled = time.perf_counter() - started
        gc.collect()
    row = {"config": args.config, "batch_size": args.batch_size, "device": args.device, "backend": args.backend,
           "deferred": args.deferred, "nodes": len(list(lowered.graph)), "compile_seconds": round(compiled, 2),
           "garbage_collector": collector.summary(), "peak_resident_mib_before": before,
           "peak_resident_mib": _peak_resident_mib()}  # fmt: skip
    Path(args.out).write_text(json.dumps(row, indent=2))
    print(json.dumps(row, indent=2))


if __name__ == "__main__":
    main()
