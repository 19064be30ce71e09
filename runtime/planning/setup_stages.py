"""Where the setup of a step goes: each stage of planning named as it starts and timed as it ends.

``mutwo.optimize`` took 142-329 s to return on an H100 for BERT-base, ResNet-152 and a 0.5B Llama
(issue 40), silently unless verbose. A user waiting should see which stage runs (capture, the
passes, compile, each calibration round, the measured choice, the check), and a benchmark should
be able to say where the time went: :class:`SetupStages` does both, through the ``log=`` callable
the rest of the runtime takes, and keeps the seconds of each stage for ``Optimized.setup_seconds``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from mutwo.ir.pass_manager import PipelineResult


@dataclass
class SetupStages:
    """The stages of one step's setup: each says when it starts and how long it took (``progress``),
    and its seconds are kept by name (``seconds``)."""

    progress: Callable[[str], None]
    seconds: dict[str, float] = field(default_factory=dict)
    began: float = field(default_factory=time.perf_counter)

    @contextmanager
    def stage(self, name: str, starting: str | None = None, *, record: bool = True) -> Iterator[None]:
        """Say ``starting``, run the body, say how long it took (neither without ``starting``: a stage
        that says what it did itself); its seconds count toward ``name`` unless ``record`` is off (a
        stage whose parts are counted on their own: the passes)."""
        if starting is not None:
            self.progress(f"mutwo: {starting}")
        began = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - began
            if record:
                self.seconds[name] = self.seconds.get(name, 0.0) + elapsed
            if starting is not None:
                self.progress(f"mutwo: {name} took {elapsed:.1f} s")

    def passes(self, result: PipelineResult) -> None:
        """Count each pass's seconds under its name (``profile``, ``select``...) and say them in one line."""
        said = []
        for record in result.records:
            name = record.name.split("{", 1)[0]
            self.seconds[name] = self.seconds.get(name, 0.0) + record.seconds
            said.append(f"{name} {record.seconds:.1f} s")
        if said:
            self.progress(f"mutwo: passes: {', '.join(said)}")

    def telling(self, log: Callable[[str], None], *prefixes: str) -> Callable[[str], None]:
        """A log whose lines that start with one of ``prefixes`` (``"peak calibration"``: each round
        as it starts and ends) are said as progress, and the others go to ``log`` (verbose only)."""
        return lambda line: (self.progress if line.startswith(prefixes) else log)(line)

    def total(self) -> dict[str, float]:
        """Seconds by stage, to the millisecond, and ``total``: from the first stage until now (it
        includes what no stage counts, such as building the context)."""
        return {**{name: round(s, 3) for name, s in self.seconds.items()},
                "total": round(time.perf_counter() - self.began, 3)}  # fmt: skip
