"""What a ``mutwo-opt`` run writes into its output folder: the input and final graphs, the reports and
plots, and ``summary.json`` (what the run did, measured and wrote), and how it names those files."""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from pathlib import Path
from typing import Any, Protocol

import torch

from mutwo.ir import to_fx
from mutwo.ir.graph import Graph
from mutwo.ir.liveness import compute_liveness
from mutwo.ir.memory import simulate
from mutwo.ir.pass_base import PassContext, write_atomic
from mutwo.ir.pass_manager import PipelineResult
from mutwo.ir.printer import print_graph
from mutwo.ir.swap import swap_nodes
from mutwo.ir.time_model import TimeModel
from mutwo.ir.timeline import TransferModel, graph_timeline
from mutwo.runtime.execution.backends import CompiledStep
from mutwo.runtime.measurement.equivalence import EquivalenceReport
from mutwo.runtime.parallel.distributed import DataParallel
from mutwo.runtime.planning.peak_calibration import Calibration
from mutwo.runtime.planning.plan_cache import CachedPlanning
from mutwo.tools.config import Config
from mutwo.tools.reports import memory_timeline, swap_timeline, write_reports

#: The files named first when a run says what it wrote (the rest are counted).
MAIN_FILES = ("summary.json", "final.ir.txt", "final_graph.py", "plan.json", "swap_plan.json", "profile.json")


class RunState(Protocol):
    """What summary.json reads of the run beside its graphs (:class:`mutwo.tools.mutwo_opt.MutwoOpt`
    is one; named by shape, since the run imports this module)."""

    started: float  #: time.perf_counter() when the run began
    wall_started: float  #: time.time() from which a file counts as this run's
    calibration: Calibration[Any] | None
    choice: dict[str, Any] | None
    plan_cache: CachedPlanning  #: the plan cache's hit or miss
    dp: DataParallel | None
    gradient_buckets: list[list[str]]

    def rounded_phases(self) -> dict[str, float]: ...


def write_outputs(run: RunState, out: Path, config: Config, device: torch.device, original: Graph, final: Graph,
                  result: PipelineResult | None, report: EquivalenceReport | None, error: str | None,
                  ctx: PassContext, measured: dict[str, Any], compiled: CompiledStep | None) -> list[str]:  # fmt: skip
    """Write the output folder ``out`` of ``run``; returns the names of the files this run wrote.
    After a failed pipeline there is no final graph: summary.json records the error (and the plan
    that missed its budget), beside input.ir.txt and what the passes wrote before the failure."""
    write_atomic(out / "input.ir.txt", print_graph(original))
    profile = ctx.artifacts.get("profile")
    workspace = profile.workspace() if profile is not None else None
    before = simulate(original, workspace=workspace)
    title = f"{config.model.name}, batch {config.batch_size}, {device}"
    outcome: dict[str, Any]
    if error is None:
        outcome, reports = write_final(out, original, final, before, ctx, title)
    else:
        reports = []
        unmet = [plan.to_json() for plan in (ctx.artifacts.get(key) for key in ("plan", "swap-plan"))
                 if plan is not None and not plan.met]  # fmt: skip
        outcome = {"unmet_plan": unmet[0] if unmet else None}
    summary = {
        "model": config.model.name,
        "source": config.model.source,
        "config": str(config.path),
        "batch_size": config.batch_size,
        "device": str(device),
        # What else decides the numbers, so that a summary says how to run it again.
        "seed": config.seed,
        "precision": config.precision,
        "memory_format": config.memory_format,
        "budget": planned_budget(ctx, config),
        "torch_version": torch.__version__,
        "pipeline": [r.name for r in result.records] if result else [],
        "nodes_before": counts(original),
        "nodes_after": None,
        "pass_seconds": result.timings() if result else {},
        "total_seconds": round(time.perf_counter() - run.started, 3),
        "phase_seconds": run.rounded_phases(),
        "peak_bytes_before": before.peak_bytes,
        "peak_phase_before": before.peak_phase,
        "peak_breakdown_before": before.breakdown,
        "peak_bytes_after": None,
        "peak_node_after": None,
        "peak_phase_after": None,
        "peak_breakdown_after": None,
        "persistent_bytes": before.persistent_bytes,
        "measured_peak_bytes_before": measured.get("measured_peak_bytes_before"),
        "measured_peak_bytes_after": measured.get("measured_peak_bytes_after"),
        # what the process held: the allocator's reserved bytes, as the budget counts on CUDA
        "measured_held_bytes_before": measured.get("measured_held_bytes_before"),
        "measured_held_bytes_after": measured.get("measured_held_bytes_after"),
        "iteration_seconds_before": measured.get("iteration_seconds_before"),
        "iteration_seconds_after": measured.get("iteration_seconds_after"),
        "reports": reports,
        "recomputed": None,
        "plan_fingerprint": None,
        "swapped": None,
        "swapped_bytes": None,
        "cloned_nodes": None,
        "equivalent": None if report is None else report.equivalent,
        "error": error,
        **outcome,
        "data_parallel": describe_data_parallel(run.dp, run.gradient_buckets, config, run.sharded_blocks),
        # The simulator models the eager executor: one aten kernel per node, in the plan's order,
        # which the compiled backends keep (docs/backends.md); their peak is the measured one.
        "simulated_backend": "eager",
        **({"calibration": run.calibration.describe()} if run.calibration is not None else {}),
        **({"measured_choice": run.choice} if run.choice is not None else {}),
        "plan_cache": run.plan_cache.describe(),
        **(compiled.describe() if compiled is not None else {"backend": config.backend}),
    }
    # The folder is not emptied between runs: list what this run wrote.
    summary["files"] = sorted({p.name for p in out.iterdir() if p.is_file() and not p.name.startswith(".")
                               and p.stat().st_mtime >= run.wall_started} | {"summary.json"})  # fmt: skip
    write_atomic(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    return summary["files"]


def write_final(out: Path, original: Graph, final: Graph, before: Any, ctx: PassContext,
                title: str) -> tuple[dict[str, Any], list[str]]:  # fmt: skip
    """The final graph's files and reports; its entries of summary.json and the reports' names."""
    profile = ctx.artifacts.get("profile")
    after = simulate(final, workspace=profile.workspace() if profile is not None else None)
    final_liveness = compute_liveness(final)
    reports = write_reports(out, final, after, final_liveness, profile, title)
    if final is not original:
        memory_timeline(out / "memory_timeline_input.png", original, before, profile, f"{title} (input)")
        reports.append("memory_timeline_input.png")
    swaps = swap_nodes(final)
    if swaps and profile is not None and "transfer" in ctx.artifacts:
        swap_plan = ctx.artifacts.get("swap-plan")  # its copies priced as the plan priced them (contention)
        transfer = ctx.artifacts["transfer"] if swap_plan is None else TransferModel.from_json(swap_plan.transfer)
        timeline = graph_timeline(final, TimeModel.of(original, profile), transfer)
        swap_timeline(out / "swap_timeline.png", final, timeline, after, f"{title}: compute and copies")
        reports.append("swap_timeline.png")
    # Recomputed: activations of the input whose backward readers now read a clone instead
    # (swapped ones read the copy brought back from host memory).
    swapped = {offload.args[0].tensor.storage for offload, _, _ in swaps}
    recomputed = {r.key for r in compute_liveness(original).activations()} - {
        r.key for r in final_liveness.activations()} - swapped  # fmt: skip
    write_atomic(out / "final.ir.txt", print_graph(final))
    write_atomic(out / "final_graph.py", to_fx(final).code)
    return {
        "nodes_after": counts(final),
        "peak_bytes_after": after.peak_bytes,
        "peak_node_after": after.peak_node,
        "peak_phase_after": after.peak_phase,
        "peak_breakdown_after": after.breakdown,
        "persistent_bytes": after.persistent_bytes,
        "recomputed": len(recomputed),
        "plan_fingerprint": plan_fingerprint(recomputed, swapped),
        "swapped": len(swapped),
        "swapped_bytes": sum(offload.tensors[0].storage_bytes for offload, _, _ in swaps),
        "cloned_nodes": sum(1 for n in final if n.origin is not None),
    }, reports


def describe_data_parallel(dp: DataParallel | None, gradient_buckets: list[list[str]], config: Config,
                           sharded_blocks: list[str] | None = None) -> dict[str, Any] | None:  # fmt: skip
    """summary.json's data_parallel: the ranks, the global batch, how the model is held
    (``sharding``: ddp, or fsdp2 with the blocks ``fully_shard`` wrapped besides the model) and the
    gradient buckets (None outside torchrun)."""
    if dp is None:
        return None
    return {"world_size": dp.world_size, "backend": torch.distributed.get_backend(dp.group),
            "global_batch_size": config.batch_size * dp.world_size,
            "sharding": "ddp" if dp.sharded is None else "fsdp2", "sharded_blocks": sharded_blocks,
            "bucket_limits_bytes": list(dp.bucket_limits), "sync_buffers": dp.sync_buffers,
            "buckets": gradient_buckets}  # fmt: skip


def planned_budget(ctx: PassContext, config: Config) -> str | None:
    """The budget the run's plan was made for (a reused plan's, a pass option's), else the config's."""
    plan = ctx.artifacts.get("plan") or ctx.artifacts.get("swap-plan")
    if plan is not None:
        return str(plan.budget)
    return None if config.budget is None else str(config.budget)


def plan_fingerprint(recomputed: set[Any], swapped: set[Any]) -> str:
    """Which activations of the captured graph a run recomputes and which it swaps, hashed: two runs
    of one model and pipeline with the same fingerprint recompute and swap the same activations
    (how the clones are built and what other passes did is not in it; every plan that recomputes
    and swaps nothing has the same one). Plans made from two profiles may differ (per-node times
    move between profiles, docs/benchmarks.md, "Why one budget gives several plans");
    ``--profile-from`` reuses one profile and so one plan."""
    text = ";".join([",".join(sorted(map(str, recomputed))), ",".join(sorted(map(str, swapped)))])
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def describe_files(files: list[str]) -> str:
    """``12 files: summary.json, final.ir.txt, final_graph.py, plan.json and 8 more (listed in summary.json)``."""
    main_files = [name for name in MAIN_FILES if name in files]
    rest = len(files) - len(main_files)
    if len(files) <= 6:
        return f"{len(files)} files: " + ", ".join(main_files + [f for f in files if f not in main_files])
    return f"{len(files)} files: {', '.join(main_files)} and {rest} more (listed in summary.json)"


def counts(graph: Graph) -> dict[str, Any]:
    """summary.json's nodes_before and nodes_after: the graph's nodes in all, by phase and by kind."""
    return {"total": len(graph), "by_phase": dict(sorted(Counter(n.phase.value for n in graph).items())),
            "by_kind": dict(sorted(Counter(n.kind.value for n in graph).items()))}  # fmt: skip
