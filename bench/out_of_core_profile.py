"""Validate the out-of-core profiler on the GPU (issue 38), writing one JSON.

``compare``: on a workload that fits, profile the captured step in memory and out of core (at
most ``--share`` of the iteration's own values on the device) in one process, and compare the
two profiles node by node, each one's prediction of the iteration (its nodes' times summed)
with the measured iteration, and the memory the out-of-core profile held (device peak) with its
limit.

Run it where mutwo is installed (``make`` sets up .venv; on the GPU machine, ``. bench/gpu_env.sh``).

``capped``: as a user whose step does not fit: cap the process (``memory_limit``), then
``mutwo.optimize`` at a budget in bytes and train; records which way it profiled, planning
time (calibration of what the process holds included: on by default on CUDA), its rounds, and
max allocated and max reserved over steady steps against the budget and the limit, or the error.

    python3 bench/out_of_core_profile.py compare --config examples/bert.yaml --batch-size 32 --out o.json
    python3 bench/out_of_core_profile.py capped --config examples/bert.yaml --batch-size 64 \\
        --memory-limit 24GiB --budget 14426MiB --out c.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

import mutwo
from mutwo.ir.budget import parse_bytes
from mutwo.ir.memory import simulate
from mutwo.runtime.measurement.device_memory import apply_memory_limit
from mutwo.runtime.measurement.expandable_segments import expandable_segments_on
from mutwo.runtime.measurement.profiler import Profile, profile_graph
from mutwo.runtime.planning.captured import capture_graph
from mutwo.runtime.planning.step_planning import DEFAULT_PASSES
from mutwo.tools.experiment_measure import build_training

MIB = 2**20


def _gpu() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def _node_agreement(reference: Profile, other: Profile) -> dict[str, Any]:
    """How the out-of-core node times compare with the in-memory ones (nodes over 10 µs in memory)."""
    ratios = sorted(other.nodes[i].seconds / p.seconds for i, p in reference.nodes.items()
                    if p.seconds > 1e-5 and i in other.nodes)  # fmt: skip
    errors = sorted(abs(r - 1) for r in ratios)
    weighted = sum(abs(other.nodes[i].seconds - p.seconds) for i, p in reference.nodes.items() if i in other.nodes)
    return {
        "nodes_compared": len(ratios), "median_ratio": statistics.median(ratios),
        "median_abs_error": statistics.median(errors), "p90_abs_error": errors[int(0.9 * (len(errors) - 1))],
        "time_weighted_abs_error": weighted / sum(p.seconds for p in reference.nodes.values()),
        "workspace_nodes_in_memory": sum(1 for p in reference.nodes.values() if p.workspace),
        "workspace_nodes_out_of_core": sum(1 for p in other.nodes.values() if p.workspace),
        "max_workspace_mib": [max((p.workspace for p in reference.nodes.values()), default=0) / MIB,
                              max((p.workspace for p in other.nodes.values()), default=0) / MIB],
    }  # fmt: skip


def compare(args: argparse.Namespace) -> dict[str, Any]:
    training = build_training(args.config, args.batch_size, device=args.device)
    lowered = capture_graph(training.model, training.optimizer, training.batch, training.loss_fn, training.options)
    simulation = simulate(lowered.graph)
    values = simulation.peak_bytes - simulation.persistent_bytes
    limit = int(values * args.share)
    row: dict[str, Any] = {"config": args.config, "batch_size": args.batch_size, "gpu": _gpu(),
                           "torch": torch.__version__, "nodes": len(lowered.graph.nodes),
                           "simulated_peak_mib": simulation.peak_bytes / MIB,
                           "persistent_mib": simulation.persistent_bytes / MIB, "limit_mib": limit / MIB}  # fmt: skip
    profiles = {}
    # Out of core, each node's GPU work is timed alone (isolate): compared with the in-memory profile
    # timed the same way; the plain in-memory profile and whole iterations say what the sum misses.
    for name, device_limit, isolate in (("in_memory", None, False), ("in_memory_isolated", None, True),
                                        ("out_of_core", limit, True)):  # fmt: skip
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        begin = time.perf_counter()
        profile = profile_graph(lowered.graph, lowered.inputs, runs=args.runs, warmup=1, contention=False,
                                isolate=isolate, device_limit=device_limit, iteration_runs=5 if name == "in_memory"
                                else 0)  # fmt: skip
        row[f"{name}_profile_seconds"] = time.perf_counter() - begin
        row[f"{name}_nodes_summed_ms"] = sum(p.seconds for p in profile.nodes.values()) * 1e3
        peaks = [p.peak for p in profile.nodes.values() if p.peak is not None]
        row[f"{name}_device_peak_mib"] = ((profile.meta["out_of_core"]["device_peak_bytes"] or 0) if device_limit
                                          else max(peaks, default=0)) / MIB  # fmt: skip
        profiles[name] = profile
        print(f"{name}: {row[f'{name}_profile_seconds']:.1f} s, device peak {row[f'{name}_device_peak_mib']:.0f} MiB, "
              f"nodes summed {row[f'{name}_nodes_summed_ms']:.1f} ms", flush=True)
    out_of_core = profiles["out_of_core"]
    iteration = profiles["in_memory"].iteration
    if iteration is not None:  # CUDA: whole iterations measured
        row["measured_iteration_ms"] = iteration.seconds * 1e3
        row["measured_iteration_peak_mib"] = (iteration.peak_bytes or 0) / MIB
    row["out_of_core"] = out_of_core.meta["out_of_core"]
    row["agreement_with_isolated"] = _node_agreement(profiles["in_memory_isolated"], out_of_core)
    row["agreement_with_plain"] = _node_agreement(profiles["in_memory"], out_of_core)
    largest_workspace = max((p.workspace for p in out_of_core.nodes.values()), default=0)
    row["held_within_limit"] = bool(torch.cuda.is_available()) and row["out_of_core_device_peak_mib"] * MIB <= (
        torch.cuda.memory_allocated() + max(limit, row["out_of_core"]["largest_node_bytes"]) + largest_workspace)
    return row


def capped(args: argparse.Namespace) -> dict[str, Any]:
    row: dict[str, Any] = {"config": args.config, "batch_size": args.batch_size, "memory_limit": args.memory_limit,
                           "budget": args.budget, "backend": args.backend, "passes": args.passes, "gpu": _gpu(),
                           "torch": torch.__version__}  # fmt: skip
    try:
        # Capped before anything is built, as on a card of that size.
        apply_memory_limit(torch.device(args.device), parse_bytes(args.memory_limit))
        training = build_training(args.config, args.batch_size, device=args.device)
        begin = time.perf_counter()
        step = mutwo.optimize(training.model, training.optimizer, training.batch, training.loss_fn,
                              budget=args.budget, backend=args.backend, memory_limit=args.memory_limit,
                              passes=args.passes, verbose=True)  # fmt: skip
        row["planning_seconds"] = time.perf_counter() - begin
        # Since a2b5206 mutwo turns expandable segments on itself unless the allocator is configured.
        row["expandable_segments"] = expandable_segments_on()
        row["setup_seconds"] = step.setup_seconds
        for _ in range(args.warmup):
            step(training.batch)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            step(training.batch)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        row.update(step_ms=statistics.median(times) * 1e3, max_allocated_mib=torch.cuda.max_memory_allocated() / MIB,
                   max_reserved_mib=torch.cuda.max_memory_reserved() / MIB, steps=len(times))  # fmt: skip
        budget_mib = parse_bytes(args.budget) / MIB
        row.update(budget_mib=budget_mib, reserved_within_budget=row["max_reserved_mib"] <= budget_mib,
                   reserved_within_limit=row["max_reserved_mib"] <= parse_bytes(args.memory_limit) / MIB)
        optimized = step.last
        if optimized is not None and optimized.calibration is not None:
            row["calibration"] = optimized.calibration.describe()
        if optimized is not None:
            profile = optimized.context.artifacts.get("profile")
            row["profiled_out_of_core"] = bool(profile is not None and profile.meta.get("out_of_core"))
    except Exception as error:  # the row records the failure: that is what this run is for
        row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:400]}"
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("compare", "capped"):
        command = sub.add_parser(name)
        command.add_argument("--device", default="cuda")
        command.add_argument("--config", required=True)
        command.add_argument("--batch-size", type=int, required=True)
        command.add_argument("--out", required=True)
    sub.choices["compare"].add_argument("--share", type=float, default=0.4)
    sub.choices["compare"].add_argument("--runs", type=int, default=3)
    sub.choices["capped"].add_argument("--memory-limit", required=True)
    sub.choices["capped"].add_argument("--budget", required=True)
    sub.choices["capped"].add_argument("--backend", default="eager")
    sub.choices["capped"].add_argument("--passes", default=DEFAULT_PASSES)
    sub.choices["capped"].add_argument("--warmup", type=int, default=3)
    sub.choices["capped"].add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    row = compare(args) if args.command == "compare" else capped(args)
    Path(args.out).write_text(json.dumps(row, indent=2) + "\n")
    print(json.dumps(row, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
