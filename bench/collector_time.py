"""The time Python's cyclic garbage collector takes while a block runs, by generation.

``gc.callbacks`` are told when each collection starts and stops; :class:`CollectorTime` adds up
the seconds between, so a setup's record can say how much of it was the collector (the sampling
profiler cannot: it charges a collection to whatever frame allocated when it began).

    with CollectorTime() as collector:
        ...
    collector.summary()  # {"seconds": ..., "collections": [gen0, gen1, gen2], "full_seconds": ...,
                         #  "full_at": [[seconds since entering, seconds it took], ...]}

``full_at`` places each full collection in time, so that a setup's stages (its ``setup_seconds``,
which run one after another in the order they are listed) can be told apart.
"""

from __future__ import annotations

import gc
import time
from types import TracebackType
from typing import Any


class CollectorTime:
    """Collections and their seconds, by generation, while entered."""

    def __init__(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]
        self.collections = [0, 0, 0]
        self.full_at: list[tuple[float, float]] = []
        self._entered = self._began = 0.0

    def _note(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        generation = min(int(info["generation"]), 2)
        took = time.perf_counter() - self._began
        self.seconds[generation] += took
        self.collections[generation] += 1
        if generation == 2:
            self.full_at.append((self._began - self._entered, took))

    def __enter__(self) -> CollectorTime:
        self._entered = time.perf_counter()
        gc.callbacks.append(self._note)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:  # fmt: skip
        gc.callbacks.remove(self._note)

    def summary(self) -> dict[str, Any]:
        """Seconds in all collections and in full ones, the number of each generation's, and when
        each full one began and how long it took."""
        return {"seconds": round(sum(self.seconds), 3), "full_seconds": round(self.seconds[2], 3),
                "collections": list(self.collections),
                "full_at": [[round(at, 2), round(took, 3)] for at, took in self.full_at]}  # fmt: skip
