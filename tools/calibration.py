"""``mutwo-opt --calibrate-peak ROUNDS``: re-plan until the Inductor-compiled step's measured peak is
within 3% of the budget (:mod:`mutwo.runtime.peak_calibration` says why and how)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mutwo.ir.budget import Budget
from mutwo.ir.graph import Graph
from mutwo.ir.pass_base import PassContext
from mutwo.ir.pass_manager import PassManager, PipelineFailure
from mutwo.runtime.api import CapturedGraph, pass_context
from mutwo.runtime.backends import CompiledStep
from mutwo.runtime.peak_calibration import Calibration, CalibrationRound, calibrate, measured_peak
from mutwo.tools.cli import UsageError


def refuse_calibration(rounds: int | None, backend: str, manager: PassManager) -> None:
    """``--calibrate-peak`` given where it cannot work, refused in one line before anything runs."""
    if rounds is None:
        return
    if rounds < 1:
        raise UsageError(f"--calibrate-peak takes the number of re-plans, 1 or more (like 2), got {rounds}")
    if backend != "inductor":
        raise UsageError("--calibrate-peak re-plans for the measured peak of an Inductor-compiled step; add "
                         "--backend inductor (the eager executor's peak is the simulated one)")  # fmt: skip
    select = next((p for p in manager.passes if p.name == "select"), None)
    if select is None:
        raise UsageError("--calibrate-peak re-plans select's budget, and the pipeline runs no select pass; add one "
                         "(-p profile,select,rewrite)")  # fmt: skip
    if getattr(select, "budget", None) is not None:
        raise UsageError("--calibrate-peak moves the run's budget, which select{budget=...} overrides; give the "
                         "budget with --budget instead")  # fmt: skip


@dataclass
class Calibrated:
    """What calibration keeps: the final graph, its compiled step and the context its passes ran in."""

    graph: Graph
    compiled: CompiledStep
    ctx: PassContext
    calibration: Calibration[Any] | None = None


def calibrated_step(rounds: int, manager: PassManager, lowered: CapturedGraph, original: Graph, first: Calibrated,
                    compile_graph: Callable[[Graph], CompiledStep], out_dir: Path | None,
                    log: Callable[[str], None]) -> Calibrated:  # fmt: skip
    """Measure ``first`` (the pipeline's result, compiled), then re-plan ``original`` with the
    pipeline's passes after the profile, at budgets moved by the measured gap, up to ``rounds``
    times. When a later round is kept, its passes run once more with ``out_dir`` so that
    plan.json and the other files describe the kept plan."""
    profile = first.ctx.artifacts["profile"]
    planning = PassManager([p for p in manager.passes if "profile" not in type(p).provides], manager.instrumentation)
    tried: list[Calibrated] = []

    def replan(budget_bytes: int, folder: Path | None) -> Calibrated | None:
        graph = original.copy()
        ctx = pass_context(lowered, Budget(bytes=budget_bytes), out_dir=folder, log=log)
        ctx.services["replay_random"] = False  # as for the first plan: Inductor runs random ops itself
        ctx.artifacts["profile"] = profile
        try:
            planning.run(graph, ctx)
        except PipelineFailure:  # a budget out of reach: the rounds so far stand
            return None
        return Calibrated(graph, compile_graph(graph), ctx)

    def plan_and_measure(budget_bytes: int) -> tuple[CalibrationRound, Calibrated] | None:
        made = first if not tried else replan(budget_bytes, None)
        if made is None:
            return None
        tried.append(made)
        peak = measured_peak(made.compiled.run, lowered.inputs)
        return CalibrationRound(budget_bytes, made.ctx.artifacts["plan"].predicted_peak, peak), made

    calibration = calibrate(first.ctx.artifacts["plan"].budget_bytes, rounds, plan_and_measure, log)
    log(calibration.summary())
    kept = calibration.step
    if kept is not first:
        rewritten = replan(calibration.rounds[calibration.chosen].budget_bytes, out_dir)
        assert rewritten is not None  # the same budget planned before
        kept = rewritten
    kept.calibration = calibration
    return kept
