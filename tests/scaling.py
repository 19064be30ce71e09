"""A check that work grows linearly with its size, for the tests that guard against quadratic
algorithms: a wall-clock limit fails on a loaded CI machine, a ratio of two sizes does not."""

from __future__ import annotations

import gc
from collections.abc import Callable

#: The two sizes compared differ by this factor: linear work takes about this many times longer
#: at the larger size, quadratic work its square.
SIZE_RATIO = 4
#: The largest time ratio accepted: halfway (on a log scale) between linear and quadratic, so
#: noise of a loaded machine (measured up to 1.7x over the linear ratio) does not fail it.
LIMIT = SIZE_RATIO ** 1.5


def best_seconds(timed: Callable[[int], float], size: int, repeats: int = 3) -> float:
    """The fastest of ``repeats`` calls of ``timed(size)``, which returns the seconds it measured
    (so that it can leave setup out of the time), with Python's cyclic garbage collector off (its
    passes over a large heap grow with everything alive, whatever the code under test does)."""
    gc.collect()
    gc.disable()
    try:
        return min(timed(size) for _ in range(repeats))
    finally:
        gc.enable()


def assert_linear(timed: Callable[[int], float], size: int, what: str) -> None:
    """``timed(size)`` takes at most :data:`LIMIT` times ``timed(size // SIZE_RATIO)`` (plus 20 ms
    for the timer's noise on small work)."""
    small, full = best_seconds(timed, size // SIZE_RATIO), best_seconds(timed, size)
    assert full < LIMIT * small + 0.02, (f"{what}: {size // SIZE_RATIO} took {small:.3f} s, {size} took {full:.3f} s, "
                                         f"more than {LIMIT:.0f}x: not linear")  # fmt: skip
