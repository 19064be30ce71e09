"""The ``profile`` analysis: per-node time and memory measured on the machine."""

from __future__ import annotations

import csv
import inspect
import io
from dataclasses import dataclass
from typing import Any

from mutwo.ir.budget import readable_bytes
from mutwo.ir.graph import Graph
from mutwo.ir.liveness import Liveness, elapsed_seconds, idle_seconds
from mutwo.ir.op_signature import pool_times
from mutwo.ir.pass_base import Pass, PassContext, PassFailure, option, write_atomic
from mutwo.passes.liveness import liveness_of


def node_table(graph: Graph, profile: Any) -> str:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["id", "name", "op", "kind", "phase", "owned_bytes", "seconds", "allocated_before",
                     "allocated_after", "peak", "workspace"])  # fmt: skip
    for node in graph:
        p = profile.nodes.get(node.id)
        writer.writerow([node.id, node.name, node.op_name, node.kind.value, node.phase.value, node.owned_bytes,
                         p.seconds if p else "", p.allocated_before if p else "", p.allocated_after if p else "",
                         p.peak if p else "", p.workspace if p else ""])  # fmt: skip
    return out.getvalue()


def activation_table(graph: Graph, profile: Any, liveness: Liveness) -> str:
    """Activations with their size, lifetime, inactive time and the time to recompute their producer."""
    elapsed = elapsed_seconds(graph, profile.seconds)
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["storage", "producer", "op", "bytes", "created", "last_forward_use", "first_backward_use",
                     "lifetime_nodes", "inactive_seconds", "recompute_seconds_estimate"])  # fmt: skip
    for record in sorted(liveness.activations(), key=lambda r: -r.bytes):
        producer = graph.node(record.key.creator)
        writer.writerow([str(record.key), producer.name, producer.op_name, record.bytes, record.created,
                         record.last_forward_use, record.first_backward_use, record.last_use - record.created,
                         f"{idle_seconds(record, elapsed):.6g}", f"{profile.seconds(producer.id):.6g}"])  # fmt: skip
    return out.getvalue()


@dataclass(frozen=True)
class ProfilePass(Pass):
    """Measure every node's time and memory on the machine (median of runs after warm-up).

    On CUDA: CUDA events per node, allocated bytes before and after and the peak inside each op
    (its workspace); whole iterations are timed separately without per-node synchronisation. On
    CPU: wall-clock per node, memory from the simulator. On CUDA, when a pass of the pipeline
    prices copies (select-swap), it also measures how much host-device copies in flight slow the
    iteration (``contention``, :mod:`mutwo.runtime.measurement.copy_contention`); other pipelines skip those
    iterations. With ``pool`` (the default), nodes doing
    the same work (same op, operand shapes and dtypes, views and arguments: the repeated blocks of
    a network) get the median of their times, so that the plan does not follow one node's noise
    (:mod:`mutwo.ir.op_signature`). Writes profile.json, nodes.csv and activations.csv;
    ``mutwo-opt --profile-from profile.json`` reloads it.
    """

    name = "profile"
    provides = ("profile",)
    runs: int = option(3, "measured runs per node (the median is kept)")
    warmup: int = option(1, "runs discarded before measuring")
    isolate: bool = option(False, "CUDA: spin the GPU before each node so its time is its kernels' alone, not the "
                                  "host's launch time (which a view or a small op otherwise measures)")  # fmt: skip
    contention: bool | None = option(
        None, "CUDA: also time whole iterations with host-device copies in flight, to price select-swap's copies "
              "beside compute on this graph (a few iterations); default: when a pass of the pipeline prices copies")
    pool: bool = option(True, "give nodes doing the same work (op, operand shapes, views, arguments) the median of "
                              "their times, so repeated blocks are priced alike")  # fmt: skip
    out_of_core: bool | None = option(
        None, "run each node with only what it reads on the device, the rest of the iteration's values in host "
              "memory (docs/out-of-core.md); default: when the unoptimized step would not fit under the budget in "
              "bytes, the memory limit or the device")

    def __post_init__(self) -> None:
        if self.runs < 1 or self.warmup < 0:
            raise ValueError("runs must be at least 1 and warmup at least 0")

    def run(self, graph: Graph, ctx: PassContext) -> Any:
        profiler = ctx.services.get("profiler")
        if profiler is None:
            raise PassFailure("profile needs the runtime's profiler; run it through mutwo-opt or put one in "
                              "ctx.services['profiler']")  # fmt: skip
        # Asked for only where set or where the service takes it: a profiler service of (graph,
        # runs, warmup) keeps working, and measures what it measures by default.
        contention = self.contention if self.contention is not None else "contention" in ctx.profile_needs
        asked: dict[str, bool] = {"isolate": True} if self.isolate else {}
        if self.contention is False or takes_keyword(profiler, "contention"):
            asked["contention"] = contention
        if self.out_of_core is not None:
            if not takes_keyword(profiler, "out_of_core"):
                raise PassFailure("profile{out_of_core=...} needs a profiler service that takes out_of_core; the "
                                  "runtime's does (mutwo-opt, mutwo.optimize)")  # fmt: skip
            asked["out_of_core"] = self.out_of_core
        profile = profiler(graph, runs=self.runs, warmup=self.warmup, **asked)
        pooling = pool_times(graph, profile.nodes) if self.pool else None
        # Recorded either way, so that a reused profile.json says which kind it is.
        profile.meta["pooled"] = pooling.to_json() if pooling is not None else False
        ctx.artifacts["profile"] = profile
        ctx.save_json("profile.json", profile.to_json())
        if ctx.out_dir is not None:
            write_atomic(ctx.out_dir / "nodes.csv", node_table(graph, profile))
            write_atomic(ctx.out_dir / "activations.csv", activation_table(graph, profile, liveness_of(graph, ctx)))
        out_of_core = profile.meta.get("out_of_core")
        if out_of_core:
            when = " when an earlier start measured it" if profile.meta.get("reused") else ""
            ctx.log(f"profile: out of core{when}, at most {readable_bytes(out_of_core['max_resident_bytes'])} of the "
                    f"step's values on the device at once; {readable_bytes(out_of_core['copied_to_device_bytes'])} "
                    "copied to it per run; the iteration's time is its nodes' summed")  # fmt: skip
        total = sum(p.seconds for p in profile.nodes.values())
        ctx.log(f"profile: {len(profile.nodes)} nodes, {total * 1e3:.1f} ms summed over nodes"
                + (f", iteration {profile.iteration.seconds * 1e3:.1f} ms" if profile.iteration else "")
                + (f"; {pooling.pooled_nodes} nodes pooled into {pooling.groups} groups of the same work"
                   if pooling is not None and pooling.groups else ""))  # fmt: skip
        unsteady = unsteady_runs(profile.meta.get("run_seconds", []))
        if unsteady:
            ctx.log(f"profile: warning: {unsteady}")
        return profile


def takes_keyword(function: Any, name: str) -> bool:
    """Whether ``function`` can be called with the keyword argument ``name`` (True when its
    signature cannot be read)."""
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return True
    return name in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


#: How far apart the fastest and slowest measured runs may be before the profile is called unsteady.
#: On a quiet machine they are within a few percent; on this project's loaded 2-core CI machine
#: per-op times were seen 3× apart, which changed which activations the plans recomputed.
UNSTEADY_RATIO = 1.5


def unsteady_runs(run_seconds: list[float]) -> str | None:
    """Why the measured runs (each one's node times summed) are too far apart to trust, or None."""
    if len(run_seconds) < 2 or min(run_seconds) <= 0:
        return None
    ratio = max(run_seconds) / min(run_seconds)
    if ratio <= UNSTEADY_RATIO:
        return None
    return (f"the measured runs took {min(run_seconds) * 1e3:.1f} to {max(run_seconds) * 1e3:.1f} ms ({ratio:.1f}× "
            "apart): the machine is busy or its clock unsteady, and the plan follows these times; profile on a "
            "quiet machine, or with more runs (profile{runs=7}) for steadier medians")  # fmt: skip
