"""How many bytes a calibrated step held per byte of budget between two rounds of one calibration,
over every calibration with two or more rounds in ``bench/results/`` (what
:func:`mutwo.runtime.planning.peak_calibration.next_budget` steps by from its third round on):

    python3 bench/calibration_slopes.py
"""

from __future__ import annotations

import itertools
import json
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def calibrations(value: Any) -> Iterator[dict[str, Any]]:
    """Every ``calibration`` record (a dict with measured ``rounds``) anywhere in a results file."""
    if isinstance(value, dict):
        rounds = value.get("rounds")
        if isinstance(rounds, list) and rounds and isinstance(rounds[0], dict) and "measured_peak_bytes" in rounds[0]:
            yield value
        for item in value.values():
            yield from calibrations(item)
    elif isinstance(value, list):
        for item in value:
            yield from calibrations(item)


def main() -> None:
    seen: set[tuple[tuple[int, int], ...]] = set()
    slopes: list[float] = []
    for path in sorted(RESULTS.rglob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError):
            continue
        for calibration in calibrations(data):
            ran = [r for r in calibration["rounds"] if not r.get("out_of_memory")]
            points = tuple((r["budget_bytes"], r["measured_peak_bytes"]) for r in ran)
            if len(points) < 2 or points in seen:  # a run's summary and its row may hold the same one
                continue
            seen.add(points)
            pairs = [(b2 - b1, m2 - m1) for (b1, m1), (b2, m2) in itertools.pairwise(points) if b2 != b1]
            found = [round(held / budgeted, 3) for budgeted, held in pairs]
            slopes.extend(found)
            print(f"{path.relative_to(RESULTS)}: target {calibration['target_bytes'] / 2**20:,.0f} MiB, "
                  f"slopes {found}")
    moving = [s for s in slopes if s > 0.05]  # a flat pair: the two plans alike
    print(f"{len(seen)} calibrations, {len(slopes)} slopes, {len(slopes) - len(moving)} flat; the others "
          f"{min(moving)} to {max(moving)}, median {statistics.median(moving)}")


if __name__ == "__main__":
    main()
