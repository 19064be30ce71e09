"""The plots of ``mutwo-experiment``, drawn from its ``results.json``.

- ``peak_vs_batch.png``: peak memory per batch size, one bar per variant, each recompute bar
  labelled with its reduction against mutwo's step without recompute;
- ``latency_vs_batch.png``: iteration time per batch size, one line per variant, each point
  labelled with its overhead against eager PyTorch (or, without eager, against no recompute);
- ``simulated_vs_measured.png``: mutwo's simulated peak against the measured one.

Out-of-memory configurations are marked "OOM" on the bar charts. X tick labels that would overlap
(many batch sizes, long numbers) are tilted, stood upright or, when even that is too tight, thinned.
"""

from __future__ import annotations

import math
from itertools import pairwise
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers and CI
import matplotlib.pyplot as plt  # noqa: E402

MIB = 2**20
#: Room kept between two neighbouring x tick labels, in shares of a label's height.
TICK_GAP = 0.3


def _label(variant: str) -> str:
    return {"eager": "eager PyTorch", "none": "mutwo, no recompute"}.get(variant, f"mutwo, budget {variant}")


def _ok(row: dict[str, Any] | None) -> bool:
    return row is not None and "error" not in row


def _table(results: dict[str, Any]) -> tuple[list[int], list[str], dict[tuple[int, str], dict[str, Any]]]:
    runs = results["runs"]
    batches = sorted({r["batch_size"] for r in runs})
    variants = list(dict.fromkeys(r["variant"] for r in runs))
    return batches, variants, {(r["batch_size"], r["variant"]): r for r in runs}


def _save(figure: Any, axes: Any, path: Path, xlabel: str, ylabel: str, title: str) -> bool:
    """Label, write and close a plot; True (it was written)."""
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    axes.legend(fontsize=8)
    figure.tight_layout()
    if _readable_xticks(figure, axes):
        figure.tight_layout()  # again, with room for the turned labels
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def _readable_xticks(figure: Any, axes: Any) -> bool:
    """Keep the x tick labels from overlapping: tilt them 45°, else stand them upright, else label
    every k-th tick (the drawn data stay as they are). True if the labels changed.

    Labels that turn stay parallel, so two neighbours are apart by the ticks' spacing times the sine
    of their angle; that must exceed a label's height."""
    figure.canvas.draw()  # a label has its text and size only once drawn
    renderer = figure.canvas.get_renderer()
    low, high = sorted(axes.get_xlim())
    shown = sorted(((label.get_position()[0], label) for label in axes.get_xticklabels()
                    if label.get_text() and low <= label.get_position()[0] <= high),
                   key=lambda item: item[0])  # fmt: skip
    boxes = [label.get_window_extent(renderer) for _, label in shown]
    if all(a.x1 + TICK_GAP * a.height <= b.x0 for a, b in pairwise(boxes)):
        return False
    pixels = [axes.transData.transform((x, 0))[0] for x, _ in shown]
    spacing = min(b - a for a, b in pairwise(pixels))
    needed = (1 + TICK_GAP) * max(box.height for box in boxes)
    locations, texts = [x for x, _ in shown], [label.get_text() for _, label in shown]
    if spacing * math.sin(math.radians(45)) >= needed:
        axes.set_xticks(locations, texts, rotation=45, ha="right", rotation_mode="anchor")  # ends at their ticks
        return True
    every = math.ceil(needed / spacing)  # 1 while upright labels fit
    axes.set_xticks(locations[::every], texts[::every], rotation=90, ha="center")
    return True


def plot_peaks(results: dict[str, Any], path: Path) -> bool:
    """Grouped bars of peak memory; False (nothing written) when no run measured a peak (CPU)."""
    batches, variants, rows = _table(results)
    if not any(_ok(r) and r.get("peak_bytes") is not None for r in rows.values()):
        return False
    figure, axes = plt.subplots(figsize=(max(6.0, 1.6 * len(batches) * len(variants) / 3), 4.5))
    width = 0.8 / len(variants)
    for v_index, variant in enumerate(variants):
        labelled = False
        for b_index, batch in enumerate(batches):
            x = b_index + (v_index - (len(variants) - 1) / 2) * width
            row = rows.get((batch, variant))
            if not _ok(row) or row.get("peak_bytes") is None:
                if row is not None and "memory" in str(row.get("error", "")):
                    axes.text(x, 0, "OOM", ha="center", va="bottom", fontsize=7, rotation=90, color="firebrick")
                continue
            peak = row["peak_bytes"] / MIB
            axes.bar(x, peak, width, color=f"C{v_index}", label=None if labelled else _label(variant))
            labelled = True
            base = rows.get((batch, "none"))
            if variant not in ("eager", "none") and _ok(base) and base.get("peak_bytes"):
                change = row["peak_bytes"] / base["peak_bytes"] - 1
                axes.text(x, peak, f"{change:+.0%}", ha="center", va="bottom", fontsize=7)
    axes.set_xticks(range(len(batches)), [str(b) for b in batches])
    limit = results.get("memory_limit_bytes")
    if limit:
        axes.axhline(limit / MIB, color="firebrick", linestyle="--", linewidth=1, label="memory limit")
    return _save(figure, axes, path, "batch size", "peak memory (MiB)",
                 f"{results['model']}: peak memory ({results['device']})")  # fmt: skip


def plot_latency(results: dict[str, Any], path: Path) -> bool:
    """Lines of median iteration time, overhead labelled against eager (or no recompute)."""
    batches, variants, rows = _table(results)
    reference = "eager" if "eager" in variants else "none"
    figure, axes = plt.subplots(figsize=(7, 4.5))
    drawn = False
    for v_index, variant in enumerate(variants):
        points = [(b, rows[(b, variant)]["iteration_ms"]) for b in batches if _ok(rows.get((b, variant)))]
        if not points:
            continue
        drawn = True
        axes.plot([b for b, _ in points], [t for _, t in points], marker="o", color=f"C{v_index}",
                  label=_label(variant))  # fmt: skip
        if variant == reference:
            continue
        for batch, ms in points:
            base = rows.get((batch, reference))
            if _ok(base):
                axes.annotate(f"{ms / base['iteration_ms']:.2f}×", (batch, ms), textcoords="offset points",
                              xytext=(4, 4), fontsize=7, color=f"C{v_index}")  # fmt: skip
    if not drawn:
        plt.close(figure)
        return False
    return _save(figure, axes, path, "batch size", "iteration time (ms, median)",
                 f"{results['model']}: iteration time, overhead vs {_label(reference)}")  # fmt: skip


def plot_simulated_vs_measured(results: dict[str, Any], path: Path) -> bool:
    """Scatter of mutwo's simulated peak against the measured one, with the y = x line."""
    points = [(r["simulated_peak_bytes"] / MIB, r["peak_bytes"] / MIB, r)
              for r in results["runs"] if _ok(r) and r.get("simulated_peak_bytes") and r.get("peak_bytes")]  # fmt: skip
    if not points:
        return False
    figure, axes = plt.subplots(figsize=(5.5, 5))
    top = max(max(s, m) for s, m, _ in points) * 1.05
    axes.plot([0, top], [0, top], color="grey", linewidth=1, label="simulated = measured")
    for simulated, measured, row in points:
        axes.scatter(simulated, measured, color="C1" if row["variant"] == "none" else "C2", s=18)
        axes.annotate(f"b{row['batch_size']} {row['variant']} ({simulated / measured - 1:+.1%})", (simulated, measured),
                      textcoords="offset points", xytext=(4, -8), fontsize=7)  # fmt: skip
    axes.set_xlim(0, top)
    axes.set_ylim(0, top)
    return _save(figure, axes, path, "simulated peak (MiB)", "measured peak (MiB)",
                 f"{results['model']}: simulated vs measured peak")  # fmt: skip


def plot_all(results: dict[str, Any], out: Path) -> list[str]:
    """Draw every plot the results support into ``out``; return the file names written."""
    written = []
    for name, plot in (("peak_vs_batch.png", plot_peaks), ("latency_vs_batch.png", plot_latency),
                       ("simulated_vs_measured.png", plot_simulated_vs_measured)):  # fmt: skip
        if plot(results, out / name):
            written.append(name)
    return written
