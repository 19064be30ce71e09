"""Branches the traced optimizer took on host numbers, decided while tracing and checked before every run.

RAdam's ``if rho_t > 5`` and ASGD's ``max(1, step - t0)`` branch in Python on a number computed
from the step count. The graph holds one side of the branch only, so it is right while the
condition keeps the value it had when the step was captured. That value is computed from the
graph itself: the *scalar slice* of a source is the part of the graph that produces the one-element
tensor the number is read from and every in-place write to it (``step += 1`` comes before the
read), which only involves small host tensors. The slice is run on copies of the inputs, while
tracing (on the graph built so far) to decide the branch, and before every run of the finished
graph to check that each branch would still go the same way.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing, get_proxy_mode, get_proxy_slot
from torch.utils import _pytree as pytree

from mutwo.runtime.capture.host_expressions import HostScalar, describe_encoded, evaluate
from mutwo.runtime.capture.tracing import CaptureError

#: A slice node's value may hold at most this many elements (step counts, learning rates, flags).
_SMALL = 1


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def _written(node: fx.Node) -> list[fx.Node]:
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return []
    written: list[fx.Node] = []
    for index, argument in enumerate(schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            value = node.kwargs.get(argument.name, node.args[index] if index < len(node.args) else None)
            written += [leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, fx.Node)]
    return written


def _storages(node: fx.Node) -> frozenset[int]:
    return frozenset(_storage(t) for t in _tensors(node.meta.get("val")))


class NodeStorages:
    """Each node's storages and the storages it writes, computed once per node: the scans below
    meet every node of the graph traced so far at every branch (935 branches over a 5,000-node
    graph for ResNet-152's SGD with momentum: its capture took 39 s on the CPU, 10 s since)."""

    def __init__(self) -> None:
        self._own: dict[fx.Node, frozenset[int]] = {}
        self._touched: dict[fx.Node, frozenset[int]] = {}

    def own(self, node: fx.Node) -> frozenset[int]:
        """The storages of ``node``'s value."""
        found = self._own.get(node)
        if found is None:
            found = self._own[node] = _storages(node)
        return found

    def touched(self, node: fx.Node) -> frozenset[int]:
        """The storages ``node`` produces or writes in place."""
        found = self._touched.get(node)
        if found is None:
            found = self._touched[node] = self.own(node).union(*(self.own(w) for w in _written(node)))
        return found


def scalar_slice(nodes: Sequence[fx.Node], sources: Sequence[fx.Node],
                 storages: NodeStorages | None = None) -> list[fx.Node]:  # fmt: skip
    """The nodes among ``nodes`` (in execution order) that compute the values of ``sources``:
    what produces or writes their storages, and what those nodes read, recursively. ``storages``
    keeps what it learns of each node for the next call on the same graph."""
    storages = storages or NodeStorages()
    needed: set[int] = set().union(*(storages.own(s) for s in sources))
    chosen: set[fx.Node] = set(sources)
    for node in reversed(nodes):
        if node not in chosen and not storages.touched(node) & needed:
            continue
        chosen.add(node)
        for operand in node.all_input_nodes:
            chosen.add(operand)
            needed |= storages.own(operand)
    selected = [n for n in nodes if n in chosen]
    for node in selected:
        for tensor in _tensors(node.meta.get("val")):
            if tensor.numel() > _SMALL or tensor.device.type != "cpu":
                raise CaptureError(
                    "the optimizer branches in Python on a number that depends on a tensor of the model "
                    f"({node.name}, shape {tuple(tensor.shape)} on {tensor.device}), which the captured step cannot "
                    "check before it runs; construct the optimizer with capturable=True on a GPU"
                )
    return selected


def run_slice(nodes: Sequence[fx.Node], placeholder_values: dict[fx.Node, torch.Tensor],
              attributes: Any = None) -> dict[fx.Node, Any]:  # fmt: skip
    """Run ``nodes`` on copies of the placeholders' values (nothing real is written)."""
    env: dict[fx.Node, Any] = {}
    for node in nodes:
        if node.op == "placeholder":
            env[node] = placeholder_values[node].clone()
        elif node.op == "get_attr":
            env[node] = getattr(attributes, node.target).clone()  # type: ignore[arg-type]
        else:
            args, kwargs = pytree.tree_map(lambda a: env[a] if isinstance(a, fx.Node) else a, (node.args, node.kwargs))
            env[node] = node.target(*args, **kwargs)  # type: ignore[operator]
    return env


def _source_node(tracer: Any, tensor: torch.Tensor) -> fx.Node:
    # The node's meta value is a snapshot of the traced tensor, not the tensor itself: ask the
    # tracer which node currently produces it (after in-place writes, the last writer).
    slot = get_proxy_slot(tensor, tracer, None)
    if slot is None:
        raise CaptureError("the optimizer reads a number from a tensor the graph does not hold; please report it")
    return slot.proxy.node


@dataclass
class RecordedGuard:
    """A guard of a captured graph: its condition over the graph nodes named in ``sources``."""

    condition: Any  #: encoded expression; ``["src", i]`` reads ``sources[i]``
    sources: list[str]
    outcome: bool
    #: the last node traced when the branch was taken: later writes to the sources do not count
    upto: str

    def describe(self) -> str:
        return f"{describe_encoded(self.condition)} is {self.outcome}"


class TraceDecider:
    """Decides branches while tracing: runs the scalar slice of the graph traced so far on copies
    of the real inputs (``inputs``, in placeholder order)."""

    def __init__(self, inputs: Sequence[torch.Tensor]) -> None:
        self.inputs = list(inputs)
        self.recorded: list[RecordedGuard] = []
        self._storages = NodeStorages()
        #: each condition decided so far, over its source nodes: its outcome, how many nodes the
        #: graph had then, and the storages its slice read
        self._decided: dict[tuple[str, tuple[fx.Node, ...]], tuple[bool, int, frozenset[int]]] = {}

    def __call__(self, condition: HostScalar) -> bool:
        mode = get_proxy_mode()
        if mode is None:
            raise CaptureError("a branch on a host number outside tracing; please report it")
        graph = mode.tracer.graph
        sources = [_source_node(mode.tracer, t) for t in condition.sources()]
        nodes = list(graph.nodes)
        encoded = condition.encode({id(t): i for i, t in enumerate(condition.sources())})
        key = (json.dumps(encoded), tuple(sources))
        earlier = self._decided.get(key)
        # The same condition over the same values, none of whose storages a node traced since has
        # written (SGD asks `momentum != 0` once per parameter): the same outcome, and the guard
        # already recorded checks it.
        if earlier is not None and not any(self._storages.touched(n) & earlier[2] for n in nodes[earlier[1]:]):
            return earlier[0]
        placeholders = {n: self.inputs[i] for i, n in enumerate(n for n in nodes if n.op == "placeholder")}
        chosen = scalar_slice(nodes, sources, self._storages)
        with disable_proxy_modes_tracing(), unset_fake_temporarily(), torch._C.DisableTorchFunction():
            env = run_slice(chosen, placeholders, mode.tracer.root)
            values = [env[s].item() for s in sources]
        outcome = bool(evaluate(encoded, values))
        read = frozenset().union(*(self._storages.own(n) for n in chosen))
        self._decided[key] = (outcome, len(nodes), read)
        self.recorded.append(RecordedGuard(encoded, [s.name for s in sources], outcome, nodes[-1].name))
        return outcome


class GuardCheck:
    """Checks the guards of a captured graph against the inputs of the next run."""

    def __init__(self, graph_module: fx.GraphModule, guards: Sequence[RecordedGuard]) -> None:
        self.guards = list(guards)
        nodes = list(graph_module.graph.nodes)
        by_name = {n.name: n for n in nodes}
        position = {n: i for i, n in enumerate(nodes)}
        self.sources = [[by_name[name] for name in guard.sources] for guard in self.guards]
        # Each guard sees the graph as it was when its branch was taken.
        storages = NodeStorages()
        self.slices = [scalar_slice(nodes[:position[by_name[guard.upto]] + 1], sources, storages)
                       for guard, sources in zip(self.guards, self.sources, strict=True)]  # fmt: skip
        self.placeholder_index = {n: i for i, n in enumerate(n for n in nodes if n.op == "placeholder")}

    def failing(self, inputs: Sequence[torch.Tensor]) -> RecordedGuard | None:
        """The first guard that would branch the other way on ``inputs``, or None."""
        for guard, sources, nodes in zip(self.guards, self.sources, self.slices, strict=True):
            placeholders = {n: inputs[self.placeholder_index[n]] for n in nodes if n.op == "placeholder"}
            with torch.no_grad():
                env = run_slice(nodes, placeholders)
            if bool(evaluate(guard.condition, [env[s].item() for s in sources])) != guard.outcome:
                return guard
        return None


