"""Calibrating a plan's budget to a compiled step's measured peak.

``select`` plans against mutwo's simulator. The simulator knows the eager executor's buffers: one
output per node, freed after its last reader. Inductor fuses nodes and frees their intermediates
inside kernels, so a compiled step's peak differs from the plan's. Measured on the H100
(docs/benchmarks.md, "Compiled backends"): BERT-base b64 peaked 9–16% *under* its plans, so its
plans recomputed more than the budget needed; on the CPU, ResNet-152's compiled step peaked 11.5%
*over* its plan.

The CUDA-graph backends (``inductor-cudagraphs``, ``cudagraphs``) are calibrated the same way:
their step's peak is the recording's, measured when it records, and each round's recording is
released once measured. Measured on an H200, BERT-base b64 under ``inductor-cudagraphs`` peaked
11-29% under its plans (docs/benchmarks.md, issue 18's rows).

On CUDA what calibration measures is what the step makes the process *hold*: the allocator's
reserved bytes over a warm-up and two measured iterations (cached blocks, fragmentation between them,
CUDA-graph pools, library workspaces), not only its allocated bytes. A budget is then what
``torch.cuda.max_memory_reserved()`` reports over a user's steady iterations, and what a cap of
``torch.cuda.set_per_process_memory_fraction`` (``memory_limit``) must hold. Measured on the H100
before this, processes held 11-28% more than their plans' allocated peaks (issue 38). On the CPU,
which keeps no reserve, it is the allocated peak from the profiler's memory events.

Calibration closes that loop by measurement, not by a model of Inductor's buffers:

1. Plan at the budget, compile, and measure the compiled step's peak.
2. At most the budget and within ``tolerance`` under it: done.
3. Otherwise plan again with the budget moved by the gap to the middle of that window. If the
   step peaked ``gap`` bytes under it, the next plan may simulate ``gap`` bytes more; from the
   third round on, ``gap`` divided by how much the held bytes moved per byte of budget between
   the last two rounds (:func:`next_budget`). A step that ran out of memory (under a memory
   limit) is planned again 10% of the budget under the lower of its budget and its simulated peak,
   or lower still when what it held over its allocation by the time it failed says its step would
   hold more. Then compile and measure again. While every round so far ran out of memory, this
   goes on past the re-plans given, down to half the budget (:data:`OUT_OF_MEMORY_FLOOR`), each
   further round said in the log.

A budget within 1% of what the process may hold (a memory limit, the card's memory) is held 1%
under that limit instead (:data:`LIMIT_HEADROOM`): one plan's held memory moves by up to 0.6% from
process to process, and a plan the plan cache hands to the next process must fit there too.

A data-parallel step is calibrated the same way, every rank at once: each round's measurement
is the largest over the ranks, so that all plan the same budgets and keep the same round, and a
budget is what each rank holds (docs/data-parallel.md).

Each round costs a compile: ~150 s for BERT-base and ~4 min for ResNet-152 on the H100's host.
The step kept is a round within the tolerance; failing that, one under the budget. Among those it
takes the largest budget, since that recomputes least. When no round qualifies, the step with the
lowest measured peak is kept and the result says so; when every round ran out of memory,
:class:`CalibrationOutOfMemory` says so.
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch

from mutwo.ir.budget import ASKED_BUDGET, FIRST_PLAN_AIM, Budget, sizes
from mutwo.ir.graph import Graph
from mutwo.ir.pass_base import Pass, PassContext
from mutwo.ir.pass_manager import PassManager, PipelineFailure
from mutwo.ir.printer import print_graph
from mutwo.passes.chunk import ChunkPass, ChunkReport
from mutwo.runtime.execution.backends import CompiledStep, backend_services
from mutwo.runtime.measurement.iterations import cpu_iteration_peak, device_bytes, device_of, measure_iterations
from mutwo.runtime.parallel.distributed import DataParallel, largest, largest_measured, require_same_graph
from mutwo.runtime.planning.captured import CapturedGraph, pass_context

#: How far under the budget a compiled step's measured peak may be (the fused-executor issue's 3%).
TOLERANCE = 0.03
#: Re-plans calibration makes by default on CUDA (:func:`calibration_rounds`): in the calibrated
#: H100 rows of docs/benchmarks.md, two re-plans brought every step within the tolerance.
DEFAULT_ROUNDS = 2
#: How much of the budget a round that ran out of memory moves the next one down.
OUT_OF_MEMORY_STEP = 0.1
#: How far under a hard limit on what the process may hold (a memory limit, the card's memory)
#: calibration holds a step whose budget is closer to it: one plan's held memory moved by up to
#: 0.6% from process to process (the 0.5B Llama's first start and restarts held 10,752 and 10,692
#: MiB, bench/results/session25_h200/; ResNet-152-cl's third plan held 12,260 MiB, 28 MiB under a
#: 12 GiB limit, in one process, and ran out of memory in another), and a plan the plan cache
#: hands to the next process must fit there too.
LIMIT_HEADROOM = 0.01
#: How much more a plan's step held than its simulated peak, which a calibrated first plan is
#: made for (:func:`first_plan_aim`): under 16 and 12 GiB caps on an H200, out-of-core profiled
#: and compiled under inductor-cudagraphs with expandable segments, the thirteen rounds that ran
#: held 1.001-1.059 times their simulated peaks (BERT-base b64 1.015-1.059, the 0.5B Llama
#: 1.001-1.018, ResNet-152-cl b128 1.041-1.042; ``bench/results/session28_gpus/``,
#: ``session29_h200/``); this is their median. The spread is twice calibration's window: a first
#: plan lands in it about as often as not, and one aimed at the median runs out of memory only past
#: 1.051 (one round of the thirteen). The excess is the allocator's: the state's segments and the
#: warm-up stream's (about 170 MiB for BERT-base) and the CUDA graph's pool over what it allocates
#: (250-1,100 MiB, ``bench/held_excess_probe.py``). Aimed so, the three models' first plans held
#: 1.013-1.037 times their simulated peaks, each under the target, and were kept
#: (``session30_gpus/``).
FIRST_PLAN_HELD_RATIO = 1.025
#: While every round so far ran out of memory, calibration plans again past the re-plans it was
#: given, at least :data:`OUT_OF_MEMORY_STEP` lower each time, down to this share of the target: a
#: calibration that ends with every plan out of memory leaves nothing to train with. Measured on
#: an H200 under a 12 GiB limit at a 12 GiB budget, ResNet-152-cl b128 ran out of memory at
#: 100%, 90% and 80% of its budget in one process (bench/results/session25_h200/) and held
#: 12,260 MiB at 80% in another (session14_h200/). The step holds 2.6-3.2 GiB over what it
#: allocates: uncapped, its plan at 74% of the budget held 12,286 MiB, 2 MiB under it.
OUT_OF_MEMORY_FLOOR = 0.5
#: The bytes held per byte of budget between two rounds that :func:`next_budget` believes; outside
#: it the two plans were alike (a flat step) or the measurements noisy, and the slope is not used.
SLOPE_RANGE = (0.3, 3.0)
#: The least two rounds' budgets must differ by, as a share of the target, for their slope to be
#: used: closer, the measurements' noise is the slope.
SLOPE_SPAN = 0.01
#: The most a slope may stretch the gap's step (GPT-2 small's rows needed 2.8-3.2 times): an
#: overshoot under a memory limit runs out of memory (and fails a data-parallel run).
MAX_STEP = 3.0
#: The least share of a fitting round's predicted step time a re-plan must save to be compiled and
#: measured: each re-plan is a whole-iteration compile (65-100 s for BERT-base b64 and the 0.5B
#: Llama on an H200), and a plan whose step holds less than calibration's window but fits is
#: already a step to train. Under a 16 GiB cap BERT-base's second plan was predicted 613.5 ms
#: against its first's 604.4 ms (a slicing of its head that recomputes more), and the 0.5B Llama's
#: second and third under 12 GiB 814.5 and 802.9 ms against its first's 820.3 ms (0.7% and 2.1%),
#: for 75-97 s each (``bench/results/session29_h200/``).
MIN_REPLAN_GAIN = 0.01


class CalibrationOutOfMemory(torch.OutOfMemoryError):
    """Every plan calibration measured ran out of device memory (under a memory limit): a
    ``torch.OutOfMemoryError``, which ``except torch.OutOfMemoryError`` catches as it would the
    error of each round."""

Step = TypeVar("Step")


@dataclass(frozen=True)
class CalibrationRound:
    """One plan: the budget ``select`` planned for, the peak it simulated, the peak measured (on
    CUDA what the process held: reserved bytes); the simulated peak of the graph with nothing
    recomputed (a budget at or above it plans nothing), when known; on CUDA the allocated peak;
    and whether measuring it ran out of memory (its measured peak is then unknown, and set to
    the budget's reach: the round is never kept). For a round that ran out of memory on CUDA,
    ``allocated_peak_bytes`` and ``held_at_failure_bytes`` are the allocated and reserved peaks
    up to the failure: what the process held beyond its allocation by then."""

    budget_bytes: int
    planned_peak_bytes: int
    measured_peak_bytes: int
    unoptimized_peak_bytes: int | None = None
    allocated_peak_bytes: int | None = None
    out_of_memory: bool = False
    held_at_failure_bytes: int | None = None
    #: the time per iteration the plan predicts (the time model's), when known
    predicted_seconds: float | None = None
    #: whether ``chunk`` sliced the plan's language-model head: a sliced step holds less against its
    #: simulated peak than one with the head whole (:mod:`~mutwo.runtime.planning.held_ratio_cache`)
    head_sliced: bool = False

    @property
    def held_over_allocated_at_failure(self) -> int | None:
        """For a round that ran out of memory, what the process held over what it had allocated
        when it failed (cached blocks, fragmentation, a CUDA graph's pool), when known."""
        if not self.out_of_memory or self.held_at_failure_bytes is None or self.allocated_peak_bytes is None:
            return None
        return max(0, self.held_at_failure_bytes - self.allocated_peak_bytes)


@dataclass
class Calibration(Generic[Step]):
    """Every round of a calibration against ``target_bytes``, and the round whose step is kept."""

    target_bytes: int
    rounds: list[CalibrationRound]
    steps: list[Step]
    chosen: int
    tolerance: float = TOLERANCE
    #: why ``target_bytes`` is under the budget asked for (:func:`held_target`), else empty
    target_note: str = ""
    #: the budget a next round needed that no plan reaches, when that ended the rounds
    unreachable_bytes: int | None = None
    #: why the rounds ended before the step was within the window though a next plan was made
    #: (one not worth a compile, :data:`MIN_REPLAN_GAIN`), else empty
    stopped: str = ""

    @property
    def target(self) -> str:
        """The target in words: its MiB, and why it is under the budget when it is."""
        note = f" ({self.target_note})" if self.target_note else ""
        return f"{self.target_bytes / 2**20:,.1f} MiB{note}"

    @property
    def step(self) -> Step:
        """The kept round's step."""
        return self.steps[self.chosen]

    @property
    def within(self) -> bool:
        """Whether the kept step's measured peak is at most the target and within the tolerance under it."""
        return _within(self.rounds[self.chosen], self.target_bytes, self.tolerance)

    def describe(self) -> dict[str, Any]:
        """The calibration for a results row or summary.json."""
        return {"target_bytes": self.target_bytes, "target_note": self.target_note, "tolerance": self.tolerance,
                "chosen_round": self.chosen, "within_tolerance": self.within,
                "unreachable_budget_bytes": self.unreachable_bytes, "stopped": self.stopped,
                "rounds": [asdict(r) for r in self.rounds]}  # fmt: skip

    def summary(self) -> str:
        """One line: the rounds' measured peaks against the target, and which was kept."""
        peaks = ", ".join("out of memory" if r.out_of_memory else f"{r.measured_peak_bytes / 2**20:,.1f} MiB"
                          for r in self.rounds)  # fmt: skip
        kept = self.rounds[self.chosen].measured_peak_bytes
        verdict = "within" if self.within else "NOT within"
        return (f"peak calibration: measured {peaks} over {len(self.rounds)} round(s) for a budget of "
                f"{self.target}; kept round {self.chosen + 1} ({kept / 2**20:,.1f} MiB, "
                f"{(kept / self.target_bytes - 1) * 100:+.1f}%, {verdict} {self.tolerance:.0%} under it)")  # fmt: skip

    def over_budget(self) -> str | None:
        """The warning for a kept step measured over the budget (no round fitted under it), else None."""
        kept = self.rounds[self.chosen]
        if kept.out_of_memory or kept.measured_peak_bytes <= self.target_bytes:
            return None
        held, budget = sizes(kept.measured_peak_bytes, self.target_bytes)
        over = (kept.measured_peak_bytes / self.target_bytes - 1) * 100
        if self.unreachable_bytes is not None:  # more re-plans cannot help: say what would
            beyond_bytes = max(0, kept.measured_peak_bytes - kept.planned_peak_bytes)
            held, budget, needed, beyond = sizes(kept.measured_peak_bytes, self.target_bytes, self.unreachable_bytes,
                                                 beyond_bytes)  # fmt: skip
            against = (f"the {budget} calibration held it to ({self.target_note})" if self.target_note
                       else f"the budget of {budget}")  # fmt: skip
            return (f"mutwo: the planned step holds {held}, {over:.1f}% over {against}, and no plan reaches the "
                    f"{needed} a next plan would need: the process holds {beyond} beyond what the plan counts "
                    "(the allocator's cache, a CUDA graph's pool, and tensors outside the training step count "
                    "against the budget too); ask for a larger budget (and memory limit), or free what else the "
                    "process holds before planning")  # fmt: skip
        if self.target_note:  # under a limit already: over the headroom, not over the limit
            return (f"mutwo: the planned step holds {held}, {over:.1f}% over the {budget} calibration held it to "
                    f"({self.target_note}) after {len(self.rounds)} plan(s), so another process may run out of "
                    "memory with this plan: allow more re-plans (calibrate_peak=, --calibrate-peak) or ask for a "
                    "lower budget")  # fmt: skip
        return (f"mutwo: the planned step holds {held}, {over:.1f}% over the budget of {budget} after "
                f"{len(self.rounds)} plan(s), so a card with only the budget free would run out of memory: allow "
                "more re-plans (calibrate_peak=, --calibrate-peak), ask for a lower budget, or set memory_limit= "
                "(--memory-limit) so that a plan over it fails while planning")  # fmt: skip


def measured_peak(run: Callable[..., Any], inputs: list[torch.Tensor]) -> tuple[int, int | None]:
    """The peak of ``run``'s iterations, its inputs included, as the simulator counts a plan's, and
    on CUDA the allocated peak beside it. On CUDA what the process held (reserved bytes) over a
    warm-up iteration and two measured ones (a CUDA-graph backend records in the first: its pool
    counts, and the recording is released after, see :func:`release_recording`), on the inputs
    themselves (a second copy of the state on the device is more than a memory limit allows;
    their values are put back after). On the CPU the allocated peak from the profiler's allocation
    events (the CPU allocator keeps no peak), plus the inputs' bytes. A run out of memory raises
    ``torch.OutOfMemoryError`` with its recording released."""
    if device_of(inputs).type == "cuda":
        try:
            measured = measure_iterations(run, inputs, runs=2, warmup=1, on_inputs=True)
        finally:
            release_recording(run)
        assert measured.held_bytes is not None and measured.peak_bytes is not None  # measured on CUDA
        return measured.held_bytes, measured.peak_bytes
    return cpu_iteration_peak(run, inputs) + device_bytes(inputs, torch.device("cpu")), None


def release_recording(run: Callable[..., Any]) -> None:
    """Give back what a CUDA-graph backend's ``run`` recorded (it records again when next called):
    a step measured while planning must not hold its graph's private pool while another is
    recorded and measured, which would count in that one's peak and hold memory it needs.
    Nothing for the other backends. On CUDA the allocator's cached blocks go back to the device
    too, for the processes planning beside this one (``bench/compare.py --parallel-planning``)."""
    release = getattr(run, "release", None)
    if release is not None:
        release()
        torch.cuda.empty_cache()


def _within(round_: CalibrationRound, target: int, tolerance: float) -> bool:
    """A budget is a ceiling: a round is within when it peaked at most ``target``, and at most
    ``tolerance`` of it under (more under recomputes more than the budget needs)."""
    peak = round_.measured_peak_bytes
    return not round_.out_of_memory and (1 - tolerance) * target <= peak <= target


def window_middle(target: int, tolerance: float = TOLERANCE) -> int:
    """The middle of calibration's window under ``target`` (a step is within between ``1 -
    tolerance`` of it and it): what a plan aims at to be held within the window."""
    return target - int(tolerance * target / 2)


def next_budget(target: int, rounds: Sequence[CalibrationRound], tolerance: float = TOLERANCE,
                limit_bytes: int | None = None) -> int:  # fmt: skip
    """The budget for the next plan, from the ``rounds`` so far (the last one not within).

    After running out of memory, :data:`OUT_OF_MEMORY_STEP` of the target under the lower of the
    round's budget and its simulated peak, or lower still, at the window's middle less what the
    process held over its allocation when it failed
    (:attr:`CalibrationRound.held_over_allocated_at_failure`: an estimate of the step's excess,
    which the rest of the step may add to or use), but not under :data:`OUT_OF_MEMORY_FLOOR` of
    the target by that estimate alone. Otherwise the last
    budget moved by how far its step's measured peak missed the middle of the window under the
    target: by that gap itself after one round (the compiled step assumed to keep its gap to the
    plan: the median of the measured slopes, below, is 0.97), and by the gap divided by the slope
    between the last two rounds' budgets and measured peaks after more (a secant step: measured
    on the H100 and H200, the held bytes moved 0.31 to 1.97 bytes per byte of budget between two
    rounds of one calibration, ``bench/calibration_slopes.py``; a step by the gap alone landed
    5-12% under on GPT-2 small and 8.6% under on ResNet-152-cl and a data-parallel BERT-base). A
    slope outside :data:`SLOPE_RANGE` (two plans alike, or noise), or from two budgets closer
    than :data:`SLOPE_SPAN` of the target, is not used, and the step is at most :data:`MAX_STEP`
    times the gap. Under a hard limit on what the process may hold (``limit_bytes``), never over
    the budget at which a step holding the largest ratio of held to simulated bytes that any round
    measured would hold the limit. After running out of memory as after any other round, the result stays between the
    largest budget whose step fitted and the smallest that did not, when both were measured: the
    middle of the two when a step would leave them, and the fitting one, measured already, when
    no byte lies between (the rounds then stop)."""
    last = rounds[-1]
    ran = [r for r in rounds if not r.out_of_memory]
    aim = window_middle(target, tolerance)
    if last.out_of_memory:
        # From the plan's simulated peak when under its budget: a budget still above it plans the
        # same graph again (a budget over the peak with nothing recomputed recomputes nothing).
        base = min(last.budget_bytes, last.planned_peak_bytes)
        following = max(1, base - int(OUT_OF_MEMORY_STEP * target))
        excess = last.held_over_allocated_at_failure
        if excess is not None:  # a plan simulated at aim - excess would hold about the window's middle
            following = min(following, max(aim - excess, int(OUT_OF_MEMORY_FLOOR * target)))
    else:
        gap = aim - last.measured_peak_bytes
        earlier = next((r for r in reversed(ran[:-1])
                        if abs(r.budget_bytes - last.budget_bytes) >= SLOPE_SPAN * target), None)  # fmt: skip
        if earlier is not None:
            held = last.measured_peak_bytes - earlier.measured_peak_bytes
            budgeted = last.budget_bytes - earlier.budget_bytes
            if SLOPE_RANGE[0] <= held / budgeted <= SLOPE_RANGE[1]:
                bound = int(MAX_STEP * abs(gap))
                gap = max(-bound, min(bound, round(gap * budgeted / held)))
        following = max(1, last.budget_bytes + gap)
    # Under a hard limit, no plan that the rounds' own steps say runs out of memory: one holding as
    # much over its simulated peak as the most any round here held would hold the limit at this
    # budget. A step over the limit measures nothing to step from; one over the target does. Two
    # plans alike make a flat slope, and its secant step overshoots: the 0.5B Llama under a 12 GiB
    # cap held 11,664 and 11,784 MiB at 11,577 and 11,896 MiB, was planned next at 12,424 MiB, over
    # the limit itself, and ran out of memory (session29_h200/).
    # Applied last, so that the bracket below cannot move a budget back over it, and never under a
    # budget that fitted: that round is kept instead (the same budget again ends the rounds).
    ceiling = held_ratio_ceiling(rounds, limit_bytes)
    fitted = max((r.budget_bytes for r in ran if r.measured_peak_bytes <= target), default=None)
    missed = min((r.budget_bytes for r in rounds if r.out_of_memory or r.measured_peak_bytes > target), default=None)
    if fitted is not None and missed is not None and fitted < missed and not fitted < following < missed:
        following = (fitted + missed) // 2
    if ceiling is not None:
        following = min(following, max(ceiling, fitted or 0))
    return following


def held_ratio_ceiling(rounds: Sequence[CalibrationRound], limit_bytes: int | None) -> int | None:
    """The budget at which a step holding the largest ratio of held to simulated bytes of the
    ``rounds`` that ran would hold ``limit_bytes``; None without a limit or a round that ran."""
    ratios = [r.measured_peak_bytes / r.planned_peak_bytes for r in rounds
              if not r.out_of_memory and r.planned_peak_bytes > 0]  # fmt: skip
    return int(limit_bytes / max(ratios)) if limit_bytes is not None and ratios else None


def held_target(budget_bytes: int, limit_bytes: int | None) -> tuple[int, str]:
    """What calibration holds a step to for ``budget_bytes`` when the process may hold at most
    ``limit_bytes`` (None: no limit known), and why it is not the budget (else ""): at most
    :data:`LIMIT_HEADROOM` under the limit."""
    if limit_bytes is None or budget_bytes <= (1 - LIMIT_HEADROOM) * limit_bytes:
        return budget_bytes, ""
    aimed = int((1 - LIMIT_HEADROOM) * limit_bytes)
    return aimed, (f"{LIMIT_HEADROOM:.0%} under the {limit_bytes / 2**20:,.1f} MiB the process may hold; the "
                   f"budget asked is {budget_bytes / 2**20:,.1f} MiB")  # fmt: skip


def first_plan_aim(target: int, held_ratio: float | None = None) -> int:
    """The budget of a calibrated step's first plan: a step that holds ``held_ratio`` times its
    simulated peak (None: :data:`FIRST_PLAN_HELD_RATIO`) holds the middle of the window under
    ``target``. Never over the middle: a ratio under 1 (a step that held less than it simulated,
    as one with its language-model head sliced can) would aim over the target, where a plan that
    holds more (the head whole) runs out of memory under a limit."""
    ratio = held_ratio if held_ratio is not None else FIRST_PLAN_HELD_RATIO
    return int(window_middle(target) / max(ratio, 1.0))


def plan_first_at_window(ctx: PassContext, rounds: int, held_ratio: float | None = None) -> str | None:
    """Make the first plan for calibration's window (:func:`first_plan_aim`), when calibration
    will hold the step to a budget in bytes, or to a hard limit (a memory limit, the card's memory)
    below it.

    A plan made for the target itself simulates at its top, and its step holds more than it
    simulates. Under a limit its round runs out of memory (on an H200 under 16 and 12 GiB caps with
    the budget at the cap, BERT-base b64, the 0.5B Llama and ResNet-152-cl b128 each spent their
    first round and its whole-iteration compile so, ``bench/results/session28_gpus/``); so did
    BERT-base's plan for the window's middle (its step held 3-6% over its simulated peak,
    ``session29_h200/``). Under a budget below the limit it holds over the budget and is planned and
    compiled again: BERT-base b64 at 15 GiB under a 16 GiB cap held 15,648 MiB, 1.9% over its
    simulated peak and its budget, and its second round's compile took 58.5 s of the start's 167.6
    (``session34_h200/``). A round that runs out of memory measures nothing for the next to step
    from, one that fits measures the gap the next lands by.

    ``held_ratio``: what earlier calibrations of this graph measured its steps to hold over their
    simulated peaks (:mod:`~mutwo.runtime.planning.held_ratio_cache`), aimed with instead of
    :data:`FIRST_PLAN_HELD_RATIO`; None where none is kept.

    Sets the context's budget and keeps the one asked under :data:`ASKED_BUDGET`; the line for the
    log, or None when nothing changed (no calibration, no limit known: on the CPU without a memory
    limit, or ``budget="min"``). A fraction is resolved by the selection pass, which asks the
    :data:`~mutwo.ir.budget.FIRST_PLAN_AIM` service set here where to aim."""
    budget: Budget | None = ctx.services.get("budget")
    limit = ctx.services.get("device_memory")
    asked = limit if budget is None else budget.bytes  # without a budget, select plans for the limit
    if rounds <= 0 or limit is None:
        return None
    if asked is None:  # a fraction: the selection pass resolves it, then asks where to aim
        if budget is not None and not budget.minimum:
            ctx.services[FIRST_PLAN_AIM] = functools.partial(_aim_at_window, limit=limit, held_ratio=held_ratio)
        return None
    target, note = held_target(asked, limit)
    aim = first_plan_aim(target, held_ratio)
    ctx.services["budget"], ctx.services[ASKED_BUDGET] = Budget(bytes=aim), asked
    return (f"peak calibration: the first plan is made for {aim / 2**20:,.1f} MiB, so that a step holding "
            f"{_held_phrase(held_ratio)} holds the middle of the window under the {target / 2**20:,.1f} MiB "
            f"calibration holds the step to ({note or 'the budget asked'})")


def _held_phrase(held_ratio: float | None) -> str:
    """What the first plan assumes its step holds, and where that comes from."""
    if held_ratio is None:
        return f"{FIRST_PLAN_HELD_RATIO - 1:.1%} over its simulated peak"
    if held_ratio < 1:  # first_plan_aim never aims over the window's middle
        return (f"its simulated peak (this graph's steps held {held_ratio - 1:+.1%} over theirs in the calibrations "
                "the plan cache kept; the first plan never aims over the window's middle)")  # fmt: skip
    return (f"{held_ratio - 1:+.1%} over its simulated peak (as this graph's steps held in the calibrations the plan "
            "cache kept)")  # fmt: skip


def _aim_at_window(resolved: int, limit: int, held_ratio: float | None = None) -> tuple[int, str]:
    """Where the first plan aims for a budget of ``resolved`` bytes under ``limit`` and why
    (:data:`~mutwo.ir.budget.FIRST_PLAN_AIM`)."""
    target, note = held_target(resolved, limit)
    why = f"calibration holds the step {note}" if note else "calibration holds the step to it"
    return first_plan_aim(target, held_ratio), f"{why}, and a step holds {_held_phrase(held_ratio)}"


def calibrate(target_bytes: int, rounds: int,
              plan_and_measure: Callable[[int], tuple[CalibrationRound, Step] | None],
              log: Callable[[str], None] = lambda message: None,
              tolerance: float = TOLERANCE, target_note: str = "",
              first_budget: int | None = None, limit_bytes: int | None = None,
              predict: Callable[[int], float | None] | None = None) -> Calibration[Step]:  # fmt: skip
    """Plan, compile and measure at ``target_bytes``, then up to ``rounds`` more times at budgets
    moved by the measured gap, until a step's measured peak is within ``tolerance`` of the target.
    When ``rounds`` is 1 or more and every round ran out of memory, more rounds follow, each at
    least :data:`OUT_OF_MEMORY_STEP` of the target lower (:func:`next_budget`), until one runs or
    the next budget would be under :data:`OUT_OF_MEMORY_FLOOR` of the target.

    ``plan_and_measure(budget_bytes)`` plans for that budget from the unplanned graph, compiles the
    result, measures its peak, and returns the round and the step; or ``None`` when no plan reaches
    that budget, which ends the rounds (the first call must succeed). ``target_note``: why the
    target is under the budget asked for (:func:`held_target`), said with it; ``first_budget``:
    the budget the first round's plan was made for, when not the target (the budget asked);
    ``limit_bytes``: what the process may hold, when known (:func:`next_budget`); ``predict(budget_bytes)``:
    the time per iteration the plan for that budget predicts, without compiling it (None: nothing
    to compare, as no plan reaches it or its graph was measured already), when known: once a round
    fitted, a re-plan predicted less than :data:`MIN_REPLAN_GAIN` faster than it is not compiled,
    and the rounds end (:func:`not_worth_a_compile`)."""
    if rounds < 0:
        raise ValueError(f"calibration rounds must be 0 or more, got {rounds}")
    results: list[CalibrationRound] = []
    steps: list[Step] = []
    budget = target_bytes if first_budget is None else first_budget
    unreachable = None
    stopped = ""
    index = 0
    while True:
        # Each round compiles and measures (minutes on a large model): said as it starts.
        limit = f"of at most {rounds + 1}" if index <= rounds else f"past the {rounds + 1} given"
        log(f"peak calibration round {index + 1} {limit}: planning for {budget / 2**20:,.1f} MiB"
            + (", then compiling and measuring it" if index else ", measuring the step compiled for it"))
        began = time.perf_counter()
        outcome = plan_and_measure(budget)
        if outcome is None:
            if not results:
                raise ValueError(f"no plan reaches the budget of {target_bytes} bytes to calibrate from")
            log(f"peak calibration round {index + 1}: no plan reaches {budget / 2**20:,.1f} MiB; stopping")
            unreachable = budget
            break
        result, step = outcome
        results.append(result)
        steps.append(step)
        measured = (_ran_out(result) if result.out_of_memory
                    else f"measured {result.measured_peak_bytes / 2**20:,.1f} MiB")  # fmt: skip
        log(f"peak calibration round {index + 1}: planned for {budget / 2**20:,.1f} MiB, simulated "
            f"{result.planned_peak_bytes / 2**20:,.1f} MiB, {measured} (budget {target_bytes / 2**20:,.1f} MiB), "
            f"in {time.perf_counter() - began:.1f} s")
        if _within(result, target_bytes, tolerance):
            break
        following = next_budget(target_bytes, results, tolerance, limit_bytes)
        unbounded = next_budget(target_bytes, results, tolerance)
        if limit_bytes is not None and following < unbounded:
            log(f"peak calibration: the next budget is {following / 2**20:,.1f} MiB, not {unbounded / 2**20:,.1f}: "
                "a step holding as much over its simulated peak as a round here did would hold more than the "
                f"{limit_bytes / 2**20:,.1f} MiB the process may hold (a budget measured already ends the rounds)")
        # Every budget at or above the graph's simulated peak with nothing recomputed plans nothing:
        # measured on the H100 (BERT-base b64 at torch.compile 0.5's peak), that step peaked 4.9%
        # under the budget, and a third compile planned nothing again.
        unplanned = result.unoptimized_peak_bytes
        cap = float("inf") if unplanned is None else unplanned
        if any(min(r.budget_bytes, cap) == min(following, cap) for r in results):
            if unplanned is not None and following >= unplanned:
                log(f"peak calibration: {following / 2**20:,.1f} MiB is above the {unplanned / 2**20:,.1f} MiB the "
                    "graph simulates with nothing recomputed, whose step was measured already; stopping")  # fmt: skip
            break  # the same plan again would measure the same peak
        if index >= rounds and not _plan_again_out_of_memory(target_bytes, rounds, results, following, log):
            break
        if predict is not None:
            stopped = not_worth_a_compile(results, target_bytes, following, predict)
            if stopped:
                log(f"peak calibration: {stopped}; stopping")
                break
        budget = following
        index += 1
    if all(r.out_of_memory for r in results):
        raise CalibrationOutOfMemory(
            f"every plan measured for the budget of {target_bytes / 2**20:,.1f} MiB"
            f"{f' ({target_note})' if target_note else ''} ran out of device memory "
            f"({len(results)} round(s), down to {results[-1].budget_bytes / 2**20:,.1f} MiB planned); give a "
            "lower budget, or a higher memory limit")  # fmt: skip
    calibration = Calibration(target_bytes, results, steps, _choose(results, target_bytes, tolerance), tolerance,
                              target_note, unreachable, stopped)  # fmt: skip
    over = calibration.over_budget()
    if over is not None:  # the budget is what the process may hold: said even when the log is quiet
        warnings.warn(over, stacklevel=2)
    return calibration


def not_worth_a_compile(rounds: Sequence[CalibrationRound], target: int, following: int,
                        predict: Callable[[int], float | None], min_gain: float | None = None) -> str:
    """Why the plan for ``following`` is not worth compiling and measuring, else "": once a round's
    step fitted under ``target``, the plan of a larger budget (one that recomputes less) must be
    predicted at least ``min_gain`` (default :data:`MIN_REPLAN_GAIN`) faster than the fitting round
    of the largest budget (the one :func:`_choose` keeps). A budget no plan reaches is left for the
    round to find out."""
    min_gain = MIN_REPLAN_GAIN if min_gain is None else min_gain
    fitted = [r for r in rounds if not r.out_of_memory and r.measured_peak_bytes <= target]
    if not fitted:
        return ""
    kept = max(fitted, key=lambda r: r.budget_bytes)
    if kept.predicted_seconds is None or kept.predicted_seconds <= 0 or following <= kept.budget_bytes:
        return ""
    seconds = predict(following)
    if seconds is None or kept.predicted_seconds - seconds >= min_gain * kept.predicted_seconds:
        return ""
    gain = (kept.predicted_seconds - seconds) / kept.predicted_seconds
    faster = f"{gain:.2%} faster" if gain > 0 else "no faster" if gain == 0 else f"{-gain:.2%} slower"
    return (f"the plan for {following / 2**20:,.1f} MiB is predicted {seconds * 1e3:.1f} ms per iteration against "
            f"{kept.predicted_seconds * 1e3:.1f} ms for the {kept.budget_bytes / 2**20:,.1f} MiB plan whose step fits "
            f"({faster}, under the {min_gain:.0%} worth a compile)")


def _ran_out(result: CalibrationRound) -> str:
    """How a round that ran out of memory is said: with what the process held by then, when known."""
    excess = result.held_over_allocated_at_failure
    if excess is None or result.held_at_failure_bytes is None:
        return "ran out of memory"
    return (f"ran out of memory (holding {result.held_at_failure_bytes / 2**20:,.1f} MiB, "
            f"{excess / 2**20:,.1f} MiB over its allocation, when it failed)")


def failure_peaks(inputs: list[torch.Tensor]) -> tuple[int | None, int | None]:
    """After a measurement ran out of memory: the reserved and allocated peaks on the inputs'
    device up to the failure (each measured iteration and a recording reset them as they start),
    or ``(None, None)`` off CUDA."""
    device = device_of(inputs)
    if device.type != "cuda":
        return None, None
    return torch.cuda.max_memory_reserved(device), torch.cuda.max_memory_allocated(device)


def _plan_again_out_of_memory(target: int, rounds: int, results: Sequence[CalibrationRound], following: int,
                              log: Callable[[str], None]) -> bool:  # fmt: skip
    """Whether calibration, its ``rounds`` re-plans spent, plans once more at ``following``: only
    when re-plans were allowed at all, every round ran out of memory, and ``following`` is at
    least :data:`OUT_OF_MEMORY_FLOOR` of the target. Said in the log when it does."""
    floor = int(OUT_OF_MEMORY_FLOOR * target)
    if rounds == 0 or not all(r.out_of_memory for r in results) or following < floor:
        return False
    log(f"peak calibration: every plan so far ran out of memory; planning again at {following / 2**20:,.1f} MiB, "
        f"past the {rounds} re-plan(s) given (none under {floor / 2**20:,.1f} MiB, half the target)")
    return True


def _choose(rounds: list[CalibrationRound], target: int, tolerance: float) -> int:
    """The round to keep: of those within the tolerance under the target, else of those under it,
    the one of the largest budget (it recomputes least); when none fits, the round of the lowest
    measured peak. Never a round that ran out of memory, unless all did."""
    ran = [i for i, r in enumerate(rounds) if not r.out_of_memory] or list(range(len(rounds)))
    within = [i for i in ran if _within(rounds[i], target, tolerance)]
    fitting = within or [i for i in ran if rounds[i].measured_peak_bytes <= target]
    if fitting:
        return max(fitting, key=lambda i: rounds[i].budget_bytes)
    return min(ran, key=lambda i: rounds[i].measured_peak_bytes)


def calibration_refusal(rounds: int | None, backend: str, passes: Sequence[Pass], option: str,
                        budget_option: str) -> str | None:  # fmt: skip
    """Why calibration cannot run with these settings (named as the caller's ``option`` and
    ``budget_option``), or ``None`` when it can (or ``rounds`` is ``None``: not asked for)."""
    if rounds is None:
        return None
    if rounds < 0:
        return f"{option} takes the number of re-plans, 0 (none) or more (like 2), got {rounds}"
    if rounds == 0:
        return None
    select = next((p for p in passes if p.name in ("select", "select-swap")), None)
    if select is None:
        return (f"{option} re-plans select's (or select-swap's) budget, and the pipeline runs neither; add one "
                "(profile,select,rewrite)")  # fmt: skip
    if getattr(select, "budget", None) is not None:
        return (f"{option} moves the run's budget, which {select.name}{{budget=...}} overrides; give the budget "
                f"with {budget_option}")  # fmt: skip
    return None


def calibration_rounds(rounds: int | None, device: torch.device, passes: Sequence[Pass],
                       budgeted: bool = True) -> int:  # fmt: skip
    """The re-plans calibration makes: ``rounds`` when given (0: none). By default
    :data:`DEFAULT_ROUNDS` on CUDA, where what the process holds differs from the plan's simulated
    peak, when the run has a budget or a memory limit (``budgeted``: without either the step is
    planned for the whole device, and measuring it would only record its CUDA graph once more) and
    the pipeline plans the run's budget (select or select-swap without a budget of its own); none
    on the CPU, which holds what it allocates. A data-parallel step is calibrated too: its ranks
    agree on each round's measurement (:func:`calibrated_step`)."""
    if rounds is not None:
        return rounds
    if device.type != "cuda" or not budgeted:
        return 0
    select = next((p for p in passes if p.name in ("select", "select-swap")), None)
    return DEFAULT_ROUNDS if select is not None and getattr(select, "budget", None) is None else 0


@dataclass
class Calibrated:
    """What calibration keeps: the final graph, its compiled step and the context its passes ran in."""

    graph: Graph
    compiled: CompiledStep
    ctx: PassContext
    calibration: Calibration[Any] | None = None


def same_plan(graph: Graph, other: Graph) -> bool:
    """Whether two planned graphs are the same program (their printed IR)."""
    return print_graph(graph) == print_graph(other)


def pipeline_plan(artifacts: dict[str, Any]) -> Any:
    """The plan a pipeline made: ``select``'s (recompute only) or ``select-swap``'s (None: neither ran)."""
    return artifacts["plan"] if "plan" in artifacts else artifacts.get("swap-plan")


def _rank_out_of_memory(rank: int, budget_bytes: int, inputs: list[torch.Tensor]) -> CalibrationOutOfMemory:
    """The error of a data-parallel rank whose calibration round ran out of memory: which rank,
    which round's budget, what the process held, and what the user can change. The round cannot
    be skipped as on one device: the other ranks wait in the step's collectives until the launcher
    stops them (torchrun does when this rank exits) or the process group's timeout."""
    device = device_of(inputs)
    held = (f", holding {torch.cuda.memory_reserved(device) / 2**20:,.1f} MiB"
            if device.type == "cuda" else "")  # fmt: skip
    return CalibrationOutOfMemory(
        f"rank {rank} ran out of device memory measuring the plan for {budget_bytes / 2**20:,.1f} MiB during "
        f"peak calibration{held}; a data-parallel step cannot skip that plan, as the other ranks wait in its "
        "collectives: give a lower budget, or a higher memory limit")  # fmt: skip


def head_kept_sliced(pass_: Pass, first: Any) -> Pass:
    """``pass_`` as calibration's re-plans run it after a first plan whose ``chunk`` report is
    ``first``: where that plan sliced the language-model head, ``chunk`` slices it in every re-plan
    (``when=always``; how many slices still follows each budget, as given), so that it does not
    leave the head whole at a larger budget.

    Why: slicing changes how much a compiled step holds against its simulated peak, and the rounds
    step by that relation. On an H200 under a 16 GiB cap, BERT-base b64 at 13 GiB: the first plan,
    sliced, held 0.92 times its simulated peak (11,188 MiB, 16% under the budget); the re-plans at
    14,424 and 13,475 MiB, with the head whole, held 1.046 and 1.049 times theirs, both over the
    budget; calibration kept the first after three compiles, at 649 ms a step against 561 ms at 14
    GiB (``bench/results/session34_h200/aim_learned/``). A first plan that left the head whole
    lets ``chunk`` decide again: a re-plan under a lower budget may need the slices. Where the first
    plan's count came from the cost rule's trials, re-plans keep that count (``when=always`` prices
    no counts); where the budget needed the slices, each re-plan's count follows its budget."""
    if isinstance(pass_, ChunkPass) and isinstance(first, ChunkReport) and first.applied and not first.refused:
        # Sliced by the cost rule (its trials priced each count): the count it priced fastest, which
        # when=always would not price again; sliced because the budget needed it: a count per budget.
        return replace(pass_, when="always", k=first.slices if first.predicted_seconds else pass_.k)
    return pass_


def calibrated_step(rounds: int, manager: PassManager, lowered: CapturedGraph, original: Graph, first: Calibrated,
                    compile_graph: Callable[[Graph], CompiledStep], out_dir: Path | None,
                    log: Callable[[str], None], data_parallel: DataParallel | None = None) -> Calibrated:  # fmt: skip
    """Measure ``first`` (the pipeline's result, compiled), then re-plan ``original`` with the
    pipeline's passes after the profile, at budgets moved by the measured gap, up to ``rounds``
    times. When a later round is kept, its passes run once more with ``out_dir`` so that
    plan.json and the other files describe the kept plan.

    With ``data_parallel``, every rank calls this together. Each round's measurement is the
    largest over the ranks (:func:`~mutwo.runtime.parallel.distributed.largest_measured`); with
    the profile agreed before, every rank then plans the same budgets, compiles the same graphs
    and keeps the same round, whose fullest rank holds at most the budget; each re-planned graph,
    before it is compiled, and the kept one are compared over the ranks
    (:class:`~mutwo.runtime.parallel.distributed.RanksDisagreeError`). A round that runs out
    of memory on a rank is not re-planned: the other ranks' collectives of that step are left
    unmatched, so the error is raised (as eager DDP's would be)."""
    target = pipeline_plan(first.ctx.artifacts)
    if target is None or target.budget_bytes <= 0:
        # No budget in bytes (a step planned without one, which recomputes nothing): nothing to
        # hold the step to, and measuring it would only record its CUDA graph once more.
        log("peak calibration: the plan has no budget in bytes to hold the step to; not calibrated")
        return first
    profile = first.ctx.artifacts["profile"]
    sliced = first.ctx.artifacts.get("chunk")
    planning = PassManager([head_kept_sliced(p, sliced) for p in manager.passes if "profile" not in type(p).provides],
                           manager.instrumentation)  # fmt: skip
    #: each plan measured, by its graph's text: a budget moved by less than the plan's granularity
    #: plans the same graph again, whose compile (minutes on a real model) and peak are known
    measured: dict[str, tuple[CalibrationRound, Calibrated]] = {}

    keep_grads = bool(first.ctx.services.get("keep_grads", False))  # optimizer-in-backward keeps them then

    def plan(budget_bytes: int, folder: Path | None) -> tuple[Graph, PassContext] | None:
        graph = original.copy()
        ctx = pass_context(lowered, Budget(bytes=budget_bytes), out_dir=folder, log=log, keep_grads=keep_grads)
        ctx.services.update(backend_services(first.compiled.backend))  # as for the first plan
        ctx.artifacts["profile"] = profile
        if "transfer" in first.ctx.artifacts:  # the copies' speeds measured once: plans compare by their graphs alone
            ctx.artifacts["transfer"] = first.ctx.artifacts["transfer"]
        try:
            planning.run(graph, ctx)
        except PipelineFailure:  # a budget out of reach: the rounds so far stand
            return None
        return graph, ctx

    #: re-plans made without files, with their printed graphs, by budget: a re-plan weighed by its
    #: predicted time (``predict``) is the one compiled, planned, printed and compared over the ranks once
    replans: dict[int, tuple[tuple[Graph, PassContext], str] | None] = {}

    def replan(budget_bytes: int) -> tuple[tuple[Graph, PassContext], str] | None:
        if budget_bytes not in replans:
            planned = plan(budget_bytes, None)
            if data_parallel is not None:  # before the ranks decide, compile or run: their collectives must match
                require_same_graph(planned[0] if planned is not None else None, data_parallel, "re-planned")
            replans[budget_bytes] = None if planned is None else (planned, print_graph(planned[0]))
        return replans[budget_bytes]

    def predict(budget_bytes: int) -> float | None:
        log(f"peak calibration: planning for {budget_bytes / 2**20:,.1f} MiB, to compile it only if it is predicted "
            f"at least {MIN_REPLAN_GAIN:.0%} faster than the step that fits")  # fmt: skip
        replanned = replan(budget_bytes)
        if replanned is None or replanned[1] in measured:  # unreachable, or no compile to save
            return None
        seconds = float(pipeline_plan(replanned[0][1].artifacts).predicted_seconds)
        # Each rank prices the copies of a swap plan with its own transfer model: the slowest decides.
        return seconds if data_parallel is None else largest(seconds, data_parallel)

    def plan_and_measure(budget_bytes: int) -> tuple[CalibrationRound, Calibrated] | None:
        if measured:
            replanned = replan(budget_bytes)
            if replanned is None:
                return None
            planned, text = replanned
            if text in measured:
                same, made = measured[text]
                log(f"peak calibration: {budget_bytes / 2**20:,.1f} MiB plans the graph planned for "
                    f"{same.budget_bytes / 2**20:,.1f} MiB; not compiled or measured again")  # fmt: skip
                return replace(same, budget_bytes=budget_bytes), made
            made = Calibrated(planned[0], compile_graph(planned[0]), planned[1])
        else:
            made, text = first, print_graph(first.graph)
        made_plan = pipeline_plan(made.ctx.artifacts)
        try:
            peak, allocated = measured_peak(made.compiled.run, lowered.inputs)
            out_of_memory = False
        except torch.OutOfMemoryError as error:  # under a memory limit: this plan is over it
            if data_parallel is not None:  # the other ranks wait in this step's collectives: nothing to agree on
                raise _rank_out_of_memory(data_parallel.rank, budget_bytes, lowered.inputs) from error
            held_at_failure, allocated = failure_peaks(lowered.inputs)
            peak, out_of_memory = budget_bytes, True
        else:
            held_at_failure = None
        seconds = float(made_plan.predicted_seconds)
        if data_parallel is not None:
            peak, allocated = largest_measured(peak, allocated, data_parallel)
            seconds = largest(seconds, data_parallel)
        sliced = made.ctx.artifacts.get("chunk")
        measured[text] = CalibrationRound(budget_bytes, made_plan.predicted_peak, peak, made_plan.unoptimized_peak,
                                          allocated, out_of_memory, held_at_failure, seconds,
                                          isinstance(sliced, ChunkReport) and sliced.applied), made  # fmt: skip
        return measured[text]

    asked = first.ctx.services.get(ASKED_BUDGET, target.budget_bytes)  # the first plan may have aimed lower
    limit = first.ctx.services.get("device_memory")
    aimed, note = held_target(asked, limit)
    if note:
        log(f"peak calibration: holding the step to {aimed / 2**20:,.1f} MiB, {note}: one plan's held memory moved "
            "by up to 0.6% from process to process")  # fmt: skip
    calibration = calibrate(aimed, rounds, plan_and_measure, log, target_note=note,
                            first_budget=target.budget_bytes, limit_bytes=limit, predict=predict)  # fmt: skip
    log(calibration.summary())
    kept = calibration.step
    if kept is not first:  # its passes again, writing their files; the same graph, Inductor's cache compiles it
        planned = plan(calibration.rounds[calibration.chosen].budget_bytes, out_dir)
        assert planned is not None  # the same budget planned before
        if same_plan(planned[0], kept.graph):
            kept = Calibrated(planned[0], compile_graph(planned[0]), planned[1])
        else:  # planning is meant to be a function of the budget; the step measured is the one to train
            log(f"peak calibration: planning {calibration.rounds[calibration.chosen].budget_bytes / 2**20:,.1f} MiB "
                f"again made another plan than round {calibration.chosen + 1}'s; training the step measured, whose "
                "plan the files in the output folder do not describe")  # fmt: skip
    kept.calibration = calibration
    if data_parallel is not None:
        require_same_graph(kept.graph, data_parallel, "calibrated")
    return kept
