"""Swap plans recorded as CUDA graphs: each offloaded tensor freed at an explicit release point.

Outside a capture, an offload hands its device tensor to the copy-out stream with
``record_stream`` and the caching allocator reuses the block once the copy has read it, whenever
that is. During a capture the allocator cannot record that event: it defers the free of every
block used on another stream to the end of the capture, so inside a CUDA graph an offloaded
tensor's memory would never be reused and the swap would save nothing.

So a step that swaps and is recorded as a CUDA graph frees each offloaded tensor where the plan
says its copy out has ended: :func:`insert_release_points` puts a ``mutwo::release_(host, tag)``
before the node select-swap chose (``release_before`` in the plan, :func:`mutwo.ir.timeline.release_points`;
insert-swap keeps them in ``Graph.meta``). There the compute stream waits for the copy out (no wait
if the timeline was right) and the swap runtime drops the device tensor it kept for the copy, which
is then freed in the compute stream's order (:meth:`mutwo.runtime.execution.swap.SwapRuntime.release`).
"""

from __future__ import annotations

import logging

from torch import fx

from mutwo.ir.graph import Graph
from mutwo.ir.swap import OFFLOAD, OFFLOAD_ELEMENTS, PREFETCH, RELEASE_IN_PLACE, SWAP_RELEASES
from mutwo.ir.to_fx import NODE_ID_META
from mutwo.runtime.execution.errors import BackendError

LOG = logging.getLogger(__name__)


def insert_release_points(module: fx.GraphModule, graph: Graph) -> int:
    """Insert a ``mutwo::release_`` for every offload of ``module`` (the fx graph of ``graph``,
    lowered by ``to_fx``, its offloads possibly rewritten for Inductor) at the release point
    recorded in ``graph.meta``, or before the swap's prefetch when the plan put it later or that
    node is gone. Returns how many were inserted; a swap without a release point (a plan made
    before they existed) is a :class:`~mutwo.runtime.execution.errors.BackendError`."""
    releases: dict[int, int] = graph.meta.get(SWAP_RELEASES, {})
    nodes = list(module.graph.nodes)
    order = {node: position for position, node in enumerate(nodes)}
    by_id = {node.meta[NODE_ID_META]: node for node in nodes if NODE_ID_META in node.meta}
    inserted = 0
    for offload in [node for node in nodes if node.target in (OFFLOAD, OFFLOAD_ELEMENTS)]:
        x, tag = offload.args
        if tag not in releases:
            raise BackendError(f"the swap of node {x} has no release point, which a CUDA graph needs to free the "
                               "offloaded tensor: plan it again with select-swap (plans made before release points "
                               "existed lack them) or use --backend eager or inductor")  # fmt: skip
        prefetch = next(user for user in offload.users if user.target is PREFETCH)
        point = by_id.get(releases[tag])
        if point is None or not order[offload] < order[point] <= order[prefetch]:
            LOG.warning("swap of %s: its release point (node %s) is not between its offload and its prefetch in "
                        "this graph; it is freed at its prefetch instead, which holds its memory through the "
                        "forward pass", x, releases[tag])  # fmt: skip
            point = prefetch
        with module.graph.inserting_before(point):
            release = module.graph.call_function(RELEASE_IN_PLACE, (offload, tag))
        release.meta = dict(offload.meta)  # the offload's phase (forward) and id, for Inductor's phase marks
        inserted += 1
    module.recompile()
    return inserted
