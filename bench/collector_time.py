"""The time Python's cyclic garbage collector takes while a block runs, by generation.

``gc.callbacks`` are told when each collection starts and stops; :class:`CollectorTime` adds up
the seconds between, so a setup's record can say how much of it was the collector (the sampling
profiler cannot: it charges a collection to whatever frame allocated when it began).

    with CollectorTime() as collector:
        ...
    collector.summary()  # {"seconds": ..., "collections": [gen0, gen1, gen2], "full_seconds": ...}
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
        self._began = 0.0

    def _note(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        generation = min(int(info["generation"]), 2)
        self.seconds[generation] += time.perf_counter() - self._began
        self.collections[generation] += 1

    def __enter__(self) -> CollectorTime:
        gc.callbacks.append(self._note)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:  # fmt: skip
        gc.callbacks.remove(self._note)

    def summary(self) -> dict[str, Any]:
        """Seconds in all collections and in full ones, and the number of each generation's."""
        return {"seconds": round(sum(self.seconds), 3), "full_seconds": round(self.seconds[2], 3),
                "collections": list(self.collections)}  # fmt: skip
