"""GPU kernel time per iteration by kind, from the Chrome traces ``bench/compare.py --trace`` writes.

Used on the H100 for issue 17 (docs/benchmarks.md, "Compiled backends"): which kernels make
mutwo's Inductor step slower than ``torch.compile``'s at the same peak. The kinds come from the
kernel names cuDNN, cuBLAS/CUTLASS and Inductor give their kernels (``dgrad``/``wgrad``/``fprop``,
``gemm``, ``triton_``); anything else, such as cuDNN's ``nchwToNhwcKernel`` layout transposes,
counts as ``other`` and shows by name in ``top``.

    python bench/kernel_summary_probe.py 'OUT/run/*.trace.json.gz' kernels.json
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
from pathlib import Path

#: (kind, any of these in the lower-cased kernel name), first match wins.
KINDS = (("conv_dgrad", ("dgrad",)), ("conv_wgrad", ("wgrad",)), ("conv_fprop", ("fprop", "conv", "implicit")),
         ("gemm", ("gemm", "cutlass", "sm90")), ("triton", ("triton",)), ("batch_norm", ("bn", "batch_norm")),
         ("elementwise", ("elementwise",)), ("reduce", ("reduce",)))  # fmt: skip


def kind_of(name: str) -> str:
    """The kind of a kernel, from its name."""
    lower = name.lower()
    return next((kind for kind, marks in KINDS if any(mark in lower for mark in marks)), "other")


def summarize(trace: Path, iterations: int, top: int = 25) -> dict[str, object]:
    """Kernels per iteration, milliseconds per iteration by kind, and the ``top`` kernel names."""
    events = json.load(gzip.open(trace))["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    by_kind: collections.Counter[str] = collections.Counter()
    by_name: collections.Counter[str] = collections.Counter()
    for event in kernels:
        by_kind[kind_of(event["name"])] += event["dur"]
        by_name[event["name"][:90]] += event["dur"]
    per_iteration_ms = 1e-3 / iterations  # trace durations are microseconds over all iterations
    return {"kernels_per_iter": len(kernels) / iterations,
            "ms_per_iter_by_category": {k: round(v * per_iteration_ms, 2) for k, v in by_kind.most_common()},
            "top": {k: round(v * per_iteration_ms, 2) for k, v in by_name.most_common(top)}}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", help="a glob of .trace.json.gz files")
    parser.add_argument("out", type=Path, help="the JSON file to write")
    parser.add_argument("--iterations", type=int, default=3, help="iterations each trace holds (compare.py: 3)")
    args = parser.parse_args()
    summary = {Path(p).name: summarize(Path(p), args.iterations) for p in sorted(glob.glob(args.traces))}
    args.out.write_text(json.dumps(summary, indent=1))
    for name, row in summary.items():
        print(name, row["kernels_per_iter"], row["ms_per_iter_by_category"])


if __name__ == "__main__":
    main()
