"""Choosing between select-swap's plan and recompute only by measuring both compiled steps.

``select-swap`` keeps a plan with swaps only when it is predicted faster than recompute only at
the budget. Both predictions use the eager executor's node times, which a compiled step does not
keep: on an H200 under ``inductor-cudagraphs``, ResNet-152-cl's recompute-only plans ran 12-15%
under their predictions (Inductor fuses the batch-norm replays) while a 13-swap plan ran as
predicted, so select-swap kept the plan that ran 17% slower (docs/benchmarks.md). Under a compiled
backend the measured choice compiles the recompute-only plan too, measures both, and keeps the
faster (docs/swap.md, "Under a compiled backend: choose by measuring").

It is used by ``mutwo-opt --measure-choice``, ``mutwo.optimize(..., measure_choice=True)`` and,
measuring after ``bench/compare.py``'s gate, by :class:`mutwo.tools.experiment_planning.PlanChoice`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from mutwo.ir.budget import ASKED_BUDGET, Budget
from mutwo.ir.graph import Graph
from mutwo.ir.pass_base import Pass
from mutwo.ir.pass_manager import PassManager, PipelineFailure
from mutwo.passes.extract import ExtractPass
from mutwo.passes.insert_recompute import InsertRecomputePass
from mutwo.passes.select import SelectPass
from mutwo.passes.share_gathers import ShareGathersPass
from mutwo.runtime.execution.backends import CompiledStep, backend_services
from mutwo.runtime.measurement.iterations import measure_iterations
from mutwo.runtime.planning.captured import CapturedGraph, pass_context
from mutwo.runtime.planning.peak_calibration import (
    TOLERANCE,
    Calibrated,
    calibrated_step,
    first_plan_aim,
    release_recording,
)

SWAP_AND_RECOMPUTE = "swap+recompute"
RECOMPUTE_ONLY = "recompute only"
#: how each candidate is measured: as bench/compare.py measures a row
WARMUP, ITERATIONS = 3, 10


def choice_refusal(measure: bool, backend: str, passes: Sequence[Pass], option: str,
                   budget: Budget | None = None) -> str | None:  # fmt: skip
    """Why a measured choice cannot run with these settings (``option``: how the caller names it;
    ``budget``: the run's), or ``None`` when it can or is not asked for."""
    if not measure:
        return None
    if backend == "eager":
        return (f"{option} weighs plans compiled by a backend whose step runs otherwise than the eager times they are "
                "priced at; the eager executor runs as priced: drop it, or use the inductor, inductor-cudagraphs "
                "or cudagraphs backend")  # fmt: skip
    select = next((p for p in passes if p.name == "select-swap"), None)
    if select is None:
        return (f"{option} weighs select-swap's plan against recompute only; the pipeline runs no select-swap "
                "(use profile,swap)")  # fmt: skip
    own = getattr(select, "budget", None)
    if (own is not None and own.strip().lower() == "min") or (own is None and budget is not None and budget.minimum):
        return (f"{option} weighs two plans at one budget, and 'min' gives each its own lowest peak; give the budget "
                "as a fraction or an amount (like 0.5 or 16GiB)")  # fmt: skip
    return None


def recompute_only_passes(passes: Sequence[Pass]) -> list[Pass]:
    """The planning passes of a swap pipeline (those after the profile) with select-swap replaced by
    ``select`` at its budget (and fused pricing) and insert-swap by ``rewrite``: the plan a
    ``profile,select,rewrite`` run makes."""
    planning: list[Pass] = []
    for p in passes:
        if "profile" in type(p).provides:
            continue
        if p.name == "select-swap":
            planning.append(SelectPass(budget=getattr(p, "budget", None), fused=getattr(p, "fused", False)))
        elif p.name == "insert-swap":
            planning += [ExtractPass(), InsertRecomputePass(), ShareGathersPass()]
        else:
            planning.append(p)
    return planning


def measure_run(name: str, run: Callable[..., Any], inputs: list[torch.Tensor], *, warmup: int = WARMUP,
                iterations: int = ITERATIONS) -> dict[str, Any]:  # fmt: skip
    """One candidate measured: median time and peak (the inputs plus the iteration's own memory, as
    the simulator counts a plan; what the process held on CUDA, with the allocated peak beside it;
    None on the CPU). At least one warm-up iteration, in which a
    CUDA-graph backend records (recording is not timed); the recording is released after, so that
    it does not count in the next candidate's peak. Running out of memory is a result
    (``error``), not a crash: the other candidate may fit."""
    try:
        result = measure_iterations(run, inputs, runs=iterations, warmup=max(1, warmup), on_inputs=True)
    except torch.OutOfMemoryError:
        return {"plan": name, "error": "out of memory"}
    finally:
        release_recording(run)
    return {"plan": name, "iteration_ms": round(result.seconds * 1e3, 3), "peak_bytes": result.held_bytes,
            "allocated_peak_bytes": result.peak_bytes}  # fmt: skip


def plan_fields(plan: Any) -> dict[str, Any]:
    """What a plan (select's or select-swap's) predicted, for a candidate's record."""
    swapped = plan.of("swap") if hasattr(plan, "of") else []
    recomputed = plan.of("recompute") if hasattr(plan, "of") else plan.entries
    return {"predicted_iteration_ms": round(plan.predicted_seconds * 1e3, 3), "planned_peak_bytes": plan.predicted_peak,
            "swapped_tensors": len(swapped), "recomputed_tensors": len(recomputed)}  # fmt: skip


def measure_candidates(candidates: Sequence[tuple[str, Callable[..., Any], list[torch.Tensor], Any]],
                       log: Callable[[str], None], *, warmup: int = WARMUP,
                       iterations: int = ITERATIONS) -> list[dict[str, Any]]:  # fmt: skip
    """Every candidate (its name, run, inputs and plan) measured in turn (:func:`measure_run`),
    with what its plan predicted (:func:`plan_fields`), each logged as it finishes."""
    measured = []
    for name, run, inputs, plan in candidates:
        done = {**measure_run(name, run, inputs, warmup=warmup, iterations=iterations), **plan_fields(plan)}
        outcome = done["error"] if "error" in done else f"ran {done['iteration_ms']:.1f} ms"
        peak = done.get("peak_bytes")
        log(f"measured choice: {name} {outcome}" + (f", peak {peak / 2**20:,.0f} MiB" if peak is not None else ""))
        measured.append(done)
    return measured


def choose_measured(measured: list[dict[str, Any]], budget_bytes: int, tolerance: float = TOLERANCE) -> int | None:
    """The index of the candidate to keep: of those that ran (no ``error``), the fastest whose
    measured peak is at most ``tolerance`` over the budget (none measured a peak, as on the CPU:
    all count), else the one of the lowest peak; of equal times, the later (the recompute-only plan
    comes last). None when none ran."""
    ran = [i for i, m in enumerate(measured) if "error" not in m]
    fits = [i for i in ran if measured[i]["peak_bytes"] is None
            or measured[i]["peak_bytes"] <= (1 + tolerance) * budget_bytes]  # fmt: skip
    if not fits:
        return min(ran, key=lambda i: measured[i]["peak_bytes"]) if ran else None
    return min(reversed(fits), key=lambda i: measured[i]["iteration_ms"])


class ChoiceFailed(RuntimeError):
    """Neither candidate of a measured choice could be measured (both ran out of memory)."""


def measured_choice(manager: PassManager, lowered: CapturedGraph, original: Graph, first: Calibrated,
                    compile_graph: Callable[[Graph], CompiledStep], calibrate: int | None, out_dir: Path | None,
                    log: Callable[[str], None],
                    held_ratio: float | None = None) -> tuple[Calibrated, dict[str, Any]]:  # fmt: skip
    """Weigh ``first`` (the swap pipeline's result, compiled and calibrated if asked) against the
    recompute-only plan of ``original`` at the same budget, compiled by ``compile_graph`` and
    calibrated alike (its first plan aimed as the first's was, with ``held_ratio``: what the plan
    cache kept of this graph's steps; :func:`~.peak_calibration.plan_first_at_window`);
    measure both and return the kept one with what was measured. When recompute
    only is kept, its passes run again into ``out_dir``, so that plan.json, clones.json and later
    passes' files describe it; select-swap's swap_plan.json stays beside them (the returned
    description says which was kept). Raises :class:`ChoiceFailed` when neither could run."""
    swap_plan = first.ctx.artifacts.get("swap-plan")
    if swap_plan is None or not swap_plan.of("swap"):
        log("measured choice: select-swap's plan swaps nothing, so it is recompute only already; nothing to weigh")
        return first, {"skipped": "select-swap's plan swaps nothing: it is recompute only already"}
    target = first.calibration.target_bytes if first.calibration is not None else swap_plan.budget_bytes
    planning = PassManager(recompute_only_passes(manager.passes), manager.instrumentation)
    keep_grads = bool(first.ctx.services.get("keep_grads", False))

    def plan(budget_bytes: int, folder: Path | None, asked: int | None = None) -> tuple[Graph, Any] | None:
        graph = original.copy()
        ctx = pass_context(lowered, Budget(bytes=budget_bytes), out_dir=folder, log=log, keep_grads=keep_grads)
        ctx.services.update(backend_services(first.compiled.backend))
        if asked is not None:  # a plan over the aim but within the target is kept, as the first plan's
            ctx.services[ASKED_BUDGET] = asked
        ctx.artifacts["profile"] = first.ctx.artifacts["profile"]
        try:
            planning.run(graph, ctx)
        except PipelineFailure as failure:
            log(f"measured choice: no recompute-only plan: {str(failure).splitlines()[0]}; select-swap's plan stands")
            return None
        return graph, ctx

    # Planned where the first plan was (plan_first_at_window): a plan for the target itself simulates
    # at the top of the window, and its step holds over it (under a limit, it runs out of memory).
    aimed = bool(calibrate) and first.calibration is not None and first.ctx.services.get("device_memory") is not None
    aim = first_plan_aim(target, held_ratio) if aimed else target
    # Planned without writing files: select-swap's are in out_dir; the kept plan's are written below.
    planned = plan(aim, None, target if aim != target else None)
    if planned is None:
        return first, {"skipped": "no recompute-only plan reaches the budget"}
    other = Calibrated(planned[0], compile_graph(planned[0]), planned[1])
    if calibrate:
        other = calibrated_step(calibrate, planning, lowered, original, other, compile_graph, None, log)
    candidates = [(SWAP_AND_RECOMPUTE, first, swap_plan), (RECOMPUTE_ONLY, other, other.ctx.artifacts["plan"])]
    measured = measure_candidates([(name, made.compiled.run, lowered.inputs, made_plan)
                                   for name, made, made_plan in candidates], log)  # fmt: skip
    kept = choose_measured(measured, target)
    if kept is None:
        raise ChoiceFailed("neither select-swap's plan nor the recompute-only plan could be measured: both ran out of "
                           "memory; plan for a lower budget")  # fmt: skip
    log(f"measured choice: kept {candidates[kept][0]}")
    choice = {"kept": candidates[kept][0], "budget_bytes": target, "warmup": WARMUP, "iterations": ITERATIONS,
              "candidates": measured}  # fmt: skip
    made = candidates[kept][1]
    if made is other and out_dir is not None:
        # The kept plan's passes again, writing their files over select-swap's (clones.json, and any
        # later pass's); swap_plan.json and swaps.json stay, describing the plan weighed and not kept.
        rewritten = plan(other.ctx.artifacts["plan"].budget_bytes, out_dir, other.ctx.services.get(ASKED_BUDGET))
        if rewritten is not None:
            made = Calibrated(made.graph, made.compiled, rewritten[1], made.calibration)
    return made, choice
