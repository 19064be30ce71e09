"""Reports written into the output folder from the simulator and the profile: plots and tables."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mutwo.ir.graph import Graph
from mutwo.ir.liveness import Liveness, elapsed_seconds, idle_seconds
from mutwo.ir.memory import MemorySimulation
from mutwo.ir.node import Phase
from mutwo.ir.pass_base import write_atomic
from mutwo.ir.timeline import GraphTimeline

MIB = 2**20
PHASE_COLOURS = {Phase.FORWARD: "#e8f1fa", Phase.BACKWARD: "#fdf0e6", Phase.OPTIMIZER: "#eef7ea"}


def _save(figure: Any, path: Path) -> Path:
    """Save through a temporary file and a rename, so a plot is never half-written."""
    temporary = path.with_name(f".{path.stem}.tmp{path.suffix}")
    figure.savefig(temporary, dpi=110)
    temporary.replace(path)
    return path


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def memory_timeline(path: Path, graph: Graph, simulation: MemorySimulation, profile: Any = None,
                    title: str = "") -> Path:  # fmt: skip
    """The simulated memory after every node and, where a CUDA profile has it, the measured
    allocated memory, with the forward, backward and optimizer regions shaded and the peak marked."""
    plt = _pyplot()
    nodes = graph.nodes
    figure, axes = plt.subplots(figsize=(12, 4.5))
    start = 0
    labelled = set()  # one legend entry per phase: optimizer-in-backward interleaves many spans
    for index in range(1, len(nodes) + 1):
        if index == len(nodes) or nodes[index].phase is not nodes[start].phase:
            phase = nodes[start].phase
            axes.axvspan(start, index - 1, color=PHASE_COLOURS[phase],
                         label=None if phase in labelled else phase.value)  # fmt: skip
            labelled.add(phase)
            start = index
    axes.plot(range(len(simulation.curve)), [b / MIB for b in simulation.curve], color="#1f77b4", lw=1.2,
              label="simulated")  # fmt: skip
    if profile is not None and any(p.allocated_after is not None for p in profile.nodes.values()):
        baseline = _measured_baseline(graph, simulation, profile)
        points = [(i, (profile.nodes[n.id].peak - baseline) / MIB) for i, n in enumerate(nodes)
                  if n.id in profile.nodes and profile.nodes[n.id].peak is not None]  # fmt: skip
        axes.plot([p[0] for p in points], [p[1] for p in points], color="#d62728", lw=0.8, alpha=0.8,
                  label="measured (peak inside each op)")  # fmt: skip
    axes.annotate(f"peak {simulation.peak_bytes / MIB:.3g} MiB\n%{simulation.peak_node} ({simulation.peak_phase})",
                  xy=(simulation.peak_rank, simulation.peak_bytes / MIB), xytext=(10, -30),
                  textcoords="offset points", arrowprops={"arrowstyle": "->"})  # fmt: skip
    axes.set_xlabel("node (execution order)")
    axes.set_ylabel("MiB")
    axes.set_title(title or "memory over one training iteration")
    axes.legend(loc="upper left", fontsize=8)
    figure.tight_layout()
    _save(figure, path)
    plt.close(figure)
    return path


def _measured_baseline(graph: Graph, simulation: MemorySimulation, profile: Any) -> int:
    """Allocated bytes that are not this iteration's (the real model beside the profiling clones):
    measured minus simulated at the first profiled node, where only persistent state is live."""
    for rank, node in enumerate(graph.nodes):
        measured = profile.nodes.get(node.id)
        if measured is not None and measured.allocated_before is not None:
            before = simulation.curve[rank - 1] if rank else simulation.persistent_bytes
            return measured.allocated_before - before
    return 0


def peak_breakdown(path: Path, simulation: MemorySimulation, title: str = "") -> Path:
    """A bar per kind of what is live at the peak."""
    plt = _pyplot()
    items = [(k, v / MIB) for k, v in simulation.breakdown.items() if v]
    figure, axes = plt.subplots(figsize=(7, 3.5))
    axes.barh([k for k, _ in items], [v for _, v in items], color="#4c72b0")
    for y, (_, value) in enumerate(items):
        axes.text(value, y, f" {value:.1f}", va="center", fontsize=8)
    axes.set_xlabel("MiB live at the peak")
    axes.set_title(title or f"at the peak: {simulation.peak_bytes / MIB:.1f} MiB ({simulation.peak_phase})")
    figure.tight_layout()
    _save(figure, path)
    plt.close(figure)
    return path


def swap_timeline(path: Path, graph: Graph, timeline: GraphTimeline, simulation: MemorySimulation,
                  title: str = "") -> Path:  # fmt: skip
    """The simulated iteration of a graph that swaps, over time: the compute stream (phases shaded,
    stalls on copies in red), the copy-out and copy-in streams (one bar per copy) and, below,
    the device memory while each node runs."""
    plt = _pyplot()
    nodes = graph.nodes
    figure, (lanes, memory) = plt.subplots(2, 1, figsize=(12, 6), sharex=True, height_ratios=(1, 1.4))
    start_ms = [t * 1e3 for t in timeline.start]
    end_ms = [t * 1e3 for t in timeline.end]
    for phase, colour in PHASE_COLOURS.items():
        spans = [(start_ms[i], end_ms[i] - start_ms[i]) for i, n in enumerate(nodes) if n.phase is phase]
        if spans:
            lanes.broken_barh(spans, (2, 0.8), facecolors=colour, edgecolors="#999999", linewidth=0.2,
                              label=f"compute: {phase.value}")  # fmt: skip
    stalls = [(start * 1e3, seconds * 1e3) for start, seconds in timeline.stalled]
    if stalls:
        lanes.broken_barh(stalls, (2, 0.8), facecolors="#d62728", label="compute stalled on a copy")
    for lane, key, colour in ((1, "copy_out", "#1f77b4"), (0, "copy_in", "#2ca02c")):
        bars = [(s[key][0] * 1e3, (s[key][1] - s[key][0]) * 1e3) for s in timeline.swaps]
        lanes.broken_barh(bars, (lane, 0.8), facecolors=colour, edgecolors="white", linewidth=0.3)
    lanes.set_yticks([0.4, 1.4, 2.4], ["copy in (host→device)", "copy out (device→host)", "compute"])
    lanes.set_title(title or "one training iteration, simulated")
    lanes.legend(loc="upper right", fontsize=7)
    memory.step(start_ms, [b / MIB for b in simulation.curve], where="post", color="#1f77b4", lw=1.0)
    peak_at = start_ms[simulation.peak_rank]
    memory.annotate(f"peak {simulation.peak_bytes / MIB:.1f} MiB", xy=(peak_at, simulation.peak_bytes / MIB),
                    xytext=(10, -20), textcoords="offset points", arrowprops={"arrowstyle": "->"})  # fmt: skip
    memory.set_ylabel("device MiB")
    memory.set_xlabel(f"ms ({timeline.seconds * 1e3:.1f} ms in all, {timeline.stall * 1e3:.2f} ms stalled on copies)")
    figure.tight_layout()
    _save(figure, path)
    plt.close(figure)
    return path


def activation_report(graph: Graph, liveness: Liveness, profile: Any = None, top: int = 15) -> str:
    """Markdown tables of the largest activations by size and by inactive time."""
    activations = liveness.activations()
    elapsed = elapsed_seconds(graph, profile.seconds if profile is not None else lambda node_id: 0.0)

    def inactive(record: Any) -> tuple[int, float]:
        start, end = record.inactive_interval or (record.created, record.created)
        return end - start, idle_seconds(record, elapsed)

    def table(rows: list[Any]) -> list[str]:
        lines = ["| storage | producer | MiB | inactive nodes | inactive ms |", "|---|---|---|---|---|"]
        for record in rows:
            nodes, time_ = inactive(record)
            producer = graph.node(record.key.creator)
            lines.append(f"| {record.key} | {producer.op_name} | {record.bytes / MIB:.2f} | {nodes} | "
                         f"{time_ * 1e3:.2f} |")  # fmt: skip
        return lines

    by_size = sorted(activations, key=lambda r: -r.bytes)[:top]
    by_time = sorted(activations, key=lambda r: -inactive(r)[1 if profile is not None else 0])[:top]
    total = sum(r.bytes for r in activations)
    lines = [f"# Activations: {len(activations)}, {total / MIB:.1f} MiB in all", "",
             f"## Largest {len(by_size)} by size", "", *table(by_size), "",
             f"## Largest {len(by_time)} by inactive {'time' if profile is not None else 'span (nodes)'}", "",
             *table(by_time), ""]  # fmt: skip
    return "\n".join(lines)


def write_reports(out: Path, graph: Graph, simulation: MemorySimulation, liveness: Liveness, profile: Any,
                  title: str) -> list[str]:  # fmt: skip
    """Write every report for ``graph``; returns the file names."""
    memory_timeline(out / "memory_timeline.png", graph, simulation, profile, title)
    peak_breakdown(out / "peak_breakdown.png", simulation, f"{title}: live at the peak")
    write_atomic(out / "activations.md", activation_report(graph, liveness, profile))
    return ["memory_timeline.png", "peak_breakdown.png", "activations.md"]
