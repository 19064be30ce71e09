"""Node classification of captured iterations: kinds, labels, phases, storages and mutation facts.

Every fact is checked against an independent source: the model and optimizer themselves, the fx
graph of the capture (its fake tensors and phase tags), or the op schemas.
"""

from __future__ import annotations

import operator
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from mutwo.ir import from_fx
from mutwo.ir.graph import Graph
from mutwo.ir.node import PHASE_ORDER, Node, NodeKind, Phase
from mutwo.runtime.capture.iteration import PHASE_META, CapturedStep, StepBinding, capture
from tests import models

aten = torch.ops.aten

WORKLOADS = {"mlp": models.mlp, "cnn": models.cnn, "bert": models.bert}
OPTIMIZERS = {
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3),
}
EXPECTED_STATE_NAMES = {"sgd-momentum": {"momentum_buffer"}, "adam": {"step", "exp_avg", "exp_avg_sq"}}

#: Ops that return a view of (or the same storage as) their first operand.
VIEW_OPS = {
    aten.t.default, aten.view.default, aten.expand.default, aten.alias.default, aten.permute.default,
    aten.transpose.int, aten.slice.Tensor, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default,
    aten.select.int, aten.as_strided.default, aten.detach.default,
}  # fmt: skip


@dataclass
class Case:
    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    batch: Any
    captured: CapturedStep
    binding: StepBinding
    graph: Graph
    fx_nodes: dict[str, fx.Node]  #: fx node of each IR node, by name (from_fx keeps fx names)

    def fx(self, node: Node) -> fx.Node:
        return self.fx_nodes[node.name]


def _capture_workload(name: str, workload: models.Workload, optimizer: torch.optim.Optimizer) -> Case:
    captured, binding = capture(workload.model, optimizer, workload.batch, workload.loss_fn)
    graph = from_fx(captured.graph_module, [(s.kind, s.label) for s in captured.slots], captured.gradient_labels)
    fx_nodes = {n.name: n for n in captured.graph_module.graph.nodes}
    assert set(fx_nodes) == {n.name for n in graph}, "from_fx must keep the fx node names"
    return Case(name, workload.model, optimizer, workload.batch, captured, binding, graph, fx_nodes)


def _capture(workload_name: str, optimizer_name: str) -> Case:
    workload = WORKLOADS[workload_name]()
    optimizer = OPTIMIZERS[optimizer_name](workload.model.parameters())
    return _capture_workload(f"{workload_name}-{optimizer_name}", workload, optimizer)


_CACHE: dict[tuple[str, str], Case] = {}


def _case(workload_name: str, optimizer_name: str) -> Case:
    key = (workload_name, optimizer_name)
    if key not in _CACHE:
        _CACHE[key] = _capture(*key)
    return _CACHE[key]


CASES = [(w, o) for w in WORKLOADS for o in OPTIMIZERS]


@pytest.fixture(scope="module", params=CASES, ids=[f"{w}-{o}" for w, o in CASES])
def case(request: pytest.FixtureRequest) -> Case:
    return _case(*request.param)


def _placeholders(graph: Graph, kind: NodeKind) -> list[Node]:
    return [n for n in graph.placeholders if n.kind is kind]


def _fake_values(fx_node: fx.Node) -> list[torch.Tensor | None]:
    """The fake tensors of an fx node's value, one per output as the IR numbers them."""
    value = fx_node.meta.get("val")
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [v if isinstance(v, torch.Tensor) else None for v in value]
    return []


def _storage_id(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def _storage_root(graph: Graph, node: Node) -> Node:
    """The placeholder or computed node whose storage ``node`` (a single tensor) lives in."""
    assert node.tensor is not None, node
    return graph.node(node.tensor.storage.creator)


# -- placeholders ----------------------------------------------------------------------------


def test_every_parameter_is_a_parameter_placeholder_with_its_qualified_name(case: Case) -> None:
    params = dict(case.model.named_parameters())
    placeholders = _placeholders(case.graph, NodeKind.PARAMETER)
    labels = [p.label for p in placeholders]
    assert Counter(labels) == Counter(list(params)), "one parameter placeholder per named parameter"
    for node in placeholders:
        param = params[node.label]
        assert node.phase is Phase.FORWARD
        assert node.tensor is not None and node.tensor.shape == tuple(param.shape), node.label
        assert node.tensor.dtype == param.dtype, node.label
        assert node.owned_bytes == param.numel() * param.element_size(), node.label


def test_every_trainable_parameter_has_exactly_one_backward_gradient(case: Case) -> None:
    params = dict(case.model.named_parameters())
    trainable = [name for name, p in params.items() if p.requires_grad]
    gradients = [n for n in case.graph if n.kind is NodeKind.GRADIENT]
    assert Counter(n.label for n in gradients) == Counter(trainable)
    returned = case.graph.output.args[0]
    assert list(returned[1:]) == [n for n in returned[1:] if n.kind is NodeKind.GRADIENT]
    assert {n.label: n for n in gradients} == dict(zip(case.captured.gradient_labels, returned[1:], strict=True))
    for node in gradients:
        assert node.op == "call_function", node
        assert node.phase is Phase.BACKWARD, node
        assert node.tensor is not None and node.tensor.shape == tuple(params[node.label].shape), node.label
        assert node.tensor.dtype == params[node.label].dtype, node.label


def test_optimizer_state_placeholders_are_exactly_parameter_times_state_name(case: Case) -> None:
    optimizer_name = case.name.split("-", 1)[1]
    params = dict(case.model.named_parameters())
    expected = {f"{name}:{state}" for name, p in params.items() if p.requires_grad
                for state in EXPECTED_STATE_NAMES[optimizer_name]}  # fmt: skip
    placeholders = _placeholders(case.graph, NodeKind.OPTIMIZER_STATE)
    assert Counter(p.label for p in placeholders) == Counter(expected)
    # ...and they match optimizer.state, which capture initialised as torch.optim's first step would.
    from_optimizer = {f"{name}:{state}": value for name, p in params.items()
                      for state, value in case.optimizer.state[p].items()}  # fmt: skip
    assert set(from_optimizer) == expected
    for node in placeholders:
        value = from_optimizer[node.label]
        assert node.phase is Phase.FORWARD
        assert node.tensor is not None
        assert (node.tensor.shape, node.tensor.dtype) == (tuple(value.shape), value.dtype), node.label
        assert node.owned_bytes == value.untyped_storage().nbytes(), node.label


def test_buffers_are_buffer_placeholders(case: Case) -> None:
    buffers = dict(case.model.named_buffers())
    placeholders = _placeholders(case.graph, NodeKind.BUFFER)
    assert Counter(p.label for p in placeholders) == Counter(list(buffers))
    for node in placeholders:
        assert node.tensor is not None and node.tensor.shape == tuple(buffers[node.label].shape)
    if case.name.startswith("cnn"):
        running = {n for n in buffers if n.endswith(("running_mean", "running_var"))}
        assert len(running) == 4 and running <= {p.label for p in placeholders}


def test_batch_tensors_are_input_placeholders(case: Case) -> None:
    leaves = [leaf for leaf in pytree.tree_leaves(case.batch) if isinstance(leaf, torch.Tensor)]
    inputs = [p for p in _placeholders(case.graph, NodeKind.INPUT) if p.label.startswith("batch")]
    assert len(inputs) == len(leaves) > 0
    for node, leaf in zip(inputs, leaves, strict=True):
        assert node.tensor is not None
        assert (node.tensor.shape, node.tensor.dtype) == (tuple(leaf.shape), leaf.dtype), node.label
    # No batch tensor hides under another kind.
    others = [p for p in case.graph.placeholders if p.label.startswith("batch") and p.kind is not NodeKind.INPUT]
    assert not others


def test_every_placeholder_has_a_known_kind(case: Case) -> None:
    for node in case.graph.placeholders:
        if node.kind is NodeKind.OTHER:
            # the hyperparameters schedulers change, fed to the graph at every call
            assert re.fullmatch(r"(lr|momentum|betas\[\d\]):group\d+", node.label), f"{node.label} is of kind other"


# -- computed nodes --------------------------------------------------------------------------


def test_activations_are_exactly_forward_values_read_by_the_backward(case: Case) -> None:
    # Independently of the IR: from the fx graph's own users and phase tags.
    expected = {
        n.name for n in case.captured.graph_module.graph.nodes
        if n.op == "call_function" and n.meta[PHASE_META] is Phase.FORWARD
        and any(u.meta.get(PHASE_META) is Phase.BACKWARD for u in n.users)
    }  # fmt: skip
    actual = {n.name for n in case.graph if n.kind is NodeKind.ACTIVATION}
    assert expected, "a training step keeps some forward values for the backward"
    assert actual == expected, (sorted(actual - expected), sorted(expected - actual))


def _check_views(case: Case) -> Counter:
    """Assert every view, alias, storage-sharing _unsafe_view and tensor getitem owns nothing;
    returns how many of each op were checked."""
    checked: Counter = Counter()
    for node in case.graph:
        if node.op != "call_function":
            continue
        fakes = _fake_values(case.fx(node))
        if node.target in VIEW_OPS:
            base = case.fx(node).args[0]
            assert _storage_id(fakes[0]) == _storage_id(base.meta["val"]), f"premise: {node.op_name} is a view"
        elif node.target is aten._unsafe_view.default:
            base = case.fx(node).args[0]
            if _storage_id(fakes[0]) != _storage_id(base.meta["val"]):
                assert node.owned_bytes == fakes[0].untyped_storage().nbytes() > 0
                continue
        elif node.target is operator.getitem:
            if not node.tensors or node.tensors[0] is None:  # getitem of a None output (unused gradient)
                assert node.owned_bytes == 0 and not node.is_alias
                continue
        else:
            continue
        checked[node.op_name] += 1
        assert node.owned_bytes == 0, node
        assert node.is_alias, node
        # The alias names the storage of what it reads, never its own.
        operand_storages = {t.storage for op in node.operands for t in op.tensors if t is not None}
        assert node.tensor is not None and node.tensor.storage in operand_storages, node
    return checked


def test_view_ops_and_getitems_are_aliases_owning_no_bytes(case: Case) -> None:
    checked = _check_views(case)
    assert checked["aten.t.default"] > 0 and checked["getitem"] > 0, checked


class _Views(nn.Module):
    """A forward made of views: permute, transpose, select, slice, unsqueeze, expand, reshape."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, _y: torch.Tensor) -> torch.Tensor:
        h = self.lin(x).permute(2, 0, 1).transpose(1, 2)[0][1:]  # [2, 2], not contiguous
        return h.unsqueeze(0).expand(4, -1, -1).reshape(4, -1)  # cannot be a view: clone + _unsafe_view


def test_every_kind_of_view_is_an_alias() -> None:
    torch.manual_seed(0)
    workload = models.Workload(_Views(), (torch.randn(2, 3, 6), torch.zeros(1)),
                               lambda output, _batch: output.pow(2).mean())  # fmt: skip
    case = _capture_workload("views", workload, torch.optim.SGD(workload.model.parameters(), lr=0.1))
    checked = _check_views(case)
    for op in ("aten.permute.default", "aten.transpose.int", "aten.select.int", "aten.slice.Tensor",
               "aten.unsqueeze.default", "aten.expand.default", "aten.t.default"):  # fmt: skip
        assert checked[op] > 0, (op, checked)
    # reshape of a non-contiguous view must copy: that copy owns its bytes, what views it owns none.
    copies = [n for n in case.graph if n.op_name == "aten.clone.default" and n.phase is Phase.FORWARD]
    assert [(n.tensor.shape, n.owned_bytes) for n in copies] == [((4, 2, 2), 4 * 2 * 2 * 4)]
    reshaped = [n for n in copies[0].users if n.op_name == "aten._unsafe_view.default"]
    assert len(reshaped) == 1 and reshaped[0].tensor.shape == (4, 4)


def test_inplace_ops_own_no_bytes_and_write_their_first_operand(case: Case) -> None:
    checked = 0
    for node in case.graph:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if not node.target._schema.name.endswith("_"):  # aten in-place ops: relu_, add_, bernoulli_, lerp_...
            continue
        checked += 1
        assert node.owned_bytes == 0, node
        assert node.is_alias, node
        written = node.mutated_operands
        assert written and written[0] is node.args[0], node
        assert node.tensor is not None and written[0].tensor is not None
        assert node.tensor.storage == written[0].tensor.storage, node
    assert checked > 0


def test_fresh_contiguous_outputs_own_numel_times_element_size(case: Case) -> None:
    checked = 0
    for node in case.graph:
        if node.op != "call_function":
            continue
        fakes = _fake_values(case.fx(node))
        assert len(fakes) == len(node.tensors), node
        owned = {meta.storage for meta in node.owned_storages()}
        expected = 0
        for index, (meta, fake) in enumerate(zip(node.tensors, fakes, strict=True)):
            if meta is None or meta.storage not in owned:
                continue
            assert meta.storage.output == index, node
            if fake.is_contiguous() and fake.storage_offset() == 0:
                assert meta.storage_bytes == fake.numel() * fake.element_size(), (node, index)
                checked += 1
            expected += fake.untyped_storage().nbytes()
        assert node.owned_bytes == expected, node
    assert checked > 10


def test_phases_are_ordered_forward_backward_optimizer(case: Case) -> None:
    phases = [n.phase for n in case.graph]
    assert [PHASE_ORDER[p] for p in phases] == sorted(PHASE_ORDER[p] for p in phases)
    assert set(phases) == {Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER}
    # The phases come from the tracer: they agree with the fx graph's tags.
    for node in case.graph:
        if node.op == "call_function":
            assert node.phase is case.fx(node).meta[PHASE_META], node


def test_optimizer_phase_holds_every_parameter_update(case: Case) -> None:
    graph = case.graph
    trainable = {n for n, p in case.model.named_parameters() if p.requires_grad}
    updated: set[str] = set()
    for node in graph:
        if node.op != "call_function":
            continue
        param_writes = [op for op in node.mutated_operands
                        if _storage_root(graph, op).op == "placeholder"
                        and _storage_root(graph, op).kind is NodeKind.PARAMETER]  # fmt: skip
        if node.kind is NodeKind.PARAMETER:
            assert param_writes, f"{node!r} is of kind parameter but writes no parameter"
        if param_writes:
            assert node.kind is NodeKind.PARAMETER, node
            assert node.phase is Phase.OPTIMIZER, f"{node!r} writes a parameter outside the optimizer phase"
            updated.update(_storage_root(graph, op).label for op in param_writes)
    assert updated == trainable


def test_optimizer_state_updates_are_in_place_in_the_optimizer_phase(case: Case) -> None:
    graph = case.graph
    updated: set[str] = set()
    for node in graph:
        if node.op == "call_function" and node.kind is NodeKind.OPTIMIZER_STATE:
            assert node.phase is Phase.OPTIMIZER, node
            root = _storage_root(graph, node)
            assert root.op == "placeholder" and root.kind is NodeKind.OPTIMIZER_STATE, node
            assert node.mutated_operands, node
            updated.add(root.label)
    assert updated == {p.label for p in _placeholders(graph, NodeKind.OPTIMIZER_STATE)}


def test_batch_norm_lists_running_statistics_among_mutated_operands() -> None:
    case = _case("cnn", "sgd-momentum")
    norms = [n for n in case.graph if n.op_name.startswith("aten.native_batch_norm.")
             or n.op_name.startswith("aten._native_batch_norm_legit")]  # fmt: skip
    assert len(norms) == 2
    for node in norms:
        running = {p for p in node.operands if p.op == "placeholder" and p.kind is NodeKind.BUFFER
                   and p.label.endswith(("running_mean", "running_var"))}  # fmt: skip
        assert len(running) == 2, node
        assert running <= set(node.mutated_operands), f"{node!r} writes {sorted(p.label for p in running)}"


def test_captured_batch_norm_really_updates_running_statistics() -> None:
    """The fact the test above looks for: running the captured graph changes the running statistics."""
    case = _case("cnn", "sgd-momentum")
    flat = case.binding.flat_inputs(case.batch) + list(case.captured.constants.values())
    flat = [t.clone() for t in flat]
    labels = [s.label for s in case.captured.slots]
    before = {label: t.clone() for label, t in zip(labels, flat, strict=True) if label.endswith("running_mean")}
    with torch.no_grad():
        case.captured.graph_module(*flat)
    after = {label: t for label, t in zip(labels, flat, strict=True) if label in before}
    assert len(before) == 2
    assert all(not torch.equal(before[label], after[label]) for label in before)


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_dropout_nodes_are_random(workload: str) -> None:
    case = _case(workload, "adam")
    dropouts = [m for m in case.model.modules() if isinstance(m, nn.Dropout) and m.p > 0]
    random_nodes = [n for n in case.graph if n.is_random]
    # Dropout is traced as bernoulli_ (or native_dropout); each dropout module draws once.
    dropout_nodes = [n for n in case.graph if n.target in (aten.bernoulli_.float, aten.native_dropout.default)]
    assert len(dropout_nodes) == len(dropouts)
    assert random_nodes == dropout_nodes
    assert all(n.phase is Phase.FORWARD for n in random_nodes)
    deterministic = [n for n in case.graph if n.target in (aten.addmm.default, aten.mm.default, aten.t.default)]
    assert deterministic and not any(n.is_random for n in deterministic)
