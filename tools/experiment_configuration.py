"""One configuration of ``mutwo-experiment`` (a batch size and a variant), run in this process.

:func:`run_configuration` builds the config's training step
(:mod:`mutwo.tools.experiment_measure`), plans mutwo's step for the ``none`` and budget variants
(:mod:`mutwo.tools.experiment_planning`) and measures it, returning one row of ``results.json``.
``mutwo-experiment``'s worker processes and ``bench/compare.py``'s run one configuration each.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from mutwo.runtime.measurement.device_memory import free_planning_leftovers
from mutwo.tools.experiment_measure import OUT_OF_MEMORY, build_training, measure_after_planning
from mutwo.tools.experiment_planning import PlanChoice, planned_step


def run_configuration(config_path: str | Path, batch_size: int, variant: Any, out: Path, *, device: str | None = None,
                      memory_limit: int | None = None, warmup: int = 3, iterations: int = 10,
                      precision: str | None = None,
                      log: Callable[[str], None] = lambda message: None,
                      optimizer_passes: bool = False, swap: bool = False,
                      backend: str = "eager", trace: Path | None = None,
                      isolate_profile: bool = False, calibrate_peak: int = 0, measure_choice: bool = False,
                      before_measuring: Callable[[], None] | None = None,
                      device_lock: Path | None = None, reuse_profile: bool = False) -> dict[str, Any]:  # fmt: skip
    """Build, plan (for mutwo variants) and measure one configuration in this process.

    ``variant``: ``eager``, ``none`` (mutwo's captured step; profiles it and writes
    ``out/b<batch>/profile.json``) or a budget, as text or a :class:`Budget` (select and rewrite,
    with that profile when there is one). ``optimizer_passes``: run optimizer-in-backward and
    foreach-buckets (the ``optimizer`` alias) after the profile, before select. ``swap``: plan
    with select-swap and insert-swap (keep, recompute or swap each activation) instead.
    ``backend``: what runs the planned graph (compiled as part of planning; for CUDA graphs the
    config's optimizer is captured in its capturable form, its step counts and learning rates on
    the GPU: :mod:`mutwo.runtime.capture.optim`). ``trace``: after measuring, profile
    3 more iterations on the GPU, write their Chrome trace there and add the per-stream summary
    (:mod:`mutwo.tools.stream_trace`) under ``streams``. ``isolate_profile``: profile with
    ``profile{isolate=true}`` (each node's GPU time without the host's launch time).
    ``calibrate_peak``: with a compiled backend, up to that many re-plans until the compiled
    step's measured peak is within 3% of the budget (:mod:`mutwo.runtime.planning.peak_calibration`).
    ``measure_choice``: with ``swap`` and a compiled backend, when select-swap's plan swaps, also
    compile the recompute-only plan at its budget and keep whichever is measured faster, each
    measured alone after ``before_measuring`` (:class:`mutwo.tools.experiment_planning.PlanChoice`;
    the row's ``measured_choice`` says what each ran). ``device_lock``: a file whose lock
    calibration holds while it measures (:func:`mutwo.tools.experiment_measure.device_turn`), for
    processes planning side by side.
    ``reuse_profile``: a ``none`` run that reuses the saved profile (and copy model) as the budget
    runs do, instead of profiling and saving its own: the unplanned step under another backend,
    planned beside other processes, whose measurement anchors their predicted times
    (``bench/compare.py``).
    """
    from mutwo.ir.budget import parse_budget
    from mutwo.ir.pass_manager import PipelineFailure
    from mutwo.runtime.execution.backends import BackendError

    training = build_training(config_path, batch_size, device, precision)
    row: dict[str, Any] = {"batch_size": batch_size, "variant": variant, "precision": training.options.precision}
    try:
        if variant == "eager":
            step = training.eager_step()
        else:
            budget = variant if not isinstance(variant, str) else (None if variant == "none" else parse_budget(variant))
            step = planned_step(training, budget, out / f"b{batch_size}", row, log, optimizer_passes, swap,
                                backend, isolate_profile, calibrate_peak, measure_choice, device_lock,
                                reuse_profile)  # fmt: skip
    except torch.OutOfMemoryError:
        return {**row, "error": f"{OUT_OF_MEMORY} while planning"}
    except PipelineFailure as failure:  # an unreachable budget, say: a result, in one line
        message = str(failure).splitlines()[0]
        return {**row, "error": message, "error_kind": "unreachable" if "unreachable" in message else "pass failed"}
    except BackendError as refused:  # a backend that cannot run this step: a result too
        return {**row, "error": str(refused), "error_kind": "backend"}
    if before_measuring is not None:
        before_measuring()
    if isinstance(step, PlanChoice):
        free_planning_leftovers(training.device)  # as before any row's measurement
        resolved = step.resolve(row, log, warmup=warmup, iterations=iterations)
        if resolved is None:
            return {**row, "error": f"{OUT_OF_MEMORY} while measuring both plans of the measured choice"}
        step = resolved
    log(f"measuring batch {batch_size}, {variant}")
    row.update(measure_after_planning(step, training.device, memory_limit, warmup=warmup, iterations=iterations,
                                      trace=trace, planned=variant != "eager"))  # fmt: skip
    return row
