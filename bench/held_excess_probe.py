"""Where a calibrated CUDA-graph step's held memory goes beyond what it allocates (issue 38).

Under a 16 GiB cap, BERT-base b64's calibration rounds held 1.3 GiB over what they allocated, 0.5
GiB uncapped (``results/session28_gpus/``), and a first plan that would fit by its allocation ran
out of memory. This runs ``bench/out_of_core_profile.py capped`` and, at the end of every
calibration round (just before its recording is released; after an out-of-memory failure too) and
after the measured steps, summarises the allocator's segments by memory pool and stream:
reserved, allocated, the free bytes and their largest blocks, from ``torch.cuda.memory_snapshot``.
The private pool of a CUDA graph is the one whose ``pool`` is not ``(0, 0)``.

    python3 bench/held_excess_probe.py --config examples/bert.yaml --batch-size 64 --memory-limit 16GiB \\
        --budget 16GiB --backend inductor-cudagraphs --out probe.json
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import out_of_core_profile  # noqa: E402  (a sibling script)

from mutwo.runtime.planning import peak_calibration  # noqa: E402

MIB = 2**20
SNAPSHOTS: list[dict[str, Any]] = []


def pools_summary(when: str) -> dict[str, Any]:
    """The allocator's segments now, summed by (pool, stream), with the largest free blocks."""
    pools: dict[str, dict[str, Any]] = defaultdict(lambda: {"segments": 0, "reserved_mib": 0.0,
                                                            "allocated_mib": 0.0, "free_blocks": []})  # fmt: skip
    for segment in torch.cuda.memory_snapshot():
        key = f"pool={tuple(segment.get('segment_pool_id', (0, 0)))} stream={segment['stream']}"
        entry = pools[key]
        entry["segments"] += 1
        entry["expandable"] = bool(segment.get("is_expandable", False))
        entry["reserved_mib"] += segment["total_size"] / MIB
        entry["allocated_mib"] += segment["allocated_size"] / MIB
        entry["free_blocks"] += [b["size"] for b in segment["blocks"] if b["state"] == "inactive"]
    for entry in pools.values():
        free = sorted(entry.pop("free_blocks"), reverse=True)
        entry.update(free_mib=sum(free) / MIB, free_block_count=len(free),
                     largest_free_mib=[round(size / MIB, 1) for size in free[:8]])  # fmt: skip
    return {"when": when, "reserved_mib": torch.cuda.memory_reserved() / MIB,
            "allocated_mib": torch.cuda.memory_allocated() / MIB,
            "max_reserved_mib": torch.cuda.max_memory_reserved() / MIB,
            "max_allocated_mib": torch.cuda.max_memory_allocated() / MIB, "pools": dict(pools)}  # fmt: skip


def main() -> int:
    if not torch.cuda.is_available():  # the allocator's pools are CUDA's
        print("held_excess_probe.py: no CUDA device: run it on a GPU machine", file=sys.stderr)
        return 2
    original_release = peak_calibration.release_recording

    def release_after_snapshot(run: Any) -> None:
        SNAPSHOTS.append(pools_summary(f"calibration round {len(SNAPSHOTS) + 1}, before its release"))
        original_release(run)

    peak_calibration.release_recording = release_after_snapshot
    original_capped = out_of_core_profile.capped

    def capped_then_snapshot(args: Any) -> dict[str, Any]:
        row = original_capped(args)
        SNAPSHOTS.append(pools_summary("after the measured steps"))
        row["pool_snapshots"] = SNAPSHOTS
        return row

    out_of_core_profile.capped = capped_then_snapshot
    sys.argv.insert(1, "capped")
    return out_of_core_profile.main()


if __name__ == "__main__":
    raise SystemExit(main())
