"""The largest batch size whose optimized iteration fits a memory limit (``mutwo.fit_batch``,
``mutwo-opt --fit 16GiB``).

The search predicts, it does not run: for each batch size tried, the iteration is captured (over
fake tensors: nothing of that size is allocated) and the pipeline ``optimizer,select`` plans it
with the limit as its budget; the batch fits when the plan's simulated peak is within the limit.
Batch sizes double from the config's until one does not fit, then bisection finds the boundary.

What it assumes, and says in fit.json: the per-op times and workspaces that ``select`` weighs are
measured once, at the config's batch size, and scaled linearly with the batch size (the graph of
every batch size must have the same nodes; the search refuses otherwise). On a GPU the batch found
is then confirmed by one measured run of the optimized step, capped at the limit with
``torch.cuda.set_per_process_memory_fraction``; on a CPU there is nothing to measure against.
"""

from __future__ import annotations

import dataclasses
import gc
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from mutwo.ir import to_fx
from mutwo.ir.budget import Budget, BudgetError, parse_bytes
from mutwo.ir.graph import Graph
from mutwo.ir.pass_base import PassContext
from mutwo.ir.pass_manager import PassManager, PipelineFailure
from mutwo.ir.printer import fingerprint
from mutwo.ir.registry import PassRegistry
from mutwo.runtime.api import CapturedGraph, capture_graph, pass_context
from mutwo.runtime.capture import LossFn
from mutwo.runtime.profiler import Profile, device_bytes, measure_iterations, profile_graph

#: What the search plans each batch size with (the profile is given, scaled).
FIT_PIPELINE = "optimizer,select"
#: What the prediction rests on (the module docstring says it at length).
ASSUMPTIONS = ("per-op times and workspaces measured once at the profiled batch size and scaled linearly with the "
               "batch size; the peak is the simulator's, which a GPU run confirms for the batch found")
#: The largest batch size the search tries.
MAX_BATCH = 1 << 16


class FitError(ValueError):
    """No batch fits, graphs differ between batch sizes, or the measured peak exceeds the limit."""


@dataclass
class FitPoint:
    """One batch size tried: whether its optimized iteration fits, and the simulated peak."""

    batch_size: int
    fits: bool
    predicted_peak: int  #: the plan's simulated peak (0 when planning failed before simulating)
    note: str = ""  #: why it does not fit, or what the plan does


@dataclass
class FitResult:
    """The search: every batch size tried, the largest that fits, and its measured run (on a GPU)."""

    limit_bytes: int
    profiled_batch: int
    tried: list[FitPoint] = field(default_factory=list)
    best: FitPoint | None = None
    measured_peak: int | None = None
    measured_seconds: float | None = None
    measured_error: str = ""  #: the measured run's failure (out of memory under the cap)
    assumptions: str = ASSUMPTIONS

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def over_limit(self) -> str:
        """Why the measured run contradicts the prediction ('' when it fits or nothing was measured)."""
        if self.best is not None and self.measured_error:
            return f"batch {self.best.batch_size}: the measured run failed: {self.measured_error}"
        if self.measured_peak is None or self.measured_peak <= self.limit_bytes or self.best is None:
            return ""
        return (f"batch {self.best.batch_size}: the measured peak {self.measured_peak / 2**20:.1f} MiB exceeds the "
                f"limit {self.limit_bytes / 2**20:.1f} MiB: the simulator underestimated this model")  # fmt: skip


def search(predict: Callable[[int], FitPoint], start: int, limit_bytes: int, profiled_batch: int,
           max_batch: int = MAX_BATCH) -> FitResult:  # fmt: skip
    """The largest batch size in 1..max_batch for which ``predict`` says it fits (fitting is
    assumed monotone in the batch size): doubling from ``start``, then bisection until the gap to
    the smallest size that does not fit is at most 1/16 of the size found (each try is a capture
    and a plan: the last few percent are not worth their minutes on a large model)."""
    result = FitResult(limit_bytes, profiled_batch)
    cache: dict[int, FitPoint] = {}

    def fits(batch: int) -> bool:
        if batch not in cache:
            cache[batch] = predict(batch)
            result.tried.append(cache[batch])
        return cache[batch].fits

    low, high = 0, None  # low fits (0: none known), high does not
    batch = min(start, max_batch)
    while high is None:
        if fits(batch):
            low = batch
            if batch == max_batch:
                break
            batch = min(2 * batch, max_batch)
        else:
            high = batch
    if high is not None:
        while high - low > max(1, low // 16):
            middle = (low + high) // 2
            low, high = (middle, high) if fits(middle) else (low, middle)
    if low == 0:
        raise FitError(f"not even batch size 1 fits in {limit_bytes / 2**30:.2f} GiB: {cache[1].note}")
    result.best = cache[low]
    return result


def scaled_profile(profile: Profile, profiled: Graph, graph: Graph, factor: float) -> Profile:
    """``profile`` (measured on ``profiled``) for ``graph``, the same iteration at another batch
    size: node by node in execution order, times and workspaces multiplied by ``factor``."""
    if [n.op_name for n in profiled.nodes] != [n.op_name for n in graph.nodes]:
        raise FitError("the iteration's graph changes with the batch size (other ops, not just other shapes), so "
                       "the profile cannot be scaled; use mutwo-experiment to sweep batch sizes instead")  # fmt: skip
    nodes = {}
    for old, new in zip(profiled.nodes, graph.nodes, strict=True):
        if old.id in profile.nodes:
            measured = profile.nodes[old.id]
            nodes[new.id] = dataclasses.replace(measured, seconds=measured.seconds * factor,
                                                workspace=int(measured.workspace * factor))  # fmt: skip
    return Profile(profile.device, fingerprint(graph), nodes, profile.runs, None,
                   {**profile.meta, "scaled_from_batch_size": profiled.meta.get("batch_size"), "factor": factor})


def plan_at(lowered: CapturedGraph, profile: Profile, profiled: Graph, profiled_batch: int, batch: int,
            limit_bytes: int, final: str = "") -> tuple[FitPoint, Any]:  # fmt: skip
    """Plan ``lowered`` (captured at ``batch``) against the limit with the scaled profile; with
    ``final`` (more passes, such as ``rewrite``), the graph is rewritten too."""
    context = pass_context(lowered, Budget(bytes=limit_bytes))
    context.artifacts["profile"] = scaled_profile(profile, profiled, lowered.graph, batch / profiled_batch)
    pipeline = PassRegistry().build_pipeline(FIT_PIPELINE + final, {"profile"})
    try:
        PassManager(pipeline).run(lowered.graph, context)
    except PipelineFailure as failure:
        plan = context.artifacts.get("plan")
        return FitPoint(batch, False, plan.predicted_peak if plan is not None else 0, str(failure)), context
    plan = context.artifacts["plan"]
    return FitPoint(batch, True, plan.predicted_peak, f"{len(plan.entries)} activations recomputed"), context


def measure_capped(graph: Graph, inputs: list[torch.Tensor], device: torch.device,
                   limit_bytes: int) -> tuple[int, float]:  # fmt: skip
    """(peak bytes, seconds) of whole iterations of ``graph`` on CUDA, the process capped at the
    limit. The measurement runs on clones of the state (parameters, optimizer state), so the live
    originals, which a training process would not hold twice, are allowed on top of the limit;
    the peak it reports is the iteration's own, clones included."""
    gc.collect()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    allowed = limit_bytes + device_bytes(inputs, device)
    torch.cuda.set_per_process_memory_fraction(min(1.0, allowed / total), device)
    try:
        measured = measure_iterations(to_fx(graph), inputs, runs=3, warmup=1)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    assert measured.peak_bytes is not None
    return measured.peak_bytes, measured.seconds


def parse_limit(memory: str | int) -> int:
    """A memory limit in bytes, from bytes or text with a unit (``16GiB``)."""
    if isinstance(memory, int):
        return memory
    try:
        return parse_bytes(memory)
    except BudgetError as error:
        raise FitError(f"memory limit: {error}") from None


@dataclass
class Fitted:
    """A finished search: the result, and the batch found planned and rewritten, ready to run."""

    result: FitResult
    point: FitPoint
    lowered: CapturedGraph
    context: PassContext


def fit(capture_at: Callable[[int], CapturedGraph], start: int, limit_bytes: int,
        log: Callable[[str], None] = lambda message: None) -> Fitted:  # fmt: skip
    """Profile the iteration at ``start`` once, search (``capture_at(batch)`` captures it at a
    batch size), rewrite the batch found, and on a GPU measure it capped at the limit."""
    base = capture_at(start)
    log(f"fit: profiling batch size {start} once; other batch sizes scale its times linearly")
    try:
        profile = profile_graph(base.graph, base.inputs, runs=1, warmup=1)
    except torch.OutOfMemoryError:
        raise FitError(f"profiling batch size {start} ran out of memory (it runs unoptimized): start the search "
                       "from a smaller batch size") from None
    profiled = base.graph
    del base

    def predict(batch: int) -> FitPoint:
        point, _ = plan_at(capture_at(batch), profile, profiled, start, batch, limit_bytes)
        log(f"fit: batch {batch}: {'fits' if point.fits else 'does not fit'}, predicted peak "
            f"{point.predicted_peak / 2**20:.1f} MiB ({point.note.splitlines()[0] if point.note else ''})")
        return point

    result = search(predict, start, limit_bytes, start)
    assert result.best is not None
    batch = result.best.batch_size
    lowered = capture_at(batch)
    point, context = plan_at(lowered, profile, profiled, start, batch, limit_bytes, ",rewrite")
    if not point.fits:
        raise FitError(f"planning batch {batch} again failed: {point.note}")
    if lowered.device.type == "cuda":
        try:
            measured = measure_capped(lowered.graph, lowered.inputs, lowered.device, limit_bytes)
            result.measured_peak, result.measured_seconds = measured
        except torch.OutOfMemoryError:
            result.measured_error = "out of memory under the cap: the simulator underestimated this model"
    return Fitted(result, point, lowered, context)


def fit_batch(model: torch.nn.Module, optimizer: torch.optim.Optimizer, make_batch: Callable[[int], Any],
              loss_fn: LossFn, memory: str | int, *, start: int = 1, verbose: bool = False) -> FitResult:  # fmt: skip
    """The largest batch size whose optimized iteration fits in ``memory`` (``"16GiB"`` or bytes).

    ``make_batch(n)`` returns a batch of ``n`` samples on the training device. The iteration is
    profiled once at ``start`` and planned (optimizer passes and recomputation) at the batch sizes
    the search tries; see the module docstring for what the prediction assumes. On a GPU the batch
    found is measured once, capped at ``memory``: :class:`FitError` if it does not fit after all.
    """
    log = (lambda message: print(message, file=sys.stderr)) if verbose else (lambda message: None)
    fitted = fit(lambda n: capture_graph(model, optimizer, make_batch(n), loss_fn), start, parse_limit(memory), log)
    if fitted.result.over_limit():
        raise FitError(fitted.result.over_limit())
    return fitted.result
