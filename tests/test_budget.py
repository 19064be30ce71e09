"""Budgets and memory sizes as text: parsing them, and writing the numbers of a failure."""

from __future__ import annotations

import pytest

from mutwo.ir.budget import (
    Budget,
    BudgetError,
    UnreachableBudget,
    budget_text,
    counted,
    parse_bytes,
    reachable_budget,
    readable_bytes,
    sizes,
)

MIB, KIB = 2**20, 2**10


def test_sizes_are_mib_while_they_read_apart() -> None:
    assert sizes(6 * MIB, int(6.4 * MIB), 10 * MIB) == ["6.0 MiB", "6.4 MiB", "10.0 MiB"]
    assert sizes(3 * MIB, 3 * MIB) == ["3.0 MiB", "3.0 MiB"]  # equal counts may read the same


def test_sizes_all_under_a_mib_are_kib() -> None:
    assert sizes(int(0.9 * MIB), int(0.7 * MIB)) == ["921.6 KiB", "716.8 KiB"]
    assert sizes(int(0.9 * MIB), 2 * MIB) == ["0.9 MiB", "2.0 MiB"]


def test_a_count_agrees_with_its_noun() -> None:
    assert (counted(1, "clone"), counted(12, "clone"), counted(0, "forward node")) == ("1 clone", "12 clones",
                                                                                    "0 forward nodes")
    assert counted(2, "batch", "batches") == "2 batches"


def test_a_budget_is_named_by_its_size_and_what_was_asked() -> None:
    assert budget_text("min", "0.0 KiB") == "min"  # no size: the lowest peak reachable
    assert budget_text("0.5", "4.0 MiB") == "4.0 MiB (0.5)"
    assert budget_text("4.0 MiB", "4.0 MiB") == "4.0 MiB"


def test_sizes_that_would_read_the_same_get_more_precision() -> None:
    # budget 0.6 of a 0.44 MiB peak against a lowest peak of 0.34 MiB: both "0.3 MiB"
    assert sizes(int(0.6 * 0.44 * MIB), int(0.34 * MIB)) == ["270.3 KiB", "348.2 KiB"]
    assert sizes(400 * KIB, 400 * KIB + 10) == ["409,600 B", "409,610 B"]


def test_sizes_all_under_a_kib_are_bytes() -> None:
    assert sizes(512, 900) == ["512 B", "900 B"]  # as readable_bytes writes each (once '0.5 KiB', '0.9 KiB')


def test_one_size_reads_in_the_largest_unit_it_fills() -> None:
    """One formatter for every message: a GPU's limit with thousands separated, as --fit wrote it,
    and a size under a MiB in KiB or bytes (--fit once wrote '0.25 MiB' and '0.000878 MiB')."""
    assert readable_bytes(16 * 2**30) == "16,384.0 MiB" and readable_bytes(int(14.4 * 2**30)) == "14,745.6 MiB"
    assert (readable_bytes(3 * MIB // 2), readable_bytes(256 * KIB), readable_bytes(921)) == ("1.5 MiB", "256.0 KiB",
                                                                                              "921 B")  # fmt: skip
    assert readable_bytes(3 * MIB, "KiB") == "3,072.0 KiB" and readable_bytes(0) == "0 B"


@pytest.mark.parametrize(("lowest", "unoptimized", "fraction"), [
    (int(6.4 * MIB), 10 * MIB, "0.64"),  # 0.64 of the peak is a byte short of 6.4 MiB: still enough
    (650, 1000, "0.65"),
    (651, 1000, "0.66"),
    (1000, 1000, "1"),
])  # fmt: skip
def test_the_reachable_budget_is_the_smallest_hundredth_that_holds_the_lowest_peak(
        lowest: int, unoptimized: int, fraction: str) -> None:  # fmt: skip
    fix = reachable_budget(lowest, unoptimized, "X")
    assert fix == f"ask for budget 'min' or a budget of at least {fraction} (X)"
    assert Budget(fraction=float(fraction)).resolve(unoptimized) >= lowest


def test_an_unreachable_budget_gives_the_reachable_one_as_advice() -> None:
    """The message is unchanged (reason; advice), and the advice is its own field: --fit, which
    sets the budget itself, reads the reason without it."""
    failure = UnreachableBudget("budget 0.5 (500 B) is unreachable", 650, 1000, "650 B")
    assert failure.reason == "budget 0.5 (500 B) is unreachable"
    assert failure.advice == "ask for budget 'min' or a budget of at least 0.65 (650 B)"
    assert str(failure) == f"{failure.reason}; {failure.advice}"
    assert failure.needs == 650  # no plan of the pass peaks lower: what --fit reports a batch needs
    assert UnreachableBudget("out of reach", 650, 1000, "650 B", bound=False).needs is None  # a lower plan may exist


@pytest.mark.parametrize(("text", "message"), [
    ("lots", "'lots' is not a memory size: give bytes with a unit, like 16GiB"),
    ("min", "'min' is not a memory size"),
    ("0.5", "'0.5' is not a memory size"),
    ("16GiBs", "'16GiBs' has unknown unit 'GiBs'; use B, KiB, MiB, GiB, KB, MB or GB"),
])  # fmt: skip
def test_a_memory_size_is_refused_as_a_memory_size_not_a_budget(text: str, message: str) -> None:
    with pytest.raises(BudgetError) as error:
        parse_bytes(text)
    assert str(error.value) == message or str(error.value).startswith(message)
    assert "budget" not in str(error.value)


def test_a_memory_size() -> None:
    assert parse_bytes("16GiB") == 16 * 2**30
