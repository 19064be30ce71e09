"""Replaying a whole training iteration as one CUDA graph.

The step is recorded once and replayed: one launch instead of thousands, no Python per kernel.
What makes that correct for a training step:

* parameters, buffers and optimizer state are the graph's own inputs, updated in place at fixed
  addresses: the recording reads and writes the live tensors, so a replay steps the real model
  (if one is replaced, e.g. by ``optimizer.load_state_dict``, the step is recorded again);
* the batch and the learning rates live in static buffers the graph reads; every call copies
  the new ones in before the replay;
* a stock optimizer (``capturable=False``, a float learning rate) works as it is: for a CUDA graph
  mutwo traces torch.optim's capturable form of its step, feeds its learning rate as a tensor on
  the device, written from ``param_groups`` at every call, and keeps its step counts on the device
  in ``optimizer.state`` (:mod:`mutwo.runtime.capture.optim`); the user's param groups, state dict
  and schedulers behave as in eager, and the update is bitwise the one of the same optimizer made
  ``capturable`` with its learning rate on the device (:func:`graphable_optimizer`);
* an optimizer without a capturable form but with nothing on the host besides its
  hyperparameters (SGD) computes with its learning rate and momentum as host numbers, which a
  recording freezes: the step is recorded again when one of them changes (a scheduler's step),
  not captured or planned again;
* recording does not run kernels, and what a step does on its first run (cuBLAS/cuDNN
  initialisation, loading Inductor's kernels, its autotuning) must happen outside the capture.
  A training loop's step (``defer_recording``; not with gradient accumulation, whose middle and
  last graphs must record on the first graph's own gradient buffers) therefore runs its first call
  unrecorded, a real step as the backend without CUDA graphs runs it, and records at its second
  call; a runner asked to record before it has ever run (planning's measurements, accumulation's
  graphs) first warms up on the live state, its values kept in host memory and put back after, so
  that only replays step the real state.
  Once the step has run in the process, recording it again (a replaced state, a changed host
  value) needs no warm-up, unless it swaps (the warm-up takes the host buffers it records with);
* random ops (dropout) draw from the default CUDA generator, which CUDA graphs support: each
  replay advances its offset as the eager step would;
* a plan that swaps records its copies on the swap runtime's streams, joined to the graph by
  events, into host buffers the recording takes out of the runtime's pool for as long as the graph
  lives; an offloaded tensor is freed at its release point (:mod:`mutwo.runtime.execution.swap_graphs`).

What cannot be recorded is refused before anything runs (:func:`refuse_uncapturable`): a step
on the CPU, inputs that live on the CPU other than the optimizer's scheduled hyperparameters
(kernels read them on the host at launch, so a graph would freeze their values; an optimizer
without a capturable form whose state stays on the host, Adagrad, is refused when captured), and
ops that read device values on the host.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from mutwo.ir.graph import Graph
from mutwo.ir.node import Node
from mutwo.runtime.capture.optim import SCHEDULED_LABEL
from mutwo.runtime.execution.errors import BackendError
from mutwo.runtime.execution.swap import RUNTIME as SWAP_RUNTIME
from mutwo.runtime.measurement.iterations import values_kept_on_host

#: Ops that read device values on the host: a CUDA graph would record the value read at capture.
HOST_READS = ("aten._local_scalar_dense", "aten.item", "aten.nonzero", "aten.equal")
#: The ops of a traced torch.optim step that compute with host numbers read from their last
#: argument's tensors at run time (``mutwo::host_call*``, ``mutwo::host_scalar``). The multi-tensor
#: ``mutwo::foreach_host_call*`` read theirs from ``host_scalar`` results only, on the CPU.
TRACED_HOST_OPS = ("mutwo.host_call", "mutwo.host_scalar")


def refuse_uncapturable(graph: Graph, inputs: Sequence[torch.Tensor]) -> None:
    """Raise :class:`mutwo.runtime.execution.errors.BackendError` (one line) unless ``graph`` (a whole
    iteration, its placeholders fed ``inputs``) can be recorded as a CUDA graph.

    CPU inputs are the optimizer's scheduled hyperparameters only (``lr:group0``... of an optimizer
    without a capturable form, SGD's; :data:`mutwo.runtime.capture.optim.SCHEDULED_LABEL`): the
    runner records again when one changes (:class:`CudaGraphRunner`). Any other CPU input would be
    frozen at recording, as would a host number read from a tensor on the device."""
    devices = {t.device for t in inputs if t.device.type != "cpu"}
    if not devices or any(d.type != "cuda" for d in devices):
        raise BackendError("CUDA graphs need the model, optimizer state and batch on a CUDA device; this step runs "
                           f"on {', '.join(sorted({str(t.device) for t in inputs}))}: use --backend eager or "
                           "inductor")  # fmt: skip
    labels = [node.label for node in graph.placeholders]
    on_host = [label for label, t in zip(labels, inputs, strict=True)
               if t.device.type == "cpu" and not SCHEDULED_LABEL.fullmatch(label)]  # fmt: skip
    if on_host:
        raise BackendError(f"CUDA graphs cannot record a step that reads CPU tensors on the host ({len(on_host)}: "
                           f"{', '.join(on_host[:3])}{', ...' if len(on_host) > 3 else ''}): their values would be "
                           "frozen at recording; put them on the GPU, or use --backend eager or inductor")  # fmt: skip
    for node in graph:
        if node.op != "call_function":
            continue
        name = node.op_name
        if name.startswith(HOST_READS) or (name.startswith(TRACED_HOST_OPS) and _reads_the_device(node)):
            raise BackendError(f"CUDA graphs cannot record this step: node {node.name} ({name}) reads a tensor's "
                               "value on the host; use --backend eager or inductor")  # fmt: skip


def _reads_the_device(node: Node) -> bool:
    """Whether a traced host call reads a number from a tensor that is not on the CPU (a step count
    of an optimizer traced outside its capturable form, kept on the GPU)."""
    sources = node.args[-1] if node.args else []
    return any(isinstance(source, Node) and source.tensor is not None and source.tensor.device != "cpu"
               for source in (sources if isinstance(sources, (list, tuple)) else [sources]))  # fmt: skip


#: Every runner alive, so that :func:`release_all` can drop their recordings.
_RUNNERS: weakref.WeakSet[CudaGraphRunner] = weakref.WeakSet()


def release_all() -> int:
    """Drop every live step's CUDA-graph recording; the next call of a step records again.
    Returns how many were dropped.

    Call it before ``torch.distributed.destroy_process_group()`` in a data-parallel run: torch
    hangs destroying an NCCL process group while a CUDA graph that recorded its collectives lives
    (pytorch/pytorch#115388), and a step kept by a reference cycle may outlive its last use."""
    live = [runner for runner in list(_RUNNERS) if runner.graph is not None]
    for runner in live:
        runner.release()
    return len(live)


class CudaGraphRunner:
    """``run`` (the step, called with its flat inputs) recorded as a CUDA graph on the first call
    (the second with ``defer_recording``, the first running unrecorded) and replayed on every call
    after; ``kept[i]``: input ``i`` is state updated in place;
    ``labels[i]`` names it in messages.

    It records again when a kept input is another tensor (``load_state_dict`` replaced it) and when
    an input on the CPU holds another value: kernels read a CPU input on the host at launch, so the
    recording froze the value it had (an SGD learning rate that a scheduler has changed)."""

    def __init__(self, run: Callable[..., Any], kept: Sequence[bool], labels: Sequence[str] | None = None) -> None:
        self.run = run
        #: a training loop's step: the first call runs unrecorded (a real step) and the next one
        #: records, rather than the first warming up on the state kept in host memory and recording
        #: (a restart's first step copied the parameters and optimizer state out and back: several GB)
        self.defer_recording = False
        #: ``run`` has run in this process (a warm-up or an unrecorded step): its first-run work is done
        self.ran = False
        #: its last run swapped: every recording warms up first, which takes the pinned host buffers
        #: the recording will (none may be allocated during a capture, and other live graphs, such
        #: as gradient accumulation's, may hold the ones this step's last run gave back)
        self.swaps = False
        self.kept = list(kept)
        self.labels = list(labels) if labels is not None else [f"input {i}" for i in range(len(self.kept))]
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static: list[torch.Tensor] = []
        #: the positions of the inputs read on the host (CPU tensors that are not state)
        self.on_host: list[int] = []
        self.outputs: Any = None
        self.recordings = 0
        #: recordings made again because an input read on the host changed, and whether the last call made one
        self.host_value_recordings = 0
        self._recorded_for_host_values = False
        #: the recorded iteration's peak above what was allocated before it (its transients, which
        #: live in the graph's pool), and the allocator's absolute peak while recording: replays
        #: allocate nothing, so measurements of replays alone miss it (recording resets the peak)
        self.recorded_peak_bytes = 0
        self.recorded_peak_absolute = 0
        #: the swap runtime's host buffers the recording copies into and out of (none without swaps)
        self.host_buffers: list[torch.Tensor] = []
        _RUNNERS.add(self)

    def will_record(self, flat: Sequence[torch.Tensor]) -> bool:
        """Whether a call with ``flat`` records the step: its first recording (not before it has
        run, with ``defer_recording``), a host value changed or the state replaced."""
        if self.graph is None:
            return self.ran or not self.defer_recording
        return bool(self.changed_host_values(flat)) or self.replaced_state(flat)

    def replaced_state(self, flat: Sequence[torch.Tensor]) -> bool:
        """Whether a kept input of ``flat`` is another tensor than the recording's (``load_state_dict``)."""
        return self.graph is not None and any(kept and t.data_ptr() != s.data_ptr()
                                              for kept, t, s in zip(self.kept, flat, self.static, strict=True))

    def __call__(self, *flat: torch.Tensor) -> Any:
        if self.graph is None and self.defer_recording and not self.ran:
            return self.run_unrecorded(flat)
        changed = self.changed_host_values(flat)
        if changed:
            self._recorded_again_for(changed)
        else:
            self._recorded_for_host_values = False
        if self.graph is None or changed or self.replaced_state(flat):
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

    def changed_host_values(self, flat: Sequence[torch.Tensor]) -> list[str]:
        """The labels of the inputs read on the host whose values differ from the recording's."""
        if self.graph is None:
            return []
        return [self.labels[i] for i in self.on_host if not torch.equal(flat[i], self.static[i])]

    def _recorded_again_for(self, changed: list[str]) -> None:
        """Count a recording made again for ``changed`` host values; warn (once per process, as
        Python shows a warning) when the previous call made one too: a per-step schedule."""
        self.host_value_recordings += 1
        if self._recorded_for_host_values:
            them = "them" if len(changed) > 1 else "it"
            warnings.warn(f"mutwo: {', '.join(changed)} changed again; the CUDA graph reads {them} on the host (an "
                          "optimizer without a capturable form, such as SGD), so every change records the step "
                          f"again: a schedule that changes {them} at every step pays for a recording at every step",
                          stacklevel=3)  # fmt: skip
        self._recorded_for_host_values = True

    def release(self) -> None:
        """Drop the recording (its private pool goes back to the allocator, its host buffers to the
        swap runtime); the next call records again. Planning that measures one compiled step after
        another (peak calibration, a measured choice between plans) releases each after measuring
        it, so that no pool outlives its measurement and skews the next one's peak."""
        if self.graph is not None:
            self.graph.reset()  # now, not when the last reference goes (see release_all)
        self.graph, self.outputs, self.static = None, None, []
        if self.host_buffers:  # the graph's replays have ended before its buffers go back to the pool
            torch.cuda.synchronize()
            SWAP_RUNTIME.buffers.restore(self.host_buffers)
            self.host_buffers = []

    def run_unrecorded(self, flat: Sequence[torch.Tensor]) -> Any:
        """One step as the backend without CUDA graphs runs it, on the caller's stream: the state is
        stepped by it and the random numbers drawn from the generator as a replay draws them."""
        offloads = SWAP_RUNTIME.offloads
        with torch.no_grad():
            outputs = self.run(*flat)
        self.ran, self.swaps = True, SWAP_RUNTIME.offloads > offloads
        return outputs

    def take_inputs(self, flat: Sequence[torch.Tensor]) -> None:
        """The recording's inputs: the state itself, copies of the rest (refilled before every replay)."""
        self.static = [t if kept else t.clone() for kept, t in zip(self.kept, flat, strict=True)]
        self.on_host = [i for i, (kept, t) in enumerate(zip(self.kept, flat, strict=True))
                        if not kept and t.device.type == "cpu"]  # fmt: skip

    def record(self, flat: Sequence[torch.Tensor]) -> None:
        """Record one iteration on the live state, after a warm-up (see :meth:`warm_up`) unless the
        step has run in this process before."""
        self.release()  # free the previous recording's pool first
        self.take_inputs(flat)
        device = self.static[0].device
        if not self.ran or self.swaps:
            self.warm_up()
        # The warm-up's or the last step's copies have ended: the recording must not wait for their
        # events (a capture cannot wait for an event recorded outside it), and the swap runtime drops them.
        torch.cuda.synchronize(device)
        # cuBLAS keeps one workspace per stream until told otherwise; one first made while a graph
        # recorded comes from that graph's private pool and kept the whole pool alive after the
        # graph was released (62 MiB held past each calibration round, bench/held_excess_probe.py).
        # Cleared around the recording, as Inductor's CUDA-graph trees do: this graph's workspace is
        # made in its own pool and goes back with it.
        clear_cublas_workspaces()
        # What the warm-up or an unrecorded step freed stays cached (for the warm-up's side stream,
        # where no replay reuses it): give it back, so that the process holds the state and the
        # graph's pool, as the plan counts.
        torch.cuda.empty_cache()
        graph = torch.cuda.CUDAGraph()
        # Replays allocate nothing: the recording's allocations, made from the graph's private pool,
        # are the iteration's memory, and its peak is the only time the allocator sees them.
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        with SWAP_RUNTIME.recording() as host_buffers, torch.cuda.graph(graph), torch.no_grad():
            self.outputs = self.run(*self.static)
        self.host_buffers = host_buffers
        clear_cublas_workspaces()  # the graph's workspace stays in its pool, for the replays; nothing else uses it
        self.recorded_peak_absolute = torch.cuda.max_memory_allocated(device)
        self.recorded_peak_bytes = self.recorded_peak_absolute - before
        self.graph = graph
        self.recordings += 1

    def warm_up(self) -> None:
        """Run the step once on the recording's inputs, on a side stream, with the live state's
        values kept in host memory and put back after: its first-run work then happens outside the
        capture, and the state is stepped only by replays."""
        device = self.static[0].device
        # The warm-up runs a whole step, which writes the state in place. Its old values wait in
        # host memory rather than as device copies: a copy of the parameters and optimizer state
        # on the device (a second model's worth) would make recording need more than the step, and
        # under a memory limit set at the budget it ran out of memory there. They are put back
        # after a warm-up that failed half-way (out of memory) too.
        side = warmup_stream(device)
        side.wait_stream(torch.cuda.current_stream())
        offloads = SWAP_RUNTIME.offloads
        with values_kept_on_host(self.static):
            try:
                with torch.cuda.stream(side), torch.no_grad():
                    generator = torch.cuda.get_rng_state()
                    self.run(*self.static)  # lazy initialisation, autotuning
                    torch.cuda.set_rng_state(generator)  # the warm-up's draws must not shift the real step's
            finally:
                torch.cuda.current_stream().wait_stream(side)
        self.ran, self.swaps = True, SWAP_RUNTIME.offloads > offloads


def clear_cublas_workspaces() -> None:
    """Drop cuBLAS's per-stream workspaces (each is made again, by the next matmul on its stream)."""
    torch._C._cuda_clearCublasWorkspaces()


#: One warm-up stream per device for every recording in the process. cuBLAS keeps a workspace per
#: stream it has run on (32 MiB with ``CUBLAS_WORKSPACE_CONFIG=:4096:8``) from the caching
#: allocator until its workspaces are cleared: before recordings cleared them, a new stream per
#: recording left one more behind each time a step was recorded again (calibration rounds, a
#: measured choice), and one stream needs no more.
_WARMUP_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def warmup_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream recordings on ``device`` warm up on (made once per process)."""
    if device not in _WARMUP_STREAMS:
        _WARMUP_STREAMS[device] = torch.cuda.Stream(device)
    return _WARMUP_STREAMS[device]


def graphable_optimizer(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Make a fresh ``optimizer`` capturable, with every learning rate a float64 tensor on
    ``device`` (a scheduler then updates it in place: ``group["lr"].fill_(...)``): the form whose
    eager ``step()`` a stock optimizer's step under the CUDA-graph backends equals bit for bit.
    mutwo does not need it (it traces a stock optimizer's capturable form itself, see the module
    docstring); tests build their eager reference with it. The numbers are the same; only where
    they live changes. State made before this (a CPU step count) stays where it is."""
    for group in optimizer.param_groups:
        if "capturable" in group:
            group["capturable"] = True
        if not isinstance(group["lr"], torch.Tensor):
            group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float64, device=device)
