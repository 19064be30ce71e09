"""The IR verifier: every invariant the IR promises, each checked and named.

A violation raises :class:`VerificationError` naming the invariant and showing the offending
node between its neighbours in the text form.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

from mutwo.ir.classify import state_kind_of_update
from mutwo.ir.graph import Graph
from mutwo.ir.node import PHASE_ORDER, STATE_KINDS, Node, NodeKind, Phase, StorageKey, target_name
from mutwo.ir.printer import format_node
from mutwo.ir.swap import HOST, OFFLOAD, PREFETCH, WAIT


class VerificationError(ValueError):
    """The graph breaks an IR invariant."""

    def __init__(self, invariant: str, node: Node | None, detail: str, context: str = "") -> None:
        self.invariant = invariant
        self.node = node
        where = f" at {node!r}" if node is not None else ""
        message = f"invariant '{invariant}' violated{where}: {detail}"
        super().__init__(message + (f"\n{context}" if context else ""))


def _context(graph: Graph, node: Node, radius: int = 2) -> str:
    """The node between its neighbours, marked with '>'."""
    nodes = graph.nodes
    try:
        index = graph.position(node)
    except Exception:
        return format_node(node)
    lines = []
    for i in range(max(0, index - radius), min(len(nodes), index + radius + 1)):
        lines.append(("> " if i == index else "  ") + format_node(nodes[i]))
    return "\n".join(lines)


def _fail(graph: Graph, invariant: str, node: Node | None, detail: str) -> None:
    raise VerificationError(invariant, node, detail, _context(graph, node) if node is not None else "")


def check_unique_ids_and_names(graph: Graph) -> None:
    ids: set[int] = set()
    names: set[str] = set()
    for node in graph:
        if node.id in ids:
            _fail(graph, "unique-ids", node, f"id %{node.id} is used twice")
        if node.name in names:
            _fail(graph, "unique-names", node, f"name {node.name!r} is used twice")
        ids.add(node.id)
        names.add(node.name)
        if node.graph is not graph:
            _fail(graph, "node-ownership", node, "the node does not belong to this graph")


def check_topological_order(graph: Graph) -> None:
    seen: set[Node] = set()
    for node in graph:
        for operand in node.operands:
            if operand not in seen:
                where = "is not in the graph" if operand.graph is not graph else "is defined after its use"
                _fail(graph, "topological-order", node, f"operand {operand!r} {where}")
        seen.add(node)


def check_users(graph: Graph) -> None:
    for node in graph:
        for operand in node.operands:
            if node not in operand.users:
                _fail(graph, "operand-user-consistency", node, f"{node!r} reads {operand!r} but is not among its users")
        for user in node.users:
            if node not in user.operands:
                _fail(graph, "operand-user-consistency", node, f"{user!r} is listed as a user but does not read it")
            if not graph.has_node(user.id) or graph.node(user.id) is not user:
                _fail(graph, "operand-user-consistency", node, f"user {user!r} is not in the graph")


def check_placeholders_and_output(graph: Graph) -> None:
    nodes = graph.nodes
    outputs = [n for n in nodes if n.op == "output"]
    if len(outputs) != 1:
        _fail(graph, "single-output", outputs[1] if len(outputs) > 1 else None,
              f"the graph has {len(outputs)} output nodes; it needs exactly one")  # fmt: skip
    if nodes[-1] is not outputs[0]:
        _fail(graph, "single-output", outputs[0], "the output node is not the last node")
    seen_computation = False
    for node in nodes:
        if node.op not in ("placeholder", "call_function", "output"):
            _fail(graph, "known-op", node, f"op {node.op!r} is not placeholder, call_function or output")
        if node.op == "placeholder" and seen_computation:
            _fail(graph, "placeholders-first", node, "a placeholder comes after a computed node")
        seen_computation |= node.op != "placeholder"


def check_phases(graph: Graph) -> None:
    """The forward comes first. Optimizer updates may run inside the backward (optimizer-in-backward),
    but the backward never reads what the optimizer computes."""
    previous = Phase.FORWARD
    for node in graph:
        if node.op == "placeholder" and node.phase is not Phase.FORWARD:
            _fail(graph, "phase-order", node, "placeholders belong to the forward phase")
        if node.phase is Phase.FORWARD and previous is not Phase.FORWARD:
            _fail(graph, "phase-order", node, f"a forward node follows a {previous.value} node")
        if node.phase is Phase.BACKWARD:
            for operand in node.operands:
                if operand.phase is Phase.OPTIMIZER:
                    _fail(graph, "phase-order", node, f"a backward node reads {operand!r} of the optimizer phase")
        previous = node.phase if PHASE_ORDER[node.phase] > PHASE_ORDER[previous] else previous


def check_kinds(graph: Graph) -> None:
    for node in graph:
        kind = node.kind
        if node.op == "placeholder":
            if kind not in STATE_KINDS and kind is not NodeKind.OTHER:
                _fail(graph, "kind-phase-consistency", node, f"a placeholder cannot be of kind {kind.value}")
            continue
        if kind is NodeKind.ACTIVATION:
            if node.phase is not Phase.FORWARD:
                _fail(graph, "kind-phase-consistency", node, f"an activation must be in the forward phase, "
                                                             f"not {node.phase.value}")  # fmt: skip
            if not any(u.phase is Phase.BACKWARD for u in node.users):
                _fail(graph, "kind-phase-consistency", node, "an activation must be used by the backward phase")
        elif kind is NodeKind.GRADIENT:
            if node.phase is not Phase.BACKWARD:
                _fail(graph, "kind-phase-consistency", node, f"a gradient must be in the backward phase, "
                                                             f"not {node.phase.value}")  # fmt: skip
        elif kind in STATE_KINDS and state_kind_of_update(graph, node) is not kind:
            _fail(graph, "kind-phase-consistency", node,
                  f"a computed node of kind {kind.value} must update a {kind.value} placeholder in place")


def check_storages(graph: Graph) -> None:
    """Each tensor's storage was allocated by the node itself or reached through an operand."""
    for node in graph:
        for index, meta in enumerate(node.tensors):
            if meta is None:
                continue
            key = meta.storage
            if key.creator == node.id:
                if node.op == "call_function" and node.target is operator.getitem:
                    _fail(graph, "alias-storage", node, "a getitem cannot allocate storage")
                if meta.storage_bytes < 0:
                    _fail(graph, "alias-storage", node, f"output {index} has a negative size")
                continue
            if not graph.has_node(key.creator):
                _fail(graph, "alias-storage", node, f"output {index} aliases storage {key} whose creator is gone")
            creator = graph.node(key.creator)
            if graph.position(creator) >= graph.position(node):
                _fail(graph, "alias-storage", node, f"output {index} aliases storage {key} allocated later")
            if not any(key == t.storage for op in node.operands for t in op.tensors if t is not None):
                _fail(graph, "alias-storage", node,
                      f"output {index} aliases storage {key} that none of its operands holds")  # fmt: skip


def check_collectives(graph: Graph) -> None:
    """A storage a collective is communicating is read only by its ``wait_tensor``, and every
    collective is waited for before the iteration ends: reading it earlier reads a half-reduced
    buffer, and an unwaited collective is still running when the next iteration starts."""
    if not any(node.is_collective for node in graph):  # the usual graph: nothing in flight to read
        return
    in_flight: dict[StorageKey, Node] = {}
    for node in graph:
        if node.is_wait:
            for meta in node.tensors:
                if meta is not None:
                    in_flight.pop(meta.storage, None)
            continue
        for operand in node.operands:
            for meta in operand.tensors:
                if meta is not None and meta.storage in in_flight:
                    _fail(graph, "collective-wait", node, f"reads storage {meta.storage} while "
                          f"{in_flight[meta.storage]!r} communicates it; read it after its wait_tensor")  # fmt: skip
        if node.is_collective:
            in_flight.update((meta.storage, node) for meta in node.tensors if meta is not None)
    for key, node in in_flight.items():
        _fail(graph, "collective-wait", node, f"storage {key} is never waited for; add a wait_tensor on it")


def check_origins(graph: Graph) -> None:
    for node in graph:
        if node.origin is not None and node.op != "call_function":
            _fail(graph, "recompute-origin", node, "only computed nodes can be recompute clones")


def check_swaps(graph: Graph) -> None:
    """The swap protocol (see :mod:`mutwo.ir.swap`): an offload's host copy is read only by its
    prefetches, a prefetched tensor only through its wait (its copy may still be in flight), and
    an offloaded storage is not written after the offload (the copy out may still be reading it)."""
    offloaded: dict[StorageKey, Node] = {}
    for node in graph:
        if node.op != "call_function":
            continue
        for written in node.mutated_operands if offloaded else ():
            for meta in written.tensors:
                if meta is not None and meta.storage in offloaded:
                    _fail(graph, "swap-protocol", node, f"it writes storage {meta.storage} after "
                                                        f"{offloaded[meta.storage]!r} copies it out")  # fmt: skip
        if node.target is OFFLOAD:
            source = node.args[0]
            if node.tensor is None or node.tensor.device != HOST or source.tensor is None:
                _fail(graph, "swap-protocol", node, f"an offload copies one device tensor to {HOST} memory")
            offloaded[source.tensor.storage] = node
            readers, expected = node.users, PREFETCH
        elif node.target is PREFETCH:
            if not (isinstance(node.args[0], Node) and node.args[0].target is OFFLOAD):
                _fail(graph, "swap-protocol", node, "a prefetch reads the result of an offload")
            readers, expected = node.users, WAIT
        elif node.target is WAIT:
            if not (isinstance(node.args[0], Node) and node.args[0].target is PREFETCH):
                _fail(graph, "swap-protocol", node, "a wait reads the result of a prefetch")
            continue
        else:
            continue
        for reader in readers:
            if reader.target is not expected:
                _fail(graph, "swap-protocol", reader, f"it reads {node!r} directly; only a "
                                                      f"{target_name(expected)} may")  # fmt: skip


CHECKS: tuple[Callable[[Graph], None], ...] = (
    check_unique_ids_and_names,
    check_topological_order,
    check_users,
    check_placeholders_and_output,
    check_phases,
    check_kinds,
    check_storages,
    check_collectives,
    check_origins,
    check_swaps,
)


def verify(graph: Graph) -> None:
    """Run every check; raise :class:`VerificationError` at the first violation."""
    if len(graph) == 0:
        raise VerificationError("single-output", None, "the graph is empty")
    for check in CHECKS:
        check(graph)
