"""The ``liveness`` analysis: the live range of every storage."""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass

from mutwo.ir.graph import Graph
from mutwo.ir.liveness import Liveness, compute_liveness
from mutwo.ir.pass_base import Pass, PassContext, write_atomic

COLUMNS = ("storage", "bytes", "kind", "device", "persistent", "activation", "created", "last_forward_use",
           "first_backward_use", "last_backward_use", "last_use", "holders")  # fmt: skip


def liveness_of(graph: Graph, ctx: PassContext) -> Liveness:
    """The cached liveness of ``graph``: what other passes call."""
    return ctx.analyses.compute(graph, "liveness", compute_liveness)


def live_ranges_csv(liveness: Liveness) -> str:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(COLUMNS)
    for key, record in sorted(liveness.storages.items()):
        writer.writerow([str(key), record.bytes, record.kind.value, record.device, record.persistent,
                         record.is_activation, record.created, record.last_forward_use, record.first_backward_use,
                         record.last_backward_use, record.last_use,
                         " ".join(f"%{h}" for h in record.holders)])  # fmt: skip
    return out.getvalue()


@dataclass(frozen=True)
class LivenessPass(Pass):
    """Compute when every storage is allocated, used in forward and backward, and freed; writes live_ranges.csv.

    Ranks are positions in execution order. Views, getitems and in-place results own no bytes:
    they extend the life of the storage they hold. An activation is a storage allocated in the
    forward phase and read in the backward phase; its inactive interval runs from its last
    forward use to its first backward use.
    """

    name = "liveness"
    provides = ("liveness",)

    def run(self, graph: Graph, ctx: PassContext) -> Liveness:
        liveness = liveness_of(graph, ctx)
        ctx.artifacts["liveness"] = liveness
        if ctx.out_dir is not None:
            write_atomic(ctx.out_dir / "live_ranges.csv", live_ranges_csv(liveness))
        activations = liveness.activations()
        total = sum(a.bytes for a in activations)
        ctx.log(f"liveness: {len(liveness.storages)} storages, {len(activations)} activations "
                f"holding {total / 2**20:.1f} MiB")  # fmt: skip
        return liveness
