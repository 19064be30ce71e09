"""An example transform pass: a different recompute policy — recompute every activation made by a
cheap pointwise op (ReLU, GELU, additions...), whatever the budget.

    mutwo-opt --load-passes examples/passes/recompute_pointwise.py -p recompute-pointwise --check CONFIG.yaml

It uses mutwo's recompute machinery (``mutwo.ir.recompute``) for everything that must stay
correct — finding each activation's sources, placing its clone before its first backward use,
never replaying side effects — and only decides *what* to recompute.
"""

from __future__ import annotations

from dataclasses import dataclass

from mutwo import Graph, Pass, PassContext, option
from mutwo.ir.liveness import compute_liveness
from mutwo.ir.recompute import NotRecomputable, Recompute, insert_blocks


@dataclass(frozen=True)
class RecomputePointwisePass(Pass):
    """Recompute every activation produced by a cheap pointwise op whose inputs are kept anyway."""

    name = "recompute-pointwise"
    provides = ("recomputed",)
    is_transform = True
    ops: str = option("relu,relu_,gelu,silu,sigmoid,tanh,add,add_,mul", "aten op names (without overload)")

    def run(self, graph: Graph, ctx: PassContext) -> int:
        wanted = {f"aten.{name}" for name in self.ops.split(",") if name}
        liveness = compute_liveness(graph)
        recompute = Recompute(graph, liveness)
        chosen = []
        for record in liveness.activations():
            producer = graph.node(record.key.creator)
            if producer.op_name.rsplit(".", 1)[0] not in wanted:
                continue
            try:
                block = recompute.plan_block(record.key, set(), {})
            except NotRecomputable:
                continue
            if len(block.nodes) == 1:  # cheap: only the pointwise op itself is replayed
                chosen.append(record.key)
        blocks = recompute.plan(chosen)
        clones = insert_blocks(graph, blocks)
        ctx.artifacts["recomputed"] = clones
        ctx.log(f"recompute-pointwise: {len(blocks)} activations recomputed with "
                f"{sum(len(c) for c in clones.values())} clones")  # fmt: skip
        return len(blocks)
