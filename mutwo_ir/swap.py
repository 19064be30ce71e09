"""Swapping activations to host memory, in the IR: the ``mutwo`` swap ops, which storages can be
swapped, and the rewrite that inserts the swaps (together with recomputations, μ-TWO style).

A swapped activation storage ``s`` goes through three ops, each an ordinary IR node:

* ``mutwo.offload(x, tag)`` right after the last forward use of ``s``: copies ``x`` (the tensor
  that allocated ``s``, covering it whole) into a host buffer and returns that buffer. Its
  value lives in :data:`HOST` memory, so the device storage of ``s`` is freed after it;
* ``mutwo.prefetch(host, device, tag)`` at a *prompt* node before the first backward use:
  allocates a fresh device storage and starts copying the host buffer into it;
* ``mutwo.wait(x, tag)`` right before the first backward use: the copy has finished; its
  result is ``x`` itself (an alias of the prefetched storage).

Backward readers of ``s`` then read the waited tensor, or a replay of the views they read on it.
Because every reader goes through ``wait``, nothing can read a tensor whose copy is in flight;
:func:`mutwo.ir.verifier.verify` checks that protocol. The kernels (side streams, events, pinned
host buffers reused across iterations) are :mod:`mutwo.runtime.execution.swap`'s; this module only
defines the ops' schemas and shapes, so the IR, fx, the printers and the simulators see them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from mutwo.ir.classify import classify
from mutwo.ir.graph import Graph
from mutwo.ir.liveness import Liveness
from mutwo.ir.node import HOST, Node, NodeKind, Phase, StorageKey, TensorMeta
from mutwo.ir.recompute import Recompute, _mutation_positions, follow_storage, insert_blocks

_LIBRARY = torch.library.Library("mutwo", "FRAGMENT")
_LIBRARY.define("offload(Tensor x, int tag) -> Tensor")
_LIBRARY.define("prefetch(Tensor host, Device device, int tag) -> Tensor")
_LIBRARY.define("wait(Tensor(a) x, int tag) -> Tensor(a)")
# ``offload`` as compiled backends run it: Inductor may place ``x`` inside a larger buffer (a slice
# of a cat's output), so this copies ``x``'s elements rather than requiring it to own its storage.
_LIBRARY.define("offload_elements(Tensor x, int tag) -> Tensor")
# ``wait`` as compiled backends run it: writes nothing, but declared as writing ``x`` so that
# functionalization orders its readers after it (a custom op returning an alias of its input
# cannot be functionalized); Inductor's reinplacing then calls it on ``x`` itself.
_LIBRARY.define("wait_(Tensor(a!) x, int tag) -> ()")
# The release point of a swap recorded as a CUDA graph (mutwo.runtime.execution.swap_graphs inserts it in the
# fx graph of a graphed backend, never in the IR): the compute stream waits for the copy out into
# ``host``, and the swap runtime drops the device tensor it kept for that copy, so its block is
# freed here in the compute stream's order, without ``record_stream`` (whose free a capture
# defers to its end). Declared as writing ``host`` so that the prefetch reading ``host`` stays
# after it, under Inductor as in eager.
_LIBRARY.define("release_(Tensor(a!) host, int tag) -> ()")

OFFLOAD = torch.ops.mutwo.offload.default
PREFETCH = torch.ops.mutwo.prefetch.default
WAIT = torch.ops.mutwo.wait.default
WAIT_IN_PLACE = torch.ops.mutwo.wait_.default
OFFLOAD_ELEMENTS = torch.ops.mutwo.offload_elements.default
RELEASE_IN_PLACE = torch.ops.mutwo.release_.default
SWAP_OPS = (OFFLOAD, PREFETCH, WAIT)
#: ``Graph.meta`` key of the release points insert-swap records: offload tag -> id of the node
#: before which a step recorded as a CUDA graph frees the offloaded tensor (mutwo.runtime.execution.swap_graphs).
SWAP_RELEASES = "swap_releases"


@torch.library.register_fake("mutwo::offload")
def _offload_fake(x: torch.Tensor, tag: int) -> torch.Tensor:
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="cpu")


@torch.library.register_fake("mutwo::prefetch")
def _prefetch_fake(host: torch.Tensor, device: torch.device, tag: int) -> torch.Tensor:
    return torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)


@torch.library.register_fake("mutwo::wait")
def _wait_fake(x: torch.Tensor, tag: int) -> torch.Tensor:
    return x


@torch.library.register_fake("mutwo::offload_elements")
def _offload_elements_fake(x: torch.Tensor, tag: int) -> torch.Tensor:
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="cpu")


@torch.library.register_fake("mutwo::wait_")
def _wait_in_place_fake(x: torch.Tensor, tag: int) -> None:
    return None


@torch.library.register_fake("mutwo::release_")
def _release_in_place_fake(host: torch.Tensor, tag: int) -> None:
    return None


class NotSwappable(Exception):
    """The storage cannot be swapped out and back; the message says why."""


@dataclass
class SwapSite:
    """Where and how one activation storage can be swapped (positions are ranks of the graph it
    was analysed on; nodes are named by id)."""

    storage: StorageKey
    bytes: int
    base: int  #: the node whose tensor allocated the storage and covers it: what is offloaded
    targets: list[int]  #: forward holders read after the forward pass: their readers move to the swapped-in copy
    chains: dict[int, list[int]]  #: forward holder -> the view/in-place nodes from the base to it (base excluded)
    last_forward_use: int
    first_backward_use: int
    last_backward_use: int
    offload_before: int  #: id of the node right after the last forward use
    wait_before: int  #: id of the first node reading the storage after the forward pass

    @property
    def window(self) -> tuple[int, int]:
        """Ranks during which the swapped-in copy is live (and read through ``wait``)."""
        return self.first_backward_use, self.last_backward_use


def _in_place_view(node: Node) -> bool:
    return torch.Tag.inplace_view in getattr(node.target, "tags", ())


def _holds(node: Node, storage: StorageKey) -> bool:
    return any(t is not None and t.storage == storage for t in node.tensors)


class SwapAnalysis:
    """Which storages of one graph can be swapped, and how (see :meth:`site`)."""

    def __init__(self, graph: Graph, liveness: Liveness) -> None:
        self.graph = graph
        self.liveness = liveness
        self.nodes = graph.nodes
        self.mutations = _mutation_positions(graph, liveness)

    def site(self, storage: StorageKey) -> SwapSite:
        """How ``storage`` can be swapped, or :class:`NotSwappable`.

        It must be an activation on the device, not returned, not written after its last forward
        use (the copy out runs while later nodes run), allocated by a tensor that covers it whole,
        and every forward holder read later must be that tensor, a view of it or an in-place
        result on it (not an in-place *view* op, which would change the tensor the copy reproduces).
        """
        record = self.liveness.storages[storage]
        if not record.is_activation or record.returned or record.bytes == 0 or record.device == HOST:
            raise NotSwappable(f"{storage} is not an activation on the device")
        first_bw = record.first_backward_use
        assert first_bw is not None
        last_fw = record.last_forward_use if record.last_forward_use is not None else record.created
        if any(rank > last_fw for rank in self.mutations.get(storage, ())):
            raise NotSwappable(f"{storage} is written in place after its last forward use")
        holders = [self.graph.node(h) for h in record.holders]
        if any(_in_place_view(h) for h in holders):
            raise NotSwappable(f"{storage} is changed by an in-place view op")
        forward = [h for h in holders if h.phase is Phase.FORWARD]
        base = next((h for h in forward if h.tensor is not None and h.tensor.storage == storage), None)
        if base is None or base.tensor is None or \
                math.prod(base.tensor.shape) * base.tensor.dtype.itemsize != record.bytes:
            raise NotSwappable(f"no tensor of {storage} covers it whole")
        chains: dict[int, list[int]] = {base.id: []}
        for holder in forward:
            _chain(holder, storage, chains)
        rank = self.liveness.rank
        targets = [h.id for h in forward if any(rank[u.id] > last_fw for u in h.users)]
        missing = [t for t in targets if t not in chains]
        if missing:
            raise NotSwappable(f"{self.graph.node(missing[0])!r} reads {storage} after the forward pass but is "
                               f"not a view of {base!r}")  # fmt: skip
        return SwapSite(storage, record.bytes, base.id, targets, chains, last_fw, first_bw,
                        record.last_backward_use or first_bw, self.nodes[last_fw + 1].id,
                        self.nodes[first_bw].id)  # fmt: skip


def _chain(holder: Node, storage: StorageKey, chains: dict[int, list[int]]) -> list[int] | None:
    """The nodes that derive ``holder`` from ``base`` (memoised in ``chains``), or None: views
    and getitems are replayed, in-place results are the tensor they write."""
    if holder.id in chains:
        return chains[holder.id]
    if holder.op != "call_function":
        return None
    written = holder.mutated_operands
    if written:  # an in-place result (random or not: it is not replayed) is the tensor it wrote
        sources = [w for w in written if _holds(w, storage)] if len(written) == 1 else []
        step: list[int] = []
    else:
        sources = [o for o in holder.operands if _holds(o, storage)] if holder.is_alias and not holder.is_random else []
        step = [holder.id]
    if len(sources) != 1:
        return None
    prefix = _chain(sources[0], storage, chains)
    if prefix is None:
        return None
    chains[holder.id] = prefix + step
    return chains[holder.id]


@dataclass(frozen=True)
class Placement:
    """One swap of a plan: the site and the node before which the prefetch is issued."""

    site: SwapSite
    prefetch_before: int


@dataclass
class SwapRewrite:
    """What :func:`rewrite` inserted."""

    swaps: dict[str, dict[str, int]] = field(default_factory=dict)  #: storage -> offload, prefetch, wait ids
    replacements: dict[int, int] = field(default_factory=dict)  #: forward holder -> node its late readers read
    clones: dict[int, list[int]] = field(default_factory=dict)  #: recompute clones, original id -> clone ids


def insert_swaps(graph: Graph, placements: Sequence[Placement], extra: Iterable[int] = ()) -> dict[int, Node]:
    """Insert offload, prefetch and wait for every placement and redirect late readers; returns,
    for each target holder (and each holder in ``extra`` that has a chain), the node that stands
    for it after the wait.

    All offloads go in first, then all prefetches, then the waits: where several land before the
    same node they keep that order, which is the order the timeline simulator assumes.
    """
    extra = set(extra)
    offloaded: dict[StorageKey, Node] = {}
    for placement in sorted(placements, key=lambda p: (p.site.last_forward_use, p.site.storage)):
        site = placement.site
        base = graph.node(site.base)
        meta = base.tensor
        assert meta is not None
        offloaded[site.storage] = graph.create_node(
            "call_function", OFFLOAD, (base, site.base), name="offload", phase=Phase.FORWARD,
            tensors=(TensorMeta(meta.shape, meta.dtype, HOST, StorageKey(-1), site.bytes),),
            before=graph.node(site.offload_before),
        )  # fmt: skip
    prefetched: dict[StorageKey, Node] = {}
    for placement in sorted(placements, key=lambda p: (p.site.first_backward_use, p.site.storage)):
        site, prompt = placement.site, graph.node(placement.prefetch_before)
        meta = graph.node(site.base).tensor
        assert meta is not None
        prefetched[site.storage] = graph.create_node(
            "call_function", PREFETCH, (offloaded[site.storage], torch.device(meta.device), site.base),
            name="prefetch", phase=prompt.phase,
            tensors=(TensorMeta(meta.shape, meta.dtype, meta.device, StorageKey(-1), site.bytes),), before=prompt,
        )  # fmt: skip
    replacements: dict[int, Node] = {}
    for placement in sorted(placements, key=lambda p: (p.site.first_backward_use, p.site.storage)):
        replacements.update(_swap_in(graph, placement.site, prefetched[placement.site.storage], extra))
    return replacements


def _swap_in(graph: Graph, site: SwapSite, prefetch: Node, extra: set[int]) -> dict[int, Node]:
    """The wait for ``site`` and the replays of the holders read later; redirects their readers."""
    point = graph.node(site.wait_before)
    wait = graph.create_node("call_function", WAIT, (prefetch, site.base), name="wait", phase=point.phase,
                             tensors=prefetch.tensors, before=point)  # fmt: skip
    standing: dict[int, Node] = {site.base: wait}
    wanted = [h for h in site.chains if h in extra or h in site.targets]
    for holder_id in wanted:
        for step in site.chains[holder_id]:
            if step in standing:
                continue
            original = graph.node(step)
            source = next(o for o in original.operands if _holds(o, site.storage))
            operand = _standing(graph, site, source, standing)
            standing[step] = graph.copy_node(original, {source: operand}, before=point, phase=point.phase,
                                             kind=NodeKind.OTHER)  # fmt: skip
    last = graph.nodes[graph.position(point) - 1]
    result: dict[int, Node] = {}
    for holder_id in wanted:
        holder, replacement = graph.node(holder_id), _standing(graph, site, graph.node(holder_id), standing)
        if holder_id in site.targets:
            readers = [u for u in holder.users if graph.position(u) > graph.position(last)]
            graph.replace_uses_after(holder, replacement, last)
            follow_storage(holder, replacement, readers)
        result[holder_id] = replacement
    return result


def _standing(graph: Graph, site: SwapSite, holder: Node, standing: dict[int, Node]) -> Node:
    """What stands for ``holder`` after the wait: its replay, or for an in-place result what
    stands for the tensor it wrote (in-place ops return the tensor they write)."""
    while holder.id not in standing:
        holder = next(w for w in holder.mutated_operands if _holds(w, site.storage))
    return standing[holder.id]


def rewrite(graph: Graph, liveness: Liveness, placements: Sequence[Placement],
            recompute: Sequence[StorageKey], mask_replay: bool = False) -> SwapRewrite:  # fmt: skip
    """Apply a plan of swaps and recomputations to ``graph`` (which ``liveness`` describes).

    Recompute blocks are planned as :class:`mutwo.ir.recompute.Recompute` plans them, with the
    swapped storages gone from the device after their offload: a block whose insertion point
    falls in a swapped storage's window reads the swapped-in copy, otherwise it recomputes that
    storage too (μ-TWO's Algorithm F for swaps). ``mask_replay``: dropouts are recomputed from
    the masks they drew (a compiled backend's plan).
    """
    for placement in placements:
        site, at = placement.site, liveness.rank.get(placement.prefetch_before, -1)
        if not site.last_forward_use < at <= site.first_backward_use:
            raise NotSwappable(f"{site.storage}: its prefetch (before rank {at}) must come after its last forward use "
                               f"(rank {site.last_forward_use}) and by its first backward use (rank "
                               f"{site.first_backward_use}); re-run select-swap to plan it again")  # fmt: skip
    swapped = {p.site.storage for p in placements}
    windows = {holder: (*p.site.window, p.site.storage) for p in placements for holder in p.site.chains}
    blocks = Recompute(graph, liveness, mask_replay=mask_replay).plan(recompute, dropped=swapped, live_clones=windows)
    needed = {source for block in blocks for source in block.from_clones if source in windows}
    standing = insert_swaps(graph, placements, needed)
    clones = insert_blocks(graph, blocks, live=standing)
    classify(graph)
    result = SwapRewrite(replacements={k: v.id for k, v in standing.items()}, clones=clones)
    for node in graph:
        if node.target is WAIT:
            prefetch = node.args[0]
            offload = prefetch.args[0]
            storage = offload.args[0].tensor.storage
            result.swaps[str(storage)] = {"offload": offload.id, "prefetch": prefetch.id, "wait": node.id}
    return result


def swap_nodes(graph: Graph) -> list[tuple[Node, Node, Node]]:
    """(offload, prefetch, wait) of every swap in ``graph``, in the order of the waits."""
    return [(w.args[0].args[0], w.args[0], w) for w in graph if w.op == "call_function" and w.target is WAIT]
