"""A check that work grows linearly with its size, for the tests that guard against quadratic
algorithms: a wall-clock limit fails on a loaded CI machine, a ratio of two sizes does not."""

from __future__ import annotations

from collections.abc import Callable

#: Doubling the size of linear work takes about twice as long; quadratic work takes four times.
LINEAR_RATIO = 3.0


def best_seconds(timed: Callable[[int], float], size: int, repeats: int = 3) -> float:
    """The fastest of ``repeats`` calls of ``timed(size)``, which returns the seconds it measured
    (so that it can leave setup out of the time)."""
    return min(timed(size) for _ in range(repeats))


def assert_linear(timed: Callable[[int], float], size: int, what: str) -> None:
    """``timed(size)`` takes at most :data:`LINEAR_RATIO` times ``timed(size // 2)`` (plus 50 ms
    for the timer's noise on small work)."""
    half, full = best_seconds(timed, size // 2), best_seconds(timed, size)
    assert full < LINEAR_RATIO * half + 0.05, (f"{what}: {size // 2} took {half:.3f} s, {size} took {full:.3f} s, "
                                               f"more than {LINEAR_RATIO}x: not linear")  # fmt: skip
