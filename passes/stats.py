"""The ``stats`` analysis: what the iteration is made of."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from mutwo.ir.graph import Graph
from mutwo.ir.pass_base import Pass, PassContext


@dataclass(frozen=True)
class StatsPass(Pass):
    """Count nodes by phase, kind and op, and bytes allocated by kind; writes stats.json.

    Bytes are counted by storage: views, getitems and in-place results add nothing.
    """

    name = "stats"
    provides = ("stats",)

    def run(self, graph: Graph, ctx: PassContext) -> dict[str, Any]:
        by_phase = Counter(n.phase.value for n in graph)
        by_kind = Counter(n.kind.value for n in graph)
        by_op = Counter(n.op_name for n in graph if n.op == "call_function")
        bytes_by_kind: Counter[str] = Counter()
        for node in graph:
            bytes_by_kind[node.kind.value] += node.owned_bytes
        stats = {
            "nodes": len(graph),
            "nodes_by_phase": dict(sorted(by_phase.items())),
            "nodes_by_kind": dict(sorted(by_kind.items())),
            "top_ops": dict(by_op.most_common(20)),
            "bytes_allocated_by_kind": dict(sorted(bytes_by_kind.items())),
        }
        ctx.artifacts["stats"] = stats
        ctx.save_json("stats.json", stats)
        return stats
