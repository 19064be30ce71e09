"""The memory simulator: bytes live after every node of the whole iteration.

It walks the execution order on top of the persistent state (parameters, buffers, optimizer
state, the batch): a storage's bytes are added at its creator and removed after its last use
(see :mod:`mutwo.ir.liveness`), and a node's transient workspace, where a profile measured one,
counts while that node runs. On CUDA, sizes are rounded up as the caching allocator rounds them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from mutwo.ir.budget import SIZE_UNITS, readable_bytes
from mutwo.ir.graph import Graph
from mutwo.ir.liveness import KIND_PRECEDENCE, Liveness, compute_liveness
from mutwo.ir.node import NodeKind

#: What each kind of the breakdown is called in reports ("other": intermediates that are neither
#: saved activations nor gradients, such as the optimizer step's temporaries).
BREAKDOWN_NAMES = {
    "parameter": "parameters", "buffer": "buffers", "optimizer_state": "optimizer state", "input": "batch",
    "gradient": "gradients", "activation": "activations", "other": "temporaries", "workspace": "op workspace",
}  # fmt: skip

#: The CUDA caching allocator hands out blocks in multiples of 512 bytes.
CUDA_BLOCK = 512


def allocation_size(nbytes: int, device: str) -> int:
    """Bytes an allocation of ``nbytes`` takes on ``device``."""
    if device.startswith("cuda"):
        return 0 if nbytes == 0 else -(-nbytes // CUDA_BLOCK) * CUDA_BLOCK
    return nbytes


@dataclass
class MemorySimulation:
    """The simulated memory of one iteration on one device."""

    device: str
    curve: list[int]  #: bytes live while node i runs (its inputs, outputs and workspace)
    persistent_bytes: int
    peak_bytes: int
    peak_rank: int
    peak_node: int  #: id of the node at the peak
    peak_phase: str
    breakdown: dict[str, int]  #: bytes live at the peak by kind (and 'workspace')

    def to_json(self) -> dict[str, object]:
        return {
            "device": self.device, "persistent_bytes": self.persistent_bytes, "peak_bytes": self.peak_bytes,
            "peak_rank": self.peak_rank, "peak_node": self.peak_node, "peak_phase": self.peak_phase,
            "breakdown_at_peak": self.breakdown, "curve": self.curve,
        }  # fmt: skip

    def attribution(self) -> str:
        """What the peak is made of, largest first: ``parameters 0.9 MiB, gradients 0.5 MiB, ...``."""
        return describe_breakdown(self.breakdown)


def describe_breakdown(breakdown: Mapping[str, int], unit: str | None = None) -> str:
    """A breakdown by kind in words, largest first, kinds with no bytes left out. Each share in the
    largest unit it fills, or all in ``unit``, that of the message's other sizes (a share too small
    to show in it reads ``< 0.1 MiB``, not ``0.0 MiB``)."""
    parts = sorted(((value, BREAKDOWN_NAMES.get(kind, kind)) for kind, value in breakdown.items() if value),
                   reverse=True)  # fmt: skip
    return ", ".join(f"{name} {_share(value, unit)}" for value, name in parts) or "nothing"


def _share(size: int, unit: str | None) -> str:
    if unit is not None and 20 * size < dict(SIZE_UNITS)[unit]:  # it would read 0.0
        return f"< 0.1 {unit}"
    return readable_bytes(size, unit)


def main_device(graph: Graph) -> str:
    """The device of the parameters (the memory that matters); CPU scalars on a GPU run are ignored."""
    for node in graph.placeholders:
        if node.kind is NodeKind.PARAMETER and node.tensor is not None:
            return node.tensor.device
    devices = [t.device for n in graph.placeholders for t in n.tensors if t is not None]
    return devices[0] if devices else "cpu"


def simulate(
    graph: Graph,
    liveness: Liveness | None = None,
    workspace: Mapping[int, int] | None = None,
    device: str | None = None,
) -> MemorySimulation:
    """Simulate ``graph``; ``workspace`` maps node ids to transient bytes measured by a profile."""
    liveness = liveness if liveness is not None and liveness.version == graph.version else compute_liveness(graph)
    device = device or main_device(graph)
    workspace = workspace or {}
    sizes = {key: allocation_size(record.bytes, device) if record.device == device else 0
             for key, record in liveness.storages.items()}  # fmt: skip
    persistent = sum(sizes[key] for key, record in liveness.storages.items() if record.persistent)
    nodes = graph.nodes
    curve: list[int] = []
    live = persistent
    peak, peak_rank = -1, 0
    for rank, node in enumerate(nodes):
        live += sum(sizes[key] for key in liveness.allocated_at.get(rank, ()))
        during = live + workspace.get(node.id, 0)
        curve.append(during)
        if during > peak:
            peak, peak_rank = during, rank
        live -= sum(sizes[key] for key in liveness.freed_after.get(rank, ()))
    breakdown = _breakdown(liveness, sizes, peak_rank)
    extra = workspace.get(nodes[peak_rank].id, 0) if nodes else 0
    if extra:
        breakdown["workspace"] = extra
    return MemorySimulation(device, curve, persistent, max(peak, 0), peak_rank, nodes[peak_rank].id if nodes else -1,
                            nodes[peak_rank].phase.value if nodes else "", breakdown)  # fmt: skip


def _breakdown(liveness: Liveness, sizes: Mapping[object, int], rank: int) -> dict[str, int]:
    totals = {kind.value: 0 for kind in KIND_PRECEDENCE}
    for key, record in liveness.storages.items():
        if record.persistent or record.created <= rank <= record.last_use:
            totals[record.kind.value] += sizes[key]
    return totals


class Headroom:
    """A memory curve and a limit it must stay within: what extending lives on it may still add.

    ``curve[i]`` is the bytes live at rank ``i``; holding ``nbytes`` over ranks ``[start, end)``
    adds them there, and is refused when any of those ranks would then exceed ``limit``.
    """

    def __init__(self, curve: torch.Tensor, limit: int) -> None:
        self.curve = curve.clone()
        self.limit = limit

    def take(self, nbytes: int, start: int, end: int) -> bool:
        """Hold ``nbytes`` over ``[start, end)`` if the curve stays within the limit; whether it did."""
        if end > start and int(self.curve[start:end].max()) + nbytes > self.limit:
            return False
        self.curve[start:end] += nbytes
        return True

    def give(self, nbytes: int, start: int, end: int) -> None:
        """Release what :meth:`take` held."""
        self.curve[start:end] -= nbytes
