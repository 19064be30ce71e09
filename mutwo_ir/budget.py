"""Memory budgets: a fraction of the unoptimized peak (``0.5``) or an amount of bytes (``"6GiB"``);
memory sizes read from text and written for messages."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from mutwo.ir.pass_base import PassFailure

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip
_UNKNOWN_UNIT = "{!r} has unknown unit {!r}; use B, KiB, MiB, GiB, KB, MB or GB"
_PATTERN = re.compile(r"^\s*(-?[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
#: The pass-context service holding the budget asked for, in bytes, when the run's ``budget``
#: service is a lower one to aim at (peak calibration's first plan,
#: :func:`mutwo.runtime.planning.peak_calibration.plan_first_at_window`): the selection passes aim
#: at the budget and keep a plan that peaks over it but within this one.
ASKED_BUDGET = "budget_asked_bytes"
#: The pass-context service, when the run's budget is a fraction and peak calibration will hold the
#: step to it: a function from the budget the fraction resolves to, in bytes, to the lower budget
#: the first plan aims at and why, or None where the plan is made as asked. The
#: selection passes call it once they resolve the fraction and keep the resolved bytes as
#: :data:`ASKED_BUDGET`.
FIRST_PLAN_AIM = "first_plan_aim"


class BudgetError(ValueError):
    """A budget that is neither a fraction in (0, 1] nor a positive amount of bytes."""


@dataclass(frozen=True)
class Budget:
    """Exactly one of ``fraction`` (of the unoptimized simulated peak), ``bytes``, or
    ``minimum`` (the lowest peak recomputation can reach)."""

    fraction: float | None = None
    bytes: int | None = None
    minimum: bool = False

    def resolve(self, unoptimized_peak: int) -> int:
        """The budget in bytes, given the unoptimized peak (0 for ``minimum``)."""
        if self.minimum:
            return 0
        if self.bytes is not None:
            return self.bytes
        assert self.fraction is not None
        return int(self.fraction * unoptimized_peak)

    def __str__(self) -> str:
        if self.minimum:
            return "min"
        return f"{self.fraction:g}" if self.fraction is not None else f"{self.bytes}B"


def parse_budget(value: float | int | str) -> Budget:
    """Parse ``0.5`` (a fraction), ``"6GiB"``/``"512MB"``/``"1e9"`` (bytes) or ``"min"``."""
    if isinstance(value, str) and value.strip().lower() == "min":
        return Budget(minimum=True)
    if isinstance(value, bool):
        raise BudgetError(f"budget must be a fraction like 0.5 or bytes like '6GiB', got {value!r}")
    if isinstance(value, (int, float)):
        return _fraction_or_bytes(float(value), "", str(value))
    match = _PATTERN.match(str(value))
    if not match:
        raise BudgetError(f"budget {value!r} is neither a fraction like 0.5, bytes like '6GiB', nor 'min'")
    number, unit = float(match.group(1)), match.group(2).lower()
    if unit not in _UNITS:
        raise BudgetError("budget " + _UNKNOWN_UNIT.format(value, match.group(2)))
    return _fraction_or_bytes(number, unit, str(value))


def _fraction_or_bytes(number: float, unit: str, text: str) -> Budget:
    if not math.isfinite(number):
        raise BudgetError(f"budget must be a finite number, got {text}")
    if str(text).strip().startswith("-") or number <= 0:
        raise BudgetError(f"budget must be positive, got {text}")
    if not unit and number <= 1:
        return Budget(fraction=number)
    if not unit and number < 1024:
        raise BudgetError(f"budget {text} is ambiguous: a fraction must be in (0, 1], bytes need a unit like '6GiB'")
    return Budget(bytes=int(number * _UNITS[unit]))


def parse_bytes(text: str) -> int:
    """A memory size given with a unit (``16GiB``, ``64MiB``) in bytes; BudgetError otherwise,
    whose message speaks of a memory size (not of a budget: a fraction or ``min`` is no size)."""
    match = _PATTERN.match(str(text))
    if match is not None and match.group(2).lower() not in _UNITS:
        raise BudgetError(_UNKNOWN_UNIT.format(text, match.group(2)))
    try:
        value = parse_budget(text)
    except BudgetError:
        value = Budget()  # negative, infinite, ambiguous: all answered below
    if value.bytes is None:
        raise BudgetError(f"{text!r} is not a memory size: give bytes with a unit, like 16GiB")
    return value.bytes


#: The units sizes are written in, largest first. Sizes stay in MiB past a GiB, as the tools have
#: always printed them (``16,384.0 MiB``), with thousands separated.
SIZE_UNITS = (("MiB", 2**20), ("KiB", 2**10), ("B", 1))


def _unit_of(size: int) -> int:
    """The index in :data:`SIZE_UNITS` of the largest unit ``size`` fills (bytes for less than a KiB)."""
    return next(index for index, (_, scale) in enumerate(SIZE_UNITS) if abs(size) >= scale or scale == 1)


def readable_bytes(size: int, unit: str | None = None) -> str:
    """``1.8 MiB``, ``12.0 KiB``, ``512 B``, ``16,384.0 MiB``: a size in the largest unit it fills,
    so that a small share of a breakdown does not read as ``0.0 MiB``, or in ``unit``."""
    name, scale = SIZE_UNITS[_unit_of(size)] if unit is None else (unit, dict(SIZE_UNITS)[unit])
    return f"{size:,} B" if scale == 1 else f"{size / scale:,.1f} {name}"


def sizes(*values: int) -> list[str]:
    """Byte counts written for one message in one unit (:func:`size_unit`), so that they compare
    at a glance."""
    unit = size_unit(*values)
    return [readable_bytes(value, unit) for value in values]


def size_unit(*values: int) -> str:
    """The one unit a message writes ``values`` in: the unit the largest fills, or a smaller one
    where two different counts would read the same in it (a budget just under the lowest peak must
    not read as that peak)."""
    for unit, _ in SIZE_UNITS[_unit_of(max(values, default=0)):]:
        if len({readable_bytes(value, unit) for value in values}) == len(set(values)):
            return unit
    return SIZE_UNITS[-1][0]


def counted(count: int, noun: str, plural: str | None = None) -> str:
    """``1 clone``, ``12 clones``: a count with its noun, for messages."""
    return f"{count} {noun if count == 1 else plural or noun + 's'}"


def budget_text(budget: str, size: str) -> str:
    """How a message names a budget: ``min`` for the lowest peak reachable, which has no size to
    print, else its size with what was asked (``4.0 MiB (0.5)``)."""
    if budget == "min":
        return "min"
    return size if budget == size else f"{size} ({budget})"


class UnreachableBudget(PassFailure):
    """No plan a pass found meets the budget; its advice is the budget that would hold ``peak``,
    the lowest peak found (bytes out of an ``unoptimized`` peak, written ``peak_text``). ``needs``
    is ``peak`` where no plan of the pass gets under it, and None where the pass stopped short
    of the lowest (``bound=False``: select's ``lowest=false``, past its estimate)."""

    def __init__(self, reason: str, peak: int, unoptimized: int, peak_text: str, *, bound: bool = True) -> None:
        super().__init__(reason, advice=reachable_budget(peak, unoptimized, peak_text))
        self.needs = peak if bound else None


def reachable_budget(lowest: int, unoptimized: int, lowest_text: str) -> str:
    """The fix for a budget under ``lowest`` (bytes, out of an ``unoptimized`` peak), worded for
    the command line and Python alike: ``ask for budget 'min' or a budget of at least 0.65 (6.4 MiB)``."""
    hundredths = math.ceil(round(100 * lowest / unoptimized, 9))
    while hundredths < 100 and int(hundredths / 100 * unoptimized) < lowest:  # as Budget.resolve rounds
        hundredths += 1
    return f"ask for budget 'min' or a budget of at least {hundredths / 100:g} ({lowest_text})"
