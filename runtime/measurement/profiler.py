"""Measuring a graph on the machine: per-node time and memory, and whole iterations.

Per node, an ``fx.Interpreter`` runs the lowered graph one node at a time. On CUDA, each node is
bracketed by CUDA events (no synchronisation between nodes, which would inflate times) and the
caching allocator's statistics, read on the host, give the bytes allocated before and after the
node and the peak inside it; the transient workspace is that peak minus what is allocated after.
On CPU, nodes are timed with the wall clock and memory comes from the simulator. Whole
iterations are timed separately, through the generated code, without per-node instrumentation.

Everything runs on clones of the inputs, so profiling never trains the real model; out of core
(:mod:`mutwo.runtime.measurement.out_of_core`), on the inputs themselves, restored from snapshots
after each run.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import fx

from mutwo.ir.graph import Graph
from mutwo.ir.printer import fingerprint
from mutwo.ir.replay import batch_norm_from_stats, training_batch_norm_stats
from mutwo.ir.to_fx import NODE_ID_META, to_fx
from mutwo.runtime.measurement.copy_contention import measure_copy_contention
from mutwo.runtime.measurement.iterations import IterationMeasurement, device_of, measure_iterations
from mutwo.runtime.measurement.out_of_core import GraphFacts, OutOfCore, Residency, TrackedEnv


@dataclass
class NodeProfile:
    """Measurements of one node (median over runs); memory fields are None on CPU."""

    seconds: float
    allocated_before: int | None = None
    allocated_after: int | None = None
    peak: int | None = None
    workspace: int = 0
    #: a training batch norm's replay from its saved statistics (what a recompute clone of it costs)
    replay_seconds: float | None = None


@dataclass
class Profile:
    device: str
    fingerprint: str  #: of the graph it was measured on; a reloaded profile must match
    nodes: dict[int, NodeProfile]
    runs: int
    iteration: IterationMeasurement | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def seconds(self, node_id: int) -> float:
        profile = self.nodes.get(node_id)
        return profile.seconds if profile is not None else 0.0

    def replay_seconds(self, node_id: int) -> float:
        """What a clone replaying the node costs: its measured replay where the profiler timed
        one (batch norms replayed from their statistics), else the node's own time."""
        profile = self.nodes.get(node_id)
        if profile is None:
            return 0.0
        return profile.replay_seconds if profile.replay_seconds is not None else profile.seconds

    def iteration_seconds(self) -> float:
        """The whole iteration: measured where it was (CUDA), else the nodes' times summed."""
        return self.iteration.seconds if self.iteration else sum(p.seconds for p in self.nodes.values())

    def workspace(self) -> dict[int, int]:
        return {node_id: p.workspace for node_id, p in self.nodes.items() if p.workspace}

    def to_json(self) -> dict[str, Any]:
        return {
            "device": self.device, "fingerprint": self.fingerprint, "runs": self.runs, "meta": self.meta,
            "iteration": asdict(self.iteration) if self.iteration else None,
            "nodes": {str(node_id): asdict(p) for node_id, p in sorted(self.nodes.items())},
        }  # fmt: skip

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Profile:
        iteration = data.get("iteration")
        return cls(
            device=data["device"], fingerprint=data["fingerprint"], runs=data["runs"], meta=data.get("meta", {}),
            iteration=IterationMeasurement(**iteration) if iteration else None,
            nodes={int(k): NodeProfile(**v) for k, v in data["nodes"].items()},
        )  # fmt: skip


#: How long the GPU spins before each op when the profile isolates ops' GPU time: longer than the
#: host needs to launch a typical op through the profiling interpreter (20-45 µs for a view on the
#: H100's host), so the op is queued before the GPU reaches its start event.
ISOLATION_SPIN_SECONDS = 200e-6


def spin_cycles(device: torch.device, seconds: float = ISOLATION_SPIN_SECONDS) -> int:
    """GPU clock cycles of ``torch.cuda._sleep`` that last about ``seconds`` on ``device``."""
    probe = 1_000_000
    with torch.cuda.device(device):
        torch.cuda._sleep(probe)  # warm up: the first launch pays for loading the kernel
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(probe)
        end.record()
        end.synchronize()
    return max(1, int(probe * seconds / (start.elapsed_time(end) / 1e3)))


class _TimingInterpreter(fx.Interpreter):
    """Runs the graph recording each node's time (CUDA events, or the wall clock on CPU) and memory.

    With ``spin`` (CUDA), the GPU first spins that many cycles before each node's start event, so
    that the host has queued the node's kernels before the GPU reaches it: the elapsed time is then
    the GPU's work alone. Without it, a node whose kernels are shorter than the host's launch time
    (a view, a small elementwise op) measures the host's time between the two events.
    """

    def __init__(self, module: fx.GraphModule, cuda: bool, graph: Graph, spin: int = 0) -> None:
        super().__init__(module, garbage_collect_values=True)
        self.cuda = cuda
        self.ir = graph
        self.spin = spin
        self.records: list[tuple[int, Any, Any, int | None, int | None, int | None]] = []
        self.replays: list[tuple[int, Any, Any]] = []

    def _mark(self) -> Any:
        """A point in time: a recorded CUDA event (no synchronisation), or the wall clock on CPU."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _start(self) -> Any:
        """The start of a timed op: after the spin, when isolating, so the op is queued before it."""
        if self.spin:
            torch.cuda._sleep(self.spin)
        return self._mark()

    def run_node(self, n: fx.Node) -> Any:
        if n.op in ("placeholder", "output"):
            return super().run_node(n)
        node_id = n.meta[NODE_ID_META]
        if self.cuda:
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            start = self._start()
            result = super().run_node(n)
            end = self._mark()
            self.records.append((node_id, start, end, before, torch.cuda.memory_allocated(),
                                 torch.cuda.max_memory_allocated()))  # fmt: skip
        else:
            start = self._mark()
            result = super().run_node(n)
            self.records.append((node_id, start, self._mark(), None, None, None))
        stats = training_batch_norm_stats(self.ir.node(node_id))
        if stats is not None:
            self._time_replay(node_id, n, result, stats)
        return result

    def _time_replay(self, node_id: int, n: fx.Node, result: Any, stats: tuple[int, int]) -> None:
        """Time the batch norm's replay from the statistics it just saved (after its own record,
        so its memory figures stay the node's own)."""
        operands = [self.env[a] if isinstance(a, fx.Node) else a for a in n.args[:3]]
        start = self._start()
        batch_norm_from_stats(*operands, result[stats[0]], result[stats[1]])
        end = self._mark()
        self.replays.append((node_id, start, end))


class _OutOfCoreTimingInterpreter(OutOfCore, _TimingInterpreter):
    """The timing interpreter out of core: the copies happen before a node's timed events."""

    def __init__(self, module: fx.GraphModule, cuda: bool, graph: Graph, spin: int, residency: Residency) -> None:
        _TimingInterpreter.__init__(self, module, cuda, graph, spin)
        self.residency = residency
        self.facts = GraphFacts(graph, module)


def profile_graph(
    graph: Graph,
    inputs: list[torch.Tensor],
    *,
    runs: int = 3,
    warmup: int = 1,
    iteration_runs: int = 5,
    progress: Callable[[str], None] | None = None,
    isolate: bool = False,
    contention: bool = True,
    device_limit: int | None = None,
) -> Profile:
    """Measure every node of ``graph`` (median of ``runs`` after ``warmup``) and whole iterations.

    ``isolate`` (CUDA): time each node's GPU work without the host's launch time
    (:class:`_TimingInterpreter`); it has no effect on CPU, where the wall clock is the op's time.
    ``contention`` (CUDA, with ``iteration_runs``): also how much host-device copies in flight slow
    the iteration (:mod:`mutwo.runtime.measurement.copy_contention`), in ``meta["copy_contention"]``.
    ``device_limit``: run out of core, with at most that many bytes of the iteration's values on
    the device (:mod:`mutwo.runtime.measurement.out_of_core`), each node's GPU work timed alone as
    with ``isolate``; whole iterations, which would need them all, are then not run: the
    profile's iteration time is its nodes' times summed, and ``meta["out_of_core"]`` says what was
    held and copied."""
    if runs < 1:
        raise ValueError("profile needs at least one measured run")
    module = to_fx(graph)
    device = device_of(inputs)
    cuda = device.type == "cuda"
    # Out of core, the copies before a node leave the GPU idle, so its start event would time the
    # host's launch too: its GPU work is timed alone, as ``isolate`` does.
    spin = spin_cycles(device) if cuda and (isolate or device_limit is not None) else 0
    residency = Residency(device, device_limit, list(module.graph.nodes)) if device_limit is not None else None
    state = residency.adopt_inputs(inputs) if residency is not None else [t.clone() for t in inputs]
    if residency is not None and cuda:
        torch.cuda.reset_peak_memory_stats(device)
    samples: dict[int, list[float]] = {}
    replay_samples: dict[int, list[float]] = {}
    memory: dict[int, tuple[int, int, int]] = {}
    run_seconds: list[float] = []  #: each measured run's node times summed: how steady the machine was
    for run in range(warmup + runs):
        if residency is None:
            interpreter = _TimingInterpreter(module, cuda, graph, spin)
            with torch.no_grad():
                interpreter.run(*state)
        else:
            interpreter = _OutOfCoreTimingInterpreter(module, cuda, graph, spin, residency)
            try:
                with torch.no_grad():
                    interpreter.run(*state, initial_env=TrackedEnv(residency))
            finally:  # the inputs are the model's own: restored even when the run failed
                interpreter.env.release()  # what the run left (its outputs) leaves the device with it
                residency.finish()
        if cuda:
            torch.cuda.synchronize(device)
        if progress is not None:
            progress(f"profile run {run + 1}/{warmup + runs}{' (warm-up)' if run < warmup else ''}")
        if run < warmup:
            continue
        run_seconds.append(0.0)
        for node_id, start, end, before, after, peak in interpreter.records:
            samples.setdefault(node_id, []).append(_elapsed(start, end, cuda))
            run_seconds[-1] += samples[node_id][-1]
            if cuda:
                memory[node_id] = (before, after, peak)
        for node_id, start, end in interpreter.replays:
            replay_samples.setdefault(node_id, []).append(_elapsed(start, end, cuda))
    nodes: dict[int, NodeProfile] = {}
    for node_id, values in samples.items():
        profile = NodeProfile(statistics.median(values))
        if node_id in replay_samples:
            profile.replay_seconds = statistics.median(replay_samples[node_id])
        if node_id in memory:
            before, after, peak = memory[node_id]
            profile.allocated_before, profile.allocated_after, profile.peak = before, after, peak
            profile.workspace = max(0, peak - max(before, after))
        nodes[node_id] = profile
    del state
    # On CPU the node times already add up to the iteration; only CUDA needs whole-iteration runs
    # (launch gaps and the allocator show only there) and has a peak to measure. Out of core,
    # the whole iteration does not fit: its time is the nodes' summed.
    whole = iteration_runs and cuda and residency is None
    iteration = measure_iterations(module, inputs, runs=iteration_runs) if whole else None
    meta = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(device) if cuda else None,
            "isolated": bool(spin), "run_seconds": run_seconds}  # fmt: skip
    if residency is not None:
        # The allocator's peak inside each node (reset before it) is what the run held at most.
        device_peak = max((peak for _, _, peak in memory.values()), default=None)
        for profile in nodes.values():  # the allocator's totals held whatever was resident, not the iteration's
            profile.allocated_before = profile.allocated_after = profile.peak = None
        meta["out_of_core"] = {
            "device_limit_bytes": residency.limit, "max_resident_bytes": residency.max_resident_bytes,
            "largest_node_bytes": residency.largest_node_bytes,
            "copied_to_device_bytes": residency.copied_in // (warmup + runs),
            "copied_home_bytes": residency.copied_out // (warmup + runs),
            "device_peak_bytes": device_peak,
        }  # fmt: skip
    if contention and iteration is not None:
        meta["copy_contention"] = measure_copy_contention(module, inputs).to_json()
        if progress is not None:
            progress(f"profile: host-device copies in flight slow this iteration by "
                     f"{meta['copy_contention']['slowdown'] * 100:.1f}%")  # fmt: skip
    return Profile(str(device), fingerprint(graph), nodes, runs, iteration, meta=meta)


def _elapsed(start: Any, end: Any, cuda: bool) -> float:
    """Seconds between two CUDA events or two ``perf_counter`` readings."""
    return start.elapsed_time(end) / 1e3 if cuda else end - start
