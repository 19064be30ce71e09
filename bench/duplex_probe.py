"""Host-device copy bandwidth in each direction alone and with both directions at once (CUDA).

Why: with copies priced nearly free, BERT-base b64's swap plan moved 14.2 GB and stalled 51 ms more
than predicted (docs/benchmarks.md, seventh session). The copy streams' model prices each direction
alone; this measures what each direction gets while the other runs too. Four 256 MiB copies per
direction between pinned host memory and the device, each direction on its own stream, timed
with CUDA events; the median of 5 runs after one warm-up, in GB/s.

    python bench/duplex_probe.py --out $OUT/duplex_probe.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

CHUNK = 256 * 2**20
COPIES = 4


def bandwidths(out: bool, into: bool, runs: int = 5) -> dict[str, float]:
    """GB/s of the copies out (device to host) and in, for the directions asked, run together."""
    host = [torch.empty(CHUNK, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    device = [torch.empty(CHUNK, dtype=torch.uint8, device="cuda") for _ in range(2)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    samples: dict[str, list[float]] = {"out": [], "in": []}
    for run in range(runs + 1):  # the first run warms up
        torch.cuda.synchronize()
        marks = {}
        directions = (("out", out, streams[0], lambda: host[0].copy_(device[0], non_blocking=True)),
                      ("in", into, streams[1], lambda: device[1].copy_(host[1], non_blocking=True)))
        for name, asked, stream, copy in directions:
            if not asked:
                continue
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                start.record(stream)
                for _ in range(COPIES):
                    copy()
                end.record(stream)
            marks[name] = (start, end)
        torch.cuda.synchronize()
        if run:
            for name, (start, end) in marks.items():
                samples[name].append(COPIES * CHUNK / (start.elapsed_time(end) / 1e3) / 1e9)
    return {name: statistics.median(values) for name, values in samples.items() if values}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file to write")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("duplex_probe: needs a CUDA GPU")
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
              "chunk_bytes": CHUNK, "copies": COPIES, "gb_per_second": {
                  "out alone": bandwidths(True, False)["out"], "in alone": bandwidths(False, True)["in"],
                  "both": bandwidths(True, True)}}  # fmt: skip
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
