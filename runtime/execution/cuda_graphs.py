"""Replaying a whole training iteration as one CUDA graph.

The step is recorded once and replayed: one launch instead of thousands, no Python per kernel.
What makes that correct for a training step:

* parameters, buffers and optimizer state are the graph's own inputs, updated in place at fixed
  addresses: the recording reads and writes the live tensors, so a replay steps the real model
  (if one is replaced, e.g. by ``optimizer.load_state_dict``, the step is recorded again);
* the batch and the learning rates live in static buffers the graph reads; every call copies
  the new ones in before the replay;
* recording does not run kernels; a warm-up iteration on copies of the state runs first, on a
  side stream, so that cuBLAS/cuDNN initialisation and Inductor's autotuning happen outside the
  capture and the real state is stepped only by replays;
* random ops (dropout) draw from the default CUDA generator, which CUDA graphs support: each
  replay advances its offset as the eager step would;
* a plan that swaps records its copies on the swap runtime's streams, joined to the graph by
  events, into host buffers the recording takes out of the runtime's pool for as long as the graph
  lives; an offloaded tensor is freed at its release point (:mod:`mutwo.runtime.execution.swap_graphs`).

What cannot be recorded is refused before anything runs (:func:`refuse_uncapturable`): a step
on the CPU, inputs that live on the CPU (a learning rate given as a Python number, the step
count of a non-capturable Adam: kernels read them on the host at launch, so a graph would freeze
their values), and ops that read device values on the host.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx

from mutwo.runtime.execution.errors import BackendError
from mutwo.runtime.execution.swap import RUNTIME as SWAP_RUNTIME
from mutwo.runtime.measurement.iterations import values_kept_on_host

#: Ops that read device values on the host: a CUDA graph would record the value read at capture.
HOST_READS = ("aten._local_scalar_dense", "aten.item", "aten.nonzero", "aten.equal")
#: The ops of a traced torch.optim step that compute with host numbers at run time
#: (``mutwo::host_call*``, ``mutwo::host_scalar``, ``mutwo::foreach_host_call*``).
TRACED_HOST_OPS = ("mutwo.host_", "mutwo.foreach_host")


def refuse_uncapturable(module: fx.GraphModule, inputs: Sequence[torch.Tensor], labels: Sequence[str]) -> None:
    """Raise :class:`mutwo.runtime.execution.errors.BackendError` (one line) unless ``module`` can be
    recorded as a CUDA graph; ``labels[i]`` names input ``i`` in the message."""
    devices = {t.device for t in inputs if t.device.type != "cpu"}
    if not devices or any(d.type != "cuda" for d in devices):
        raise BackendError("CUDA graphs need the model, optimizer state and batch on a CUDA device; this step runs "
                           f"on {', '.join(sorted({str(t.device) for t in inputs}))}: use --backend eager or "
                           "inductor")  # fmt: skip
    on_host = [label for label, t in zip(labels, inputs, strict=True) if t.device.type == "cpu"]
    if on_host:
        raise BackendError(f"CUDA graphs cannot record a step that reads CPU tensors on the host ({len(on_host)}: "
                           f"{', '.join(on_host[:3])}{', ...' if len(on_host) > 3 else ''}): their values would be "
                           "frozen at recording; give the optimizer capturable=True and a learning rate as a CUDA "
                           "tensor, e.g. lr=torch.tensor(1e-3, device='cuda')")  # fmt: skip
    for node in module.graph.nodes:
        if node.op != "call_function":
            continue
        name = _op_name(node.target)
        if name.startswith(HOST_READS + TRACED_HOST_OPS):
            raise BackendError(f"CUDA graphs cannot record this step: node {node.name} ({name}) reads a tensor's "
                               "value on the host; use --backend eager or inductor")  # fmt: skip


def _op_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._opname}"
    return getattr(target, "__name__", str(target))


class CudaGraphRunner:
    """``run`` (the step, called with its flat inputs) recorded as a CUDA graph on the first call
    and replayed on every call after; ``kept[i]``: input ``i`` is state updated in place."""

    def __init__(self, run: Callable[..., Any], kept: Sequence[bool]) -> None:
        self.run = run
        self.kept = list(kept)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static: list[torch.Tensor] = []
        self.outputs: Any = None
        self.recordings = 0
        #: the recorded iteration's peak above what was allocated before it (its transients, which
        #: live in the graph's pool), and the allocator's absolute peak while recording: replays
        #: allocate nothing, so measurements of replays alone miss it (recording resets the peak)
        self.recorded_peak_bytes = 0
        self.recorded_peak_absolute = 0
        #: the swap runtime's host buffers the recording copies into and out of (none without swaps)
        self.host_buffers: list[torch.Tensor] = []

    def __call__(self, *flat: torch.Tensor) -> Any:
        if self.graph is None or any(kept and t.data_ptr() != s.data_ptr()
                                     for kept, t, s in zip(self.kept, flat, self.static, strict=True)):  # fmt: skip
            self.record(flat)
        for kept, new, static in zip(self.kept, flat, self.static, strict=True):
            if not kept:
                static.copy_(new)
        assert self.graph is not None
        self.graph.replay()
        # The loss is overwritten by the next replay: a copy keeps it for the caller (gradients
        # are returned as the graph's own buffers; docs/backends.md says so).
        loss, *rest = self.outputs
        return (loss.clone(), *rest)

    def release(self) -> None:
        """Drop the recording (its private pool goes back to the allocator, its host buffers to the
        swap runtime); the next call records again. Planning that measures one compiled step after
        another (peak calibration, a measured choice between plans) releases each after measuring
        it, so that no pool outlives its measurement and skews the next one's peak."""
        self.graph, self.outputs, self.static = None, None, []
        if self.host_buffers:  # the graph's replays have ended before its buffers go back to the pool
            torch.cuda.synchronize()
            SWAP_RUNTIME.buffers.restore(self.host_buffers)
            self.host_buffers = []

    def record(self, flat: Sequence[torch.Tensor]) -> None:
        """Warm up on the live state (saved to host memory and put back after), then record one
        iteration on it."""
        self.release()  # free the previous recording's pool first
        self.static = [t if kept else t.clone() for kept, t in zip(self.kept, flat, strict=True)]
        device = self.static[0].device
        # The warm-up runs a whole step, which writes the state in place. Its old values wait in
        # host memory rather than as device copies: a copy of the parameters and optimizer state
        # on the device (a second model's worth) would make recording need more than the step, and
        # under a memory limit set at the budget it ran out of memory there. They are put back
        # after a warm-up that failed half-way (out of memory) too.
        side = warmup_stream(device)
        side.wait_stream(torch.cuda.current_stream())
        with values_kept_on_host(self.static):
            try:
                with torch.cuda.stream(side), torch.no_grad():
                    generator = torch.cuda.get_rng_state()
                    self.run(*self.static)  # lazy initialisation, autotuning
                    torch.cuda.set_rng_state(generator)  # the warm-up's draws must not shift the real step's
            finally:
                torch.cuda.current_stream().wait_stream(side)
        # The warm-up's copies have ended: the recording must not wait for their events (a capture
        # cannot wait for an event recorded outside it), and the swap runtime drops them.
        torch.cuda.synchronize(device)
        # What the warm-up freed stays cached for its side stream, where no replay reuses it: give
        # it back, so that the process holds the state and the graph's pool, as the plan counts.
        torch.cuda.empty_cache()
        graph = torch.cuda.CUDAGraph()
        # Replays allocate nothing: the recording's allocations, made from the graph's private pool,
        # are the iteration's memory, and its peak is the only time the allocator sees them.
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        with SWAP_RUNTIME.recording() as host_buffers, torch.cuda.graph(graph), torch.no_grad():
            self.outputs = self.run(*self.static)
        self.host_buffers = host_buffers
        self.recorded_peak_absolute = torch.cuda.max_memory_allocated(device)
        self.recorded_peak_bytes = self.recorded_peak_absolute - before
        self.graph = graph
        self.recordings += 1


#: One warm-up stream per device for every recording in the process. cuBLAS keeps a workspace per
#: stream it has run on (32 MiB with ``CUBLAS_WORKSPACE_CONFIG=:4096:8``) from the caching
#: allocator for as long as the process lives: a new stream per recording left one more behind
#: each time a step was recorded again (calibration rounds, a measured choice).
_WARMUP_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def warmup_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream recordings on ``device`` warm up on (made once per process)."""
    if device not in _WARMUP_STREAMS:
        _WARMUP_STREAMS[device] = torch.cuda.Stream(device)
    return _WARMUP_STREAMS[device]


def graphable_optimizer(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Make a fresh ``optimizer`` one whose step a CUDA graph can record: ``capturable`` (Adam's
    step counts on the device) and every learning rate a tensor on ``device`` (a scheduler then
    updates it in place: ``group["lr"].fill_(...)``). The numbers are the same; only where they
    live changes. State made before this (a CPU step count) stays where it is, and is refused."""
    for group in optimizer.param_groups:
        if "capturable" in group:
            group["capturable"] = True
        if not isinstance(group["lr"], torch.Tensor):
            group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float64, device=device)
