"""Graphviz drawings of the IR through pydot: coloured by kind, recompute clones highlighted."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

import pydot

from mutwo.ir.graph import Graph
from mutwo.ir.node import Node, NodeKind
from mutwo.ir.pass_base import write_atomic

#: Fill colour of each kind; the legend in the drawing repeats it.
KIND_COLOURS: dict[NodeKind, str] = {
    NodeKind.PARAMETER: "#8fbc8f",
    NodeKind.BUFFER: "#b0c4de",
    NodeKind.INPUT: "#f0e68c",
    NodeKind.ACTIVATION: "#ffa07a",
    NodeKind.GRADIENT: "#dda0dd",
    NodeKind.OPTIMIZER_STATE: "#87ceeb",
    NodeKind.COMMUNICATION: "#ffd700",
    NodeKind.OTHER: "#f5f5f5",
}
HIGHLIGHT_COLOUR = "#d62728"


def _label(node: Node) -> str:
    from mutwo.ir.printer import _memory, _value_type

    title = node.label if node.op == "placeholder" else node.op_name
    clone = f"\\nclone of %{node.origin}" if node.origin is not None else ""
    return f"%{node.id} {title}\\n{_value_type(node)} {_memory(node)}{clone}"


def to_dot(graph: Graph, highlight: Collection[int] = (), title: str = "") -> pydot.Dot:
    """A pydot graph of ``graph``; nodes whose ids are in ``highlight`` (and recompute clones)
    get a thick red border, and edges out of clones are drawn red."""
    dot = pydot.Dot(graph_name="mutwo", graph_type="digraph", rankdir="TB", label=title, labelloc="t")
    dot.set_node_defaults(shape="box", style="filled", fontname="Helvetica", fontsize="10")
    highlighted = set(highlight)
    for node in graph:
        attrs = {"label": _label(node), "fillcolor": KIND_COLOURS[node.kind]}
        if node.id in highlighted or node.origin is not None:
            attrs.update(color=HIGHLIGHT_COLOUR, penwidth="3")
        dot.add_node(pydot.Node(f"n{node.id}", **attrs))
    for node in graph:
        for operand in node.operands:
            attrs = {"color": HIGHLIGHT_COLOUR, "penwidth": "2"} if operand.origin is not None else {}
            dot.add_edge(pydot.Edge(f"n{operand.id}", f"n{node.id}", **attrs))
    legend = pydot.Cluster("legend", label="kinds", fontname="Helvetica")
    for kind, colour in KIND_COLOURS.items():
        legend.add_node(pydot.Node(f"legend_{kind.value}", label=kind.value, fillcolor=colour))
    legend.add_node(pydot.Node("legend_clone", label="recompute clone", fillcolor="white",
                               color=HIGHLIGHT_COLOUR, penwidth="3"))  # fmt: skip
    dot.add_subgraph(legend)
    return dot


def write_dot(graph: Graph, path: str, highlight: Collection[int] = (), title: str = "") -> None:
    """Write the dot source of :func:`to_dot` to ``path`` (rendering needs Graphviz, writing does not)."""
    write_atomic(Path(path), to_dot(graph, highlight, title).to_string())
