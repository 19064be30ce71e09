"""An example analysis pass: the largest storages live at the simulated peak, with their lifetimes.

    mutwo-opt --load-passes examples/passes/peak_consumers.py -p peak-consumers{top=10} CONFIG.yaml

It reads two cached analyses (liveness and the memory simulation), changes nothing, and saves
``peak_consumers.json`` in the output folder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mutwo import Graph, Pass, PassContext, option
from mutwo.ir.liveness import compute_liveness
from mutwo.ir.memory import simulate


@dataclass(frozen=True)
class PeakConsumersPass(Pass):
    """List the largest storages live at the simulated peak, with their kind, producer and lifetime."""

    name = "peak-consumers"
    provides = ("peak-consumers",)
    top: int = option(10, "how many storages to list")

    def __post_init__(self) -> None:  # checked when the pipeline is built, before capture
        if self.top < 1:
            raise ValueError("top must be at least 1")

    def run(self, graph: Graph, ctx: PassContext) -> list[dict[str, Any]]:
        liveness = ctx.analyses.compute(graph, "liveness", compute_liveness)
        profile = ctx.artifacts.get("profile")  # present when the profile pass ran before
        simulation = simulate(graph, liveness, profile.workspace() if profile else None)
        at = simulation.peak_rank
        live = [r for r in liveness.storages.values() if r.persistent or r.created <= at <= r.last_use]
        live.sort(key=lambda r: -r.bytes)
        rows = [{
            "storage": str(r.key), "bytes": r.bytes, "kind": r.kind.value,
            "producer": graph.node(r.key.creator).op_name, "created": r.created, "last_use": r.last_use,
            "idle": list(r.inactive_interval) if r.inactive_interval else None,
        } for r in live[:self.top]]  # fmt: skip
        ctx.artifacts["peak-consumers"] = rows
        ctx.save_json("peak_consumers.json", {"peak_bytes": simulation.peak_bytes, "peak_rank": at, "top": rows})
        lines = [f"peak {simulation.peak_bytes / 2**20:.1f} MiB at rank {at} ({simulation.peak_phase}):"]
        lines += [f"  {row['storage']:>8} {row['bytes'] / 2**20:9.2f} MiB {row['kind']:<15} {row['producer']:<40} "
                  f"ranks {row['created']}..{row['last_use']}" for row in rows]  # fmt: skip
        ctx.log("\n".join(lines))
        return rows
