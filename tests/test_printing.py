"""The text printer, the Graphviz drawing and the lowering back to fx."""

from __future__ import annotations

import operator
import re
import time
from pathlib import Path

import pydot
import pytest
import torch
from torch import nn

from mutwo.ir import from_fx
from mutwo.ir.dot import HIGHLIGHT_COLOUR, KIND_COLOURS, to_dot, write_dot
from mutwo.ir.graph import Graph
from mutwo.ir.node import NodeKind, Phase, StorageKey, TensorMeta
from mutwo.ir.printer import format_node, print_graph
from mutwo.ir.to_fx import NODE_ID_META, to_fx
from mutwo.ir.verifier import verify
from mutwo.runtime.capture.iteration import capture
from tests import models
from tests.scaling import assert_linear

GOLDEN = Path(__file__).parent / "golden" / "linear_sgd.txt"
aten = torch.ops.aten


def _lower(workload: models.Workload, optimizer: torch.optim.Optimizer) -> Graph:
    captured, _ = capture(workload.model, optimizer, workload.batch, workload.loss_fn)
    return from_fx(captured.graph_module, [(s.kind, s.label) for s in captured.slots], captured.gradient_labels)


def _mse(output: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return ((output - batch[1]) ** 2).mean()


def linear_workload() -> models.Workload:
    torch.manual_seed(0)
    return models.Workload(models.Classifier(nn.Linear(3, 2)), (torch.randn(2, 3), torch.randn(2, 2)), _mse)


def linear_graph() -> Graph:
    workload = linear_workload()
    return _lower(workload, torch.optim.SGD(workload.model.parameters(), lr=0.1))


def mlp_graph() -> Graph:
    workload = models.mlp()
    return _lower(workload, torch.optim.Adam(workload.model.parameters(), lr=1e-3))


# -- text ------------------------------------------------------------------------------------


def test_printing_is_deterministic_across_captures() -> None:
    first, second = mlp_graph(), mlp_graph()
    text = print_graph(first)
    assert text == print_graph(second)
    assert text == print_graph(first), "printing twice gives the same text"
    assert text == print_graph(first.copy())


def test_one_line_per_node_in_execution_order() -> None:
    graph = mlp_graph()
    text = print_graph(graph)
    assert text.endswith("\n")
    lines = text.splitlines()
    assert len(lines) == len(graph)
    for line, node in zip(lines, graph, strict=True):
        assert line == format_node(node)
        assert line.startswith(f"%{node.id} {node.kind.value} {node.phase.value} ")
        assert "\n" not in line


def test_linear_sgd_golden() -> None:
    """The whole text of a tiny iteration, checked by hand once (see tests/golden/linear_sgd.txt)."""
    assert print_graph(linear_graph()) == GOLDEN.read_text(encoding="utf-8")


def test_golden_fields_agree_with_the_graph() -> None:
    """The golden file's bytes, aliases, kinds and phases, re-derived from the graph's own facts."""
    graph = linear_graph()
    for line, node in zip(GOLDEN.read_text(encoding="utf-8").splitlines(), graph, strict=True):
        _, kind, phase, _type, memory = line.split(" = ")[0].split(" ")
        assert (kind, phase) == (node.kind.value, node.phase.value)
        meta = node.tensor
        if node.is_alias:
            assert memory == f"alias(%{meta.storage.creator})"
            assert graph.node(meta.storage.creator).owned_bytes > 0
        elif meta is None:
            assert memory == "0B" and node.op == "output"
        else:
            element_size = torch.empty((), dtype=meta.dtype).element_size()
            assert memory == f"{torch.Size(meta.shape).numel() * element_size}B"


@pytest.mark.parametrize("foreach", [False, True], ids=["per-parameter", "foreach"])
def test_recorded_optimizer_calls_print_as_the_calls_they_run(foreach: bool) -> None:
    """Adam's updates (``mutwo.host_call*``, ``host_scalar``, ``foreach_host_call*``) show torch's
    call with its numbers as expressions, not the JSON they carry; every operand is still named."""
    workload = models.mlp()
    graph = _lower(workload, torch.optim.Adam(workload.model.parameters(), lr=1e-3, foreach=foreach))
    recorded = [node for node in graph if node.op_name.startswith("mutwo.")]
    assert recorded
    for node in recorded:
        line = format_node(node)
        call = line.split(" = ", 1)[1]
        assert "{" not in call and '"' not in call and len(line) < 400, line
        assert call.startswith(node.op_name.removesuffix(".default") + ("(" if "host_scalar" in call else " ")), line
        named = set(re.findall(r"%(\d+)\b", call))
        assert named == {str(operand.id) for operand in node.operands}, line
    text = print_graph(graph)
    if foreach:
        assert re.search(r"= mutwo\.host_scalar\(1 - %\d+\)\n", text)
        assert re.search(r"= mutwo\.foreach_host_call_ torch\._foreach_addcdiv_\(\[%\d+(, %\d+)*\], ", text)
    else:
        # param.addcdiv_(exp_avg, denom, value=-step_size), step_size = lr / (1 - beta1 ** step)
        assert re.search(r"= mutwo\.host_call_one_ Tensor\.addcdiv_\(%\d+, %\d+, %\d+, "
                         r"value=-\(%\d+ / \(1 - \(%\d+ \*\* %\d+\)\)\)\)\n", text)  # fmt: skip


def test_a_recorded_call_whose_text_cannot_be_read_prints_as_any_op() -> None:
    import mutwo.runtime.capture.host_call_ops  # noqa: F401  (defines the mutwo ops)

    graph = Graph()
    meta = TensorMeta((2,), torch.float32, "cpu", StorageKey(-1), 8)
    x = graph.create_node("placeholder", "x", name="x", kind=NodeKind.PARAMETER, tensors=(meta,), label="w")
    node = graph.create_node("call_function", torch.ops.mutwo.host_call_one_.default, (x, "not json", [], []),
                             name="update", tensors=(meta,))  # fmt: skip
    assert format_node(node).endswith(f"= mutwo.host_call_one_.default(%{x.id}, not json, [], [])")


def _chain(length: int) -> Graph:
    """A placeholder then ``length`` nodes alternating relu (a new storage) and t (a view of it).

    Names are given unique (``relu_12``) so that building does not hit Graph's quadratic naming
    (see test_building_with_repeated_names_is_not_quadratic)."""
    graph = Graph()
    meta = TensorMeta((64, 64), torch.float32, "cpu", StorageKey(-1), 64 * 64 * 4)
    last = graph.create_node("placeholder", "x", name="x", kind=NodeKind.INPUT, tensors=(meta,), label="batch[0]")
    for index in range(length):
        if index % 2 == 0:
            last = graph.create_node("call_function", aten.relu.default, (last,), name=f"relu_{index}",
                                     tensors=(meta,))  # fmt: skip
        else:
            view = TensorMeta((64, 64), torch.float32, "cpu", last.tensor.storage, 64 * 64 * 4)
            last = graph.create_node("call_function", aten.t.default, (last,), name=f"t_{index}", tensors=(view,))
    graph.create_node("output", "output", ((last,),), name="output", phase=Phase.OPTIMIZER)
    return graph


def _printing_seconds(length: int) -> float:
    graph = _chain(length)
    start = time.perf_counter()
    print_graph(graph)
    return time.perf_counter() - start


def test_printing_a_large_graph_is_linear() -> None:
    lines = print_graph(_chain(20_000)).splitlines()
    assert len(lines) == 20_002
    assert lines[2] == "%2 other forward f32[64,64] alias(%1) = aten.t.default(%1)"
    assert lines[-2].startswith("%20000 other forward f32[64,64] alias(%19999) = aten.t.default(%19999)")
    assert_linear(_printing_seconds, 20_000, "printing a chain")


def _build_with_repeated_names(length: int) -> tuple[Graph, float]:
    graph = Graph()
    meta = TensorMeta((4,), torch.float32, "cpu", StorageKey(-1), 16)
    last = graph.create_node("placeholder", "x", name="x", kind=NodeKind.INPUT, tensors=(meta,))
    start = time.perf_counter()
    for _ in range(length):
        last = graph.create_node("call_function", aten.relu.default, (last,), name="relu", tensors=(meta,))
    return graph, time.perf_counter() - start


def test_building_with_repeated_names_is_not_quadratic() -> None:
    graph, _ = _build_with_repeated_names(20_000)
    assert len({n.name for n in graph}) == len(graph) == 20_001
    assert_linear(lambda length: _build_with_repeated_names(length)[1], 20_000, "building with repeated names")


def test_clones_are_marked_with_their_origin() -> None:
    graph = linear_graph()
    sub = next(n for n in graph if n.op_name == "aten.sub.Tensor")
    first_backward = next(n for n in graph if n.phase is Phase.BACKWARD)
    clone = graph.copy_node(sub, {}, after=first_backward, phase=Phase.BACKWARD, kind=NodeKind.OTHER)
    line = format_node(clone)
    assert f"clone-of(%{sub.id})" in line
    assert line.startswith(f"%{clone.id} other backward f32[2,2] 16B clone-of(%{sub.id}) = aten.sub.Tensor(")
    assert "clone-of" not in format_node(sub)


def test_zero_byte_allocation_prints_as_zero_bytes_not_alias() -> None:
    graph = Graph()
    empty = TensorMeta((0,), torch.uint8, "cpu", StorageKey(-1), 0)
    node = graph.create_node("call_function", aten.empty.memory_format, ([0],), name="empty", tensors=(empty,))
    assert not node.is_alias and node.owned_storages()  # it owns its (empty) storage
    line = format_node(node)
    assert "alias(" not in line, line
    assert " u8[0] 0B = " in line, line


def test_captured_zero_byte_allocations_are_not_printed_as_aliases() -> None:
    """The same defect where it occurs: the cnn's captured BatchNorm allocates empty([0]) tensors."""
    workload = models.cnn()
    graph = _lower(workload, torch.optim.SGD(workload.model.parameters(), lr=0.1))
    empties = [n for n in graph if n.op_name == "aten.empty.memory_format"]
    assert empties and all(not n.is_alias and n.owned_bytes == 0 for n in empties)
    for node in empties:
        assert "alias()" not in format_node(node), format_node(node)


# -- dot -------------------------------------------------------------------------------------


def _unquote(value: str | None) -> str | None:
    return None if value is None else value.strip('"')


def _graph_nodes(dot: pydot.Dot) -> dict[str, pydot.Node]:
    return {n.get_name(): n for n in dot.get_nodes() if re.fullmatch(r"n\d+", n.get_name())}


def _graph_with_a_clone() -> tuple[Graph, int]:
    graph = linear_graph()
    sub = next(n for n in graph if n.op_name == "aten.sub.Tensor")
    pow_backward = next(n for n in graph if n.phase is Phase.BACKWARD and n.op_name == "aten.pow.Tensor_Scalar")
    clone = graph.copy_node(sub, {}, before=pow_backward, phase=Phase.BACKWARD, kind=NodeKind.OTHER)
    assert graph.replace_uses_after(sub, clone, clone) == 1
    sub.kind = NodeKind.OTHER  # what a recompute pass does: the backward no longer reads the original
    verify(graph)
    return graph, clone.id


def test_dot_fill_colours_follow_kinds_and_highlights() -> None:
    graph, clone_id = _graph_with_a_clone()
    highlighted = {0, 7}
    dot = to_dot(graph, highlight=highlighted, title="linear")
    nodes = _graph_nodes(dot)
    assert set(nodes) == {f"n{n.id}" for n in graph}
    assert {n.kind for n in graph} >= {NodeKind.PARAMETER, NodeKind.INPUT, NodeKind.ACTIVATION, NodeKind.GRADIENT}
    for node in graph:
        attrs = nodes[f"n{node.id}"].get_attributes()
        assert _unquote(attrs["fillcolor"]) == KIND_COLOURS[node.kind], node
        marked = node.id in highlighted or node.origin is not None
        assert (_unquote(attrs.get("color")) == HIGHLIGHT_COLOUR) is marked, node
        if marked:
            assert _unquote(attrs.get("penwidth")) == "3"
    assert graph.node(clone_id).origin is not None
    assert f"clone of %{graph.node(clone_id).origin}" in _unquote(nodes[f"n{clone_id}"].get_attributes()["label"])
    # Edges: one per operand; those leaving a clone are red.
    edges = dot.get_edges()
    assert len(edges) == sum(len(n.operands) for n in graph)
    for edge in edges:
        red = _unquote(edge.get_attributes().get("color")) == HIGHLIGHT_COLOUR
        assert red is (edge.get_source() == f"n{clone_id}"), edge.to_string()


def test_dot_has_a_legend_cluster() -> None:
    dot = to_dot(linear_graph())
    clusters = [s for s in dot.get_subgraphs() if s.get_name() == "cluster_legend"]
    assert len(clusters) == 1
    legend = {n.get_name(): n for n in clusters[0].get_nodes()}
    for kind, colour in KIND_COLOURS.items():
        node = legend[f"legend_{kind.value}"]
        assert _unquote(node.get_attributes()["fillcolor"]) == colour
        assert _unquote(node.get_attributes()["label"]) == kind.value
    assert _unquote(legend["legend_clone"].get_attributes()["color"]) == HIGHLIGHT_COLOUR
    assert len(legend) == len(KIND_COLOURS) + 1


@pytest.mark.parametrize("which", ["linear", "bert"])
def test_write_dot_parses_back_with_the_same_nodes(tmp_path: Path, which: str) -> None:
    if which == "linear":
        graph, clone_id = _graph_with_a_clone()
        highlight = [clone_id, 3]
    else:
        workload = models.bert()
        graph = _lower(workload, torch.optim.AdamW(workload.model.parameters(), lr=1e-3))
        highlight = []
    path = tmp_path / "graph.dot"
    write_dot(graph, str(path), highlight=highlight, title=which)
    parsed = pydot.graph_from_dot_file(str(path))
    assert parsed is not None and len(parsed) == 1
    dot = parsed[0]
    nodes = _graph_nodes(dot)
    assert set(nodes) == {f"n{n.id}" for n in graph}
    legend = [n for s in dot.get_subgraphs() for n in s.get_nodes()]
    assert len(legend) == len(KIND_COLOURS) + 1
    all_named = [n for n in dot.get_nodes() if n.get_name() != "node"] + legend
    assert len(all_named) == len(graph) + len(KIND_COLOURS) + 1
    assert len(dot.get_edges()) == sum(len(n.operands) for n in graph)
    for node in graph:
        attrs = nodes[f"n{node.id}"].get_attributes()
        assert _unquote(attrs["fillcolor"]) == KIND_COLOURS[node.kind]
        assert _unquote(attrs["label"]).startswith(f"%{node.id} ")


# -- to_fx -----------------------------------------------------------------------------------


def _freed_names(code: str) -> set[str]:
    """Names the generated code sets to None (``a = b = None`` after a statement)."""
    freed: set[str] = set()
    for statement in re.split(r";|\n", code):
        statement = statement.strip()
        if statement.endswith("= None"):
            freed.update(name.strip() for name in statement.split("=")[:-1])
    return freed


def test_to_fx_frees_every_value_after_its_last_use() -> None:
    graph = mlp_graph()
    module = to_fx(graph)
    code = module.code
    assert "= None" in code
    returned = {n.name for n in graph.output.operands}
    freed = _freed_names(code)
    for node in graph:
        if node.op == "output" or node.name in returned:
            continue
        assert node.name in freed, f"{node.name} is never freed"
    assert not returned & freed, "returned values cannot be freed"


def test_to_fx_keeps_ids_and_names() -> None:
    graph, clone_id = _graph_with_a_clone()
    module = to_fx(graph)
    fx_nodes = list(module.graph.nodes)
    assert len(fx_nodes) == len(graph)
    for fx_node, node in zip(fx_nodes, graph, strict=True):
        assert fx_node.meta[NODE_ID_META] == node.id
        assert fx_node.op == node.op
        if node.op != "output":
            assert fx_node.name == node.name
    # The clone's id is not its position: ids really are the IR's, not a renumbering.
    assert [n.id for n in graph].index(clone_id) != clone_id


def test_to_fx_runs_like_the_captured_module() -> None:
    workload = linear_workload()
    optimizer = torch.optim.SGD(workload.model.parameters(), lr=0.1)
    captured, binding = capture(workload.model, optimizer, workload.batch, workload.loss_fn)
    graph = from_fx(captured.graph_module, [(s.kind, s.label) for s in captured.slots], captured.gradient_labels)
    inputs = binding.flat_inputs(workload.batch)
    expected_inputs, actual_inputs = [t.clone() for t in inputs], [t.clone() for t in inputs]
    with torch.no_grad():
        expected = captured.graph_module(*expected_inputs)
        actual = to_fx(graph)(*actual_inputs)
    assert len(actual) == len(expected) == 3
    for a, b in zip(actual, expected, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(actual_inputs, expected_inputs, strict=True):  # in-place parameter updates happened alike
        assert torch.equal(a, b)
    assert not torch.equal(actual_inputs[0], inputs[0])


def test_getitem_is_printed_as_getitem() -> None:
    workload = models.mlp()
    graph = _lower(workload, torch.optim.SGD(workload.model.parameters(), lr=0.1))
    getitems = [n for n in graph if n.target is operator.getitem]
    assert getitems
    for node in getitems:
        assert re.search(r"= getitem\(%\d+, \d+\)$", format_node(node)), format_node(node)
