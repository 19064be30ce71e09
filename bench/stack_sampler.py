"""A sampling profiler of the main thread, for where a long setup spends its time.

cProfile's call tree broke on mutwo's restart (torch's compile stack left its callers unknown and
its cumulative times missing), so this samples instead: a daemon thread reads the main thread's
stack about every ``interval`` seconds (``sys._current_frames``) and adds to each stack the
microseconds since the last sample (the thread waits for the GIL, so samples come less often than
asked while the main thread runs Python). The result is written in the folded format of flame
graphs (``frame;frame;frame microseconds``, outermost first), which ``flamegraph.pl``, speedscope
and ``summarize`` below read.

    with StackSampler() as sampler:
        ...
    sampler.write("setup.folded")
    python3 bench/stack_sampler.py setup.folded      # the frames with the most time, inclusive
"""

from __future__ import annotations

import argparse
import collections
import sys
import threading
import time
from pathlib import Path
from types import FrameType, TracebackType


def _frame_name(frame: FrameType) -> str:
    code = frame.f_code
    path = code.co_filename
    # The last two path parts name the module well enough and keep lines short.
    short = "/".join(Path(path).parts[-2:])
    return f"{short}:{code.co_name}"


class StackSampler:
    """The main thread's stacks and the microseconds spent in each, sampled while entered."""

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self.counts: collections.Counter[tuple[str, ...]] = collections.Counter()
        self._stop = threading.Event()
        self._target = threading.main_thread().ident
        self._thread = threading.Thread(target=self._sample, name="stack-sampler", daemon=True)

    def _sample(self) -> None:
        last = time.perf_counter()
        while not self._stop.wait(self.interval):
            now = time.perf_counter()
            elapsed, last = now - last, now
            frame = sys._current_frames().get(self._target)  # noqa: SLF001 - the documented way to read another thread
            stack: list[str] = []
            while frame is not None:
                stack.append(_frame_name(frame))
                frame = frame.f_back
            self.counts[tuple(reversed(stack))] += round(elapsed * 1e6)

    def __enter__(self) -> StackSampler:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:  # fmt: skip
        self._stop.set()
        self._thread.join()

    def write(self, path: str | Path) -> None:
        """The samples in folded format, one stack per line."""
        lines = [f"{';'.join(stack)} {count}" for stack, count in self.counts.most_common()]
        Path(path).write_text("\n".join(lines) + "\n")


def summarize(path: str | Path, top: int = 40) -> str:
    """The frames with the most time (inclusive: a frame counts each sample it is on the stack of
    once), in seconds and as a share of all samples."""
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in Path(path).read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        total += int(count)
        for frame in set(stack.split(";")):
            inclusive[frame] += int(count)
    rows = [f"{'seconds':>8} {'share':>6}  frame", *(f"{n / 1e6:8.2f} {n / max(total, 1):6.1%}  {frame}"
                                                    for frame, n in inclusive.most_common(top))]  # fmt: skip
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description="The frames of a folded stack file with the most time.")
    parser.add_argument("folded")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    if not Path(args.folded).is_file():
        print(f"stack_sampler: no folded stack file at {args.folded}", file=sys.stderr)
        return 1
    print(summarize(args.folded, args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
