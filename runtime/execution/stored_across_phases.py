"""Keeping Inductor from recomputing, in the backward, a forward value the plan keeps.

Lowering inlines a pointwise node into each of its readers unless it reads more than a few
buffers (``StorageBox.should_realize_on_reuse``): its value is never stored, and every reader
recomputes it from the node's own inputs. On a whole-iteration graph a reader may be in the
backward, so the inputs live until then instead of the value. The plan counted the value: in
BERT-base b64 sliced in 4 (H100, 2026-11-27, ``bench/results/session19_h100/``) each layer's residual
``add`` was read by its layer norm in the forward and by the layer norm's backward; inlined into
both, the backward read the dropout's output and the residual stream, two 96 MiB buffers kept per
``add`` where the plan kept one, and the step allocated 18,269 MiB against 17,158 MiB simulated
(the same plan uncompiled matched its simulation).

:func:`kept_values_stored` stores such a value where it is computed: a forward node with a reader
in a later phase is realized as a buffer when what it reads would otherwise die in the forward
(a node reading none, like a constant fill, costs nothing to recompute and keeps nothing alive).
Where every buffer it reads outlives the forward anyway (a graph input, or a value a later phase
reads itself), inlining keeps nothing alive that the plan did not, and storing would only add the
value: GPT-2's tanh-approximated GELU has three intermediates per layer read by the backward, all
computed from the layer's input, which the backward reads too (in a 2-layer GPT-2 compiled on the
CPU these 6 of the 35 values the rule looks at are now inlined; in a 2-layer BERT 1 of 29). Storing
every such value (the rule's first version) held 1,600 MiB more than inlining on GPT-2 small (8,372
against 6,772 MiB, H100, 2026-11-27, ``bench/results/session19_h100/``), and its plan for per-layer
checkpointing's memory held 7% over the budget (``session23_h100/``); with this version the same
plan held 8,334 MiB at that budget of 8,368 (H200, ``session24_gpus/``). Within a phase Inductor
inlines as before, and a recompute clone, a backward node, is inlined into its readers as the plan
intends.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import fx

from mutwo.ir.node import Phase
from mutwo.runtime.execution.fusion import CUSTOM_PHASE

#: Names this rule in Inductor's cache keys, with the fusion rule's version (``phases_arrived``).
STORED_RULE_VERSION = "mutwo-forward-values-read-later-stored-2"


def read_in_a_later_phase(node: fx.Node) -> bool:
    """Whether ``node`` is a forward node (as ``mark_phases`` recorded) with a reader of another phase."""
    if node.meta.get("custom", {}).get(CUSTOM_PHASE) != Phase.FORWARD.value:
        return False
    phases = {user.meta.get("custom", {}).get(CUSTOM_PHASE) for user in node.users}
    return bool(phases - {Phase.FORWARD.value, None})


def _outlives_the_forward(lowering: Any, name: str) -> bool:
    """Whether the buffer Inductor's ``lowering`` names ``name`` stays alive into a later phase
    without this rule: a graph input or constant (the caller holds it), or a buffer computed by a
    node that a later phase reads itself. Unknown: no (the value is stored, as before)."""
    if name in lowering.graph_inputs or name in lowering.constants:
        return True
    buffer = lowering.name_to_buffer.get(name)
    origin = getattr(buffer, "origin_node", None)
    return isinstance(origin, fx.Node) and read_in_a_later_phase(origin)


def _inlined_with_reads(value: Any) -> Any:
    """The storage behind Inductor's lowered ``value`` when it is a not-yet-stored pointwise or
    reduction reading at least one buffer, else None."""
    from torch._inductor import ir

    data = getattr(value, "data", None)  # a TensorBox's contents
    while isinstance(data, ir.BaseView):
        data = data.data
    if isinstance(data, ir.StorageBox) and isinstance(data.data, (ir.Pointwise, ir.Reduction)):
        return data if data.num_reads() > 0 else None
    return None


@contextmanager
def kept_values_stored() -> Iterator[None]:
    """While compiling: every forward value read in a later phase is stored where it is computed
    instead of inlined into its later readers (Inductor's ``GraphLowering.run_node``), unless all
    it reads outlives the forward anyway."""
    from torch._inductor.graph import GraphLowering

    lower = GraphLowering.run_node

    def run_node(self: Any, node: fx.Node) -> Any:
        value = lower(self, node)
        if node.op == "call_function" and read_in_a_later_phase(node):
            storage = _inlined_with_reads(value)
            if storage is not None and not all(_outlives_the_forward(self, name)
                                               for name in storage.data.get_read_names()):  # fmt: skip
                storage.realize()
        return value

    GraphLowering.run_node = run_node  # type: ignore[method-assign]
    try:
        yield
    finally:
        GraphLowering.run_node = lower  # type: ignore[method-assign]
