"""How much more than its simulated peak a graph's compiled step held, kept beside the plan cache's
entries, so that a start at another budget makes its first plan where that graph's steps land.

Calibration's first plan aims at the middle of its window under the target, assuming the step
will hold :data:`~mutwo.runtime.planning.peak_calibration.FIRST_PLAN_HELD_RATIO` times its
simulated peak, the median of thirteen capped rounds of three models. One graph's steps keep to
their own ratio, and it is not the median: on an H200 under a 16 GiB cap BERT-base b64's steps,
planned at 15 and 14 GiB, held 1.047-1.050 times their simulated peaks, so each first plan, aimed
for 1.025, held 0.4-0.5% over its budget and was planned and compiled again (50-58 s each,
``bench/results/session34_h200/``). Every calibration round measures the ratio; kept here under
what it depends on, the next start of the same graph at another budget aims with it.

The key is the plan key (:func:`~mutwo.runtime.planning.plan_key.plan_key`) without what sets the
budget: the captured graph, the pipeline, the device, the versions, and of the run's settings the
backend, ``keep_grads`` and the precision (a CUDA graph's pool, the gradients kept and the
autocast casts are what the process holds over the plan's values). Not the budget, the memory
limit, the device's memory or the calibration's settings. A file is ``held/<key hash>.json`` in the
plan cache's folder, written atomically, with the last :data:`KEPT_ROUNDS` rounds' ratios; one that
cannot be read is said in one line and replaced by the next calibration's.

Whether ``chunk`` sliced a plan's language-model head changes the ratio, and follows the budget:
BERT-base b64's sliced plan at 13 GiB held 0.92 times its simulated peak, its plans with the head
whole 1.046-1.050 times. Each ratio is kept with that fact, and the first plan aims with the
median of the head-whole rounds where there are any: the plan is made before ``chunk`` decides,
and aiming for the larger ratio leaves a sliced step under the budget (one re-plan up) rather
than a whole one over it (out of memory under a limit). A round measured twice (a re-plan that
made an earlier round's graph) counts once.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mutwo.ir.pass_base import write_atomic
from mutwo.runtime.planning.kept_files import read_kept
from mutwo.runtime.planning.plan_key import FORMAT, key_digest

#: The settings of a plan key that change what a step holds over its plan's simulated peak.
HELD_SETTINGS = ("backend", "keep_grads", "precision")
#: How many rounds' ratios a file keeps (the latest): a graph's ratio drifts with the plan, and the
#: median of recent rounds is what the next plan is most like.
KEPT_ROUNDS = 8
#: Ratios outside these bounds are not kept: a step that held under 0.8 or over 1.5 times its
#: simulated peak is one the simulator did not describe (a failed measurement), not a graph's excess.
PLAUSIBLE = (0.8, 1.5)


def held_key(plan_key: dict[str, Any]) -> dict[str, Any]:
    """The key of the ratios of the graph whose plan key is ``plan_key``."""
    settings = plan_key.get("settings", {})
    kept = {name: value for name, value in plan_key.items() if name not in ("settings", "device_memory")}
    return {**kept, "settings": {name: settings.get(name) for name in HELD_SETTINGS}}


def measured_ratios(calibration: dict[str, Any] | None) -> list[tuple[float, bool]]:
    """Held over simulated bytes of each round of ``calibration`` (its ``describe()``) that was
    measured (not out of memory), within :data:`PLAUSIBLE`, each with whether the round's plan
    sliced the head; a graph measured in two rounds once."""
    ratios: list[tuple[float, bool]] = []
    seen: set[tuple[int, int]] = set()
    for measured in (calibration or {}).get("rounds", []):
        planned, held = measured.get("planned_peak_bytes"), measured.get("measured_peak_bytes")
        if measured.get("out_of_memory") or not planned or (planned, held) in seen:
            continue
        seen.add((planned, held))
        ratio = held / planned
        if PLAUSIBLE[0] <= ratio <= PLAUSIBLE[1]:
            ratios.append((ratio, bool(measured.get("head_sliced", False))))
    return ratios


@dataclass
class HeldRatios:
    """The ratios under ``folder`` for the graph of ``plan_key``; ``log`` takes lines, unprefixed."""

    folder: Path
    plan_key: dict[str, Any]
    log: Callable[[str], None]

    @property
    def key(self) -> dict[str, Any]:
        return held_key(self.plan_key)

    @property
    def path(self) -> Path:
        return self.folder / "held" / f"{key_digest(self.key)}.json"

    def _kept(self) -> list[tuple[float, bool]]:
        ratios, ignored = read_kept(self.path, self.key,
                                    lambda data: [(float(r), bool(sliced)) for r, sliced in data["ratios"]],
                                    "a ratio file")  # fmt: skip
        if ignored is not None:
            self.log(f"plan cache: ignoring the kept held ratios {self.path.stem[:12]} ({ignored}); the next "
                     "calibration replaces them")  # fmt: skip
        return ratios or []

    def ratio(self) -> float | None:
        """The median ratio of the head-whole rounds kept for this graph, else of its sliced ones;
        None where none are kept."""
        kept = self._kept()
        whole = [ratio for ratio, sliced in kept if not sliced]
        ratios = whole or [ratio for ratio, _ in kept]
        return statistics.median(ratios) if ratios else None

    def keep(self, calibration: dict[str, Any] | None) -> None:
        """Add the ratios ``calibration`` measured to those kept (the last :data:`KEPT_ROUNDS`); a
        folder that cannot be written is said in one line."""
        new = measured_ratios(calibration)
        if not new:
            return
        ratios = (self._kept() + new)[-KEPT_ROUNDS:]
        try:
            write_atomic(self.path, json.dumps({"format": FORMAT, "key": self.key, "ratios": ratios}))
        except OSError as error:
            self.log(f"plan cache: could not keep the held ratios in {self.folder} ({error.strerror or error})")
