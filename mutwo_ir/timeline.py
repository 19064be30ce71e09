"""The time simulator: the compute stream and the two copy streams over one iteration.

Compute nodes run one after another for their profiled time. A swap's copy out is issued when the
compute stream reaches its offload and runs on the copy-out stream, after the copies out issued
before it; its copy in is issued at its prefetch and runs on the copy-in stream once the copy out
has finished; the compute stream stops at the wait until the copy in is done. A transfer that
the compute between its prefetch and its wait cannot hide therefore *stalls* the iteration by
the remainder. Copies take ``latency + bytes / bandwidth`` in their direction (the two
directions of PCIe are independent). Where copies cannot overlap compute (on CPU the swap ops
copy on the calling thread), each copy adds its whole time where it is issued.

Copies beside compute are not free either: they take HBM bandwidth the kernels would use. On the
H100 kernels ran 1.10x longer while a copy was in flight (stream traces of BERT-base's swap plans,
docs/benchmarks.md, "Swap and recompute"), and a ResNet-152 swap plan compiled by Inductor ran 12%
over a prediction without that. ``TransferModel.compute_slowdown`` is that fraction: the
schedule's *contention* is it times the time a copy is in flight while the compute stream runs
(the union of the copies' intervals less the stalls), added to the iteration like a stall.

:func:`schedule_transfers` works on plain positions and times, so the selection pass uses it on
its estimate as :func:`graph_timeline` uses it on a rewritten graph.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from mutwo.ir.graph import Graph
from mutwo.ir.node import Node
from mutwo.ir.swap import swap_nodes

#: How far past its copy out's predicted end a swap's release point lies, as a fraction of the time
#: from the offload to that end (queueing included): the compute stream waits for the copy there
#: in a step recorded as a CUDA graph (:func:`release_points`), and a CUDA graph replays compute
#: about 10% faster than the profile that predicts it (docs/benchmarks.md), while copies run at the
#: measured bandwidth. Releasing later holds the tensor a little longer; earlier would stall.
RELEASE_MARGIN = 0.25

#: ``TransferModel.compute_slowdown`` for copies beside compute on CUDA: kernels ran 1.10x longer
#: while a copy was in flight on the H100 (the stream traces of 2026-11-23). Measured on that GPU
#: only; select-swap's ``contention`` option sets another.
CUDA_COMPUTE_SLOWDOWN = 0.10


@dataclass(frozen=True)
class TransferModel:
    """How long a host-device copy takes on a machine, as measured by the runtime's profiler."""

    d2h_bytes_per_second: float
    h2d_bytes_per_second: float
    latency_seconds: float
    overlap: bool  #: copies run beside compute (CUDA streams) rather than on its timeline (CPU)
    device: str = ""
    #: how much longer compute runs while a copy is in flight (0.10: 10% longer); see the module docstring
    compute_slowdown: float = 0.0

    def d2h_seconds(self, nbytes: int) -> float:
        return self.latency_seconds + nbytes / self.d2h_bytes_per_second

    def h2d_seconds(self, nbytes: int) -> float:
        return self.latency_seconds + nbytes / self.h2d_bytes_per_second

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TransferModel:
        return cls(**data)


@dataclass(frozen=True)
class Transfer:
    """One swap on a timeline: positions are the nodes before which its ops are issued."""

    offload_at: int
    prefetch_at: int
    wait_at: int
    out_seconds: float
    in_seconds: float


@dataclass
class StreamSchedule:
    """When every copy ran and what it cost the compute stream."""

    copy_out: list[tuple[float, float]]  #: per transfer: (start, end)
    copy_in: list[tuple[float, float]]
    stalls: list[float]  #: per transfer: time the compute stream lost to it
    delays: list[tuple[int, float]] = field(default_factory=list)  #: (position, seconds added before it)
    contention: float = 0.0  #: what the compute loses to copies in flight beside it (module docstring)

    @property
    def stall(self) -> float:
        return sum(self.stalls)

    @property
    def cost(self) -> float:
        """All the copies add to the iteration: stalls and contention."""
        return self.stall + self.contention


def busy_seconds(intervals: Sequence[tuple[float, float]]) -> float:
    """The length of the union of ``intervals``."""
    total, reach = 0.0, -float("inf")
    for begin, end in sorted(intervals):
        if end > reach:
            total += end - max(begin, reach)
            reach = end
    return total


_OUT, _IN, _WAIT = 0, 1, 2  # at one position, copies out are issued first, then copies in, then waits


def schedule_transfers(clock: Sequence[float], transfers: Sequence[Transfer], overlap: bool,
                       compute_slowdown: float = 0.0) -> StreamSchedule:  # fmt: skip
    """Simulate the copy streams: ``clock[p]`` is when the node at position ``p`` starts if nothing
    stalls (``clock[-1]`` the end of the iteration); ``compute_slowdown`` prices the contention of
    copies beside compute. A transfer out of order (a prefetch before its offload or after its
    wait) is a ValueError: priced, it would cost nothing."""
    for t in transfers:
        if not t.offload_at <= t.prefetch_at <= t.wait_at:
            raise ValueError(f"a swap out of order: offload at {t.offload_at}, prefetch at {t.prefetch_at}, "
                             f"wait at {t.wait_at}")  # fmt: skip
    events = sorted(itertools.chain.from_iterable(
        ((t.offload_at, _OUT, k), (t.prefetch_at, _IN, k), (t.wait_at, _WAIT, k)) for k, t in enumerate(transfers)))
    schedule = StreamSchedule([(0.0, 0.0)] * len(transfers), [(0.0, 0.0)] * len(transfers), [0.0] * len(transfers))
    stalled = 0.0
    out_free = in_free = 0.0
    for position, kind, k in events:
        now = clock[position] + stalled
        transfer = transfers[k]
        if kind == _OUT:
            start = max(now, out_free) if overlap else now
            out_free = start + transfer.out_seconds
            schedule.copy_out[k] = (start, out_free)
            added = 0.0 if overlap else transfer.out_seconds
        elif kind == _IN:
            start = max(now, in_free, schedule.copy_out[k][1]) if overlap else now
            in_free = start + transfer.in_seconds
            schedule.copy_in[k] = (start, in_free)
            added = 0.0 if overlap else transfer.in_seconds
        else:
            added = max(0.0, schedule.copy_in[k][1] - now)
        if added:
            schedule.stalls[k] += added
            schedule.delays.append((position, added))
            stalled += added
    if overlap and compute_slowdown and transfers:
        in_flight = busy_seconds([i for i in schedule.copy_out + schedule.copy_in if i[1] > i[0]])
        schedule.contention = compute_slowdown * max(0.0, in_flight - schedule.stall)
    return schedule


@dataclass
class GraphTimeline:
    """The timeline of one graph: compute intervals per node, copies per swap, stalls."""

    start: list[float]  #: per position, when the node starts
    end: list[float]
    swaps: list[dict[str, Any]]  #: per swap: tag, bytes, copy-out and copy-in intervals, stall
    seconds: float  #: the whole iteration
    stalled: list[tuple[float, float]] = field(default_factory=list)  #: (start, seconds) the compute stream waits
    contention: float = 0.0  #: included in ``seconds``: compute slowed by copies beside it

    @property
    def stall(self) -> float:
        return sum(s["stall"] for s in self.swaps)

    def to_json(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "stall_seconds": self.stall, "contention_seconds": self.contention,
                "swaps": self.swaps, "stalled": self.stalled, "node_start": self.start,
                "node_end": self.end}  # fmt: skip


def graph_timeline(graph: Graph, seconds: Callable[[Node], float], model: TransferModel | None) -> GraphTimeline:
    """Simulate ``graph`` with ``seconds(node)`` per compute node (swap ops take none on the compute
    stream) and ``model`` for its swaps (``None`` when it has none)."""
    nodes = graph.nodes
    swaps = swap_nodes(graph)
    if swaps and model is None:
        raise ValueError("the graph swaps activations: its timeline needs a transfer model")
    in_swaps = {n for triple in swaps for n in triple}
    clock = list(itertools.accumulate((0.0 if n in in_swaps else seconds(n) for n in nodes), initial=0.0))
    transfers = []
    for offload, prefetch, wait in swaps:
        nbytes = offload.tensors[0].storage_bytes
        assert model is not None
        transfers.append(Transfer(graph.position(offload), graph.position(prefetch), graph.position(wait),
                                  model.d2h_seconds(nbytes), model.h2d_seconds(nbytes)))  # fmt: skip
    schedule = schedule_transfers(clock, transfers, model.overlap if model is not None else True,
                                  model.compute_slowdown if model is not None else 0.0)  # fmt: skip
    shift = [0.0] * (len(nodes) + 1)
    stalled: list[tuple[float, float]] = []
    total = 0.0
    for position, added in schedule.delays:  # in order of position
        stalled.append((clock[position] + total, added))
        shift[position] += added
        total += added
    shift = list(itertools.accumulate(shift))
    start = [clock[i] + shift[i] for i in range(len(nodes))]
    end = [start[i] + clock[i + 1] - clock[i] for i in range(len(nodes))]
    records = [{"tag": offload.args[1], "bytes": offload.tensors[0].storage_bytes,
                "offload": offload.id, "prefetch": prefetch.id, "wait": wait.id,
                "copy_out": schedule.copy_out[k], "copy_in": schedule.copy_in[k], "stall": schedule.stalls[k]}
               for k, (offload, prefetch, wait) in enumerate(swaps)]  # fmt: skip
    return GraphTimeline(start, end, records, clock[-1] + shift[-1] + schedule.contention, stalled,
                         schedule.contention)  # fmt: skip


def release_points(graph: Graph, timeline: GraphTimeline, allowed: Callable[[Node], bool] = lambda node: True,
                   margin: float = RELEASE_MARGIN) -> dict[int, int | None]:  # fmt: skip
    """Per swap of ``graph`` (by tag), the id of the node before which the compute stream can wait
    for its copy out without stalling (``timeline`` is ``graph``'s): the first node ``allowed``
    accepts that starts ``margin`` of the copy's time after its predicted end; None when none
    does before the swap's prefetch (the prefetch waits for the copy out anyway)."""
    nodes = graph.nodes
    points: dict[int, int | None] = {}
    for record in timeline.swaps:
        offload_at = graph.position(graph.node(record["offload"]))
        prefetch_at = graph.position(graph.node(record["prefetch"]))
        issued = timeline.start[offload_at]
        due = issued + (record["copy_out"][1] - issued) * (1 + margin)
        points[record["tag"]] = next((nodes[p].id for p in range(offload_at + 1, prefetch_at)
                                      if timeline.start[p] >= due and allowed(nodes[p])), None)  # fmt: skip
    return points
