"""The kernels of the swap ops (:mod:`mutwo.ir.swap`): copies on side CUDA streams, ordered by
events, into host buffers reused across iterations.

On CUDA, for a swapped tensor ``x``:

* ``offload(x)``: the copy-out stream waits for the compute stream (``x`` is ready there), then
  copies ``x`` into a pinned host buffer without blocking the host; ``x.record_stream`` tells the
  caching allocator that the copy-out stream still reads ``x``, so its block is not handed to
  another tensor before the copy ends, although the graph drops ``x`` right after the offload;
* ``prefetch(host)``: allocates the device tensor on the compute stream (like every other value
  of the graph), then the copy-in stream waits for the compute stream (the block may have been
  in use there until this point) and for the copy out, and copies the buffer in;
* ``wait(x)``: the compute stream waits for that copy, and only there;
* ``release_(host)`` (only in a step recorded as a CUDA graph, :mod:`mutwo.runtime.execution.swap_graphs`):
  the compute stream waits for the copy out into ``host``, at the node where the plan's timeline
  says it has ended, and the runtime drops the device tensor it kept for the copy, so its block
  is freed there in the compute stream's order. While a graph records, offloads do not call
  ``record_stream`` (the caching allocator defers the free of a block used on another stream to
  the end of a capture, so inside the graph an offloaded tensor's memory would never be reused);
  they keep the tensor the copy reads until its release instead. The runtime, not the graph,
  keeps it: Inductor may hand each extern call its own copy of a value (a layout change), so the
  tensor a later op of the graph receives need not be the one the copy reads.

Nothing else waits: the compute stream never waits for a copy out, and the host never waits for
the device. A host buffer goes back to the pool with the event of the copy that read it last; the
next copy out into it (an iteration later) waits for that event on the copy-out stream. Buffers
are kept by size and never released, so after the first iteration no host memory is allocated
(pinned memory comes from torch's caching host allocator, whose first allocation may synchronise).
A CUDA graph reads and writes the host buffers its recording took at every replay: those leave
the pool for as long as the graph lives (:meth:`SwapRuntime.recording`).

On CPU the same ops copy into a separate host buffer and back (no streams), so the swap path runs
and is checked bitwise in CI.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

import mutwo.ir.swap  # noqa: F401  (defines the ops whose kernels this module registers)


def covers_storage(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is dense, starts at offset 0 and spans its whole storage, so that
    copying it element by element copies the storage byte for byte."""
    if tensor.storage_offset() != 0 or tensor.numel() * tensor.element_size() != tensor.untyped_storage().nbytes():
        return False
    expected = 1
    for size, stride in sorted(((s, t) for s, t in zip(tensor.shape, tensor.stride(), strict=True) if s != 1),
                               key=lambda pair: pair[1]):  # fmt: skip
        if stride != expected:
            return False
        expected *= size
    return True


def strided_span(tensor: torch.Tensor) -> int | None:
    """How many elements, from ``tensor``'s first, its strides reach (its numel when dense), or
    None when two of its elements share memory (a stride-0 or otherwise overlapping view)."""
    if tensor.numel() == 0:
        return 0
    reach = 1
    for size, stride in sorted(((s, t) for s, t in zip(tensor.shape, tensor.stride(), strict=True) if s != 1),
                               key=lambda pair: pair[1]):  # fmt: skip
        if stride < reach:
            return None
        reach = stride * (size - 1) + reach
    return reach


class HostBuffers:
    """Host buffers of exact sizes, kept and reused; pinned when they feed CUDA copies.

    ``take`` returns a free buffer of the size (with the event of the last copy that read it, which
    a writer must wait for) or allocates one; ``give_back`` returns it with such an event.
    """

    def __init__(self) -> None:
        self._free: dict[tuple[int, bool], list[tuple[torch.Tensor, Any]]] = {}
        self.allocated_bytes = 0  #: host bytes allocated so far (they are never released)
        self.allocations = 0
        self._taken: dict[int, torch.Tensor] | None = None  # data_ptr -> buffer, inside :meth:`reserved`

    def take(self, nbytes: int, pinned: bool) -> tuple[torch.Tensor, Any]:
        free = self._free.get((nbytes, pinned))
        if free:
            buffer, last_reader = free.pop()
        elif pinned and torch.cuda.is_current_stream_capturing():
            # Allocating pinned memory is not allowed while a stream is captured; the warm-up
            # iteration before a recording allocates every buffer the recording takes.
            raise RuntimeError(f"mutwo.offload: no free host buffer of {nbytes} bytes while a CUDA graph records; "
                               "the warm-up iteration did not swap what the recorded one does")  # fmt: skip
        else:
            self.allocations += 1
            self.allocated_bytes += nbytes
            buffer, last_reader = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned), None
        if self._taken is not None:
            self._taken[buffer.data_ptr()] = buffer
        return buffer, last_reader

    def give_back(self, buffer: torch.Tensor, last_reader: Any) -> None:
        self._free.setdefault((buffer.numel(), buffer.is_pinned()), []).append((buffer, last_reader))

    @contextmanager
    def reserved(self) -> Iterator[list[torch.Tensor]]:
        """Buffers taken inside the block leave the pool after it, into the list it yields (a CUDA
        graph recorded inside uses them at every replay). The caller has synchronised the device:
        the events of the free buffers are dropped (a capture cannot wait for an event recorded
        outside it)."""
        for entries in self._free.values():
            entries[:] = [(buffer, None) for buffer, _ in entries]
        self._taken = {}
        held: list[torch.Tensor] = []
        try:
            yield held
        finally:
            taken, self._taken = self._taken, None
            for entries in self._free.values():
                entries[:] = [(buffer, event) for buffer, event in entries if buffer.data_ptr() not in taken]
            held.extend(taken.values())

    def restore(self, held: list[torch.Tensor]) -> None:
        """Return buffers :meth:`reserved` held to the pool (the graph that used them is gone and
        the device synchronised)."""
        for buffer in held:
            self.give_back(buffer, None)

    @property
    def free_buffers(self) -> int:
        return sum(len(entries) for entries in self._free.values())


class SwapRuntime:
    """Streams, in-flight copies and host buffers of the swap ops, one per process (like torch's
    own caching allocators), shared by every graph that swaps."""

    def __init__(self) -> None:
        self.buffers = HostBuffers()
        self._streams: dict[torch.device, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}
        self._copied_out: dict[int, tuple[torch.Tensor, Any]] = {}  # host data_ptr -> (buffer, copy-out event)
        self._copying_in: dict[int, Any] = {}  # device data_ptr -> copy-in event (None on CPU)
        #: while recording, host data_ptr -> (copy-out event, the device tensor it reads) until its release
        self._unreleased: dict[int, tuple[Any, torch.Tensor]] = {}
        self._recording = False
        self.offloads = 0  #: copies out started so far

    def streams(self, device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        """The copy-out and copy-in streams of a GPU."""
        if device not in self._streams:
            self._streams[device] = (torch.cuda.Stream(device=device), torch.cuda.Stream(device=device))
        return self._streams[device]

    @contextmanager
    def recording(self) -> Iterator[list[torch.Tensor]]:
        """While a CUDA graph records a step (the device synchronised before): offloads leave the
        free of their device tensor to an explicit ``release_``, which the prefetch refuses to
        come before, and the host buffers taken leave the pool into the list yielded, for the
        graph to keep (:meth:`HostBuffers.reserved`)."""
        if self.in_flight:
            raise RuntimeError(f"mutwo swap runtime: {self.in_flight} copies in flight when a CUDA graph starts "
                               "recording; an earlier step left swaps unconsumed")  # fmt: skip
        self._recording = True
        try:
            with self.buffers.reserved() as held:
                yield held
        finally:
            self._recording = False
            self._unreleased.clear()

    @property
    def in_flight(self) -> int:
        """Copies started but not yet consumed (0 between iterations of a well-formed graph)."""
        return len(self._copied_out) + len(self._copying_in)

    def offload(self, x: torch.Tensor, tag: int) -> torch.Tensor:
        if not covers_storage(x):
            raise RuntimeError(f"mutwo.offload (tag {tag}): the tensor does not span its storage densely from offset "
                               "0; the swap plan must offload the tensor that allocated the storage")  # fmt: skip
        return self._copy_out(x, x.untyped_storage().nbytes())

    def offload_elements(self, x: torch.Tensor, tag: int) -> torch.Tensor:
        """``offload`` as a compiled step calls it (``mutwo::offload_elements``): Inductor may have
        placed ``x`` inside a larger buffer (a slice of a ``cat``'s output it wrote in place), so
        this copies the elements ``x`` spans, with its strides, whatever its storage holds besides."""
        span = strided_span(x)
        if span is None:
            raise RuntimeError(f"mutwo.offload (tag {tag}): the tensor's elements overlap in memory (an expanded "
                               "view); a swap copies distinct elements only")  # fmt: skip
        return self._copy_out(x, span * x.element_size())

    def _copy_out(self, x: torch.Tensor, nbytes: int) -> torch.Tensor:
        """Start copying ``x`` into a host buffer of ``nbytes`` (laid out with ``x``'s strides)."""
        self.offloads += 1
        buffer, last_reader = self.buffers.take(nbytes, pinned=x.is_cuda)
        host = buffer.view(x.dtype).as_strided(x.shape, x.stride())
        done = None
        if x.is_cuda:
            copy_out, _ = self.streams(x.device)
            copy_out.wait_stream(torch.cuda.current_stream(x.device))  # x is ready there
            if last_reader is not None:  # the buffer's previous copy in has read it
                copy_out.wait_event(last_reader)
            with torch.cuda.stream(copy_out):
                host.copy_(x, non_blocking=True)
                done = torch.cuda.Event()
                done.record(copy_out)
            if not self._recording:
                x.record_stream(copy_out)  # its block is not reused before the copy has read it
        else:
            host.copy_(x)
        if self._recording:
            self._unreleased[host.data_ptr()] = (done, x)
        self._copied_out[host.data_ptr()] = (buffer, done)
        return host

    def release(self, host: torch.Tensor, tag: int) -> None:
        """``mutwo::release_``: when a CUDA graph records, the compute stream waits for the copy into
        ``host`` and the device tensor it read is dropped, freed here unless the graph still holds
        it; otherwise nothing (``record_stream`` already kept its block until the copy read it)."""
        if host.data_ptr() not in self._copied_out:
            raise RuntimeError(f"mutwo.release (tag {tag}): this host tensor is not the result of an offload "
                               "still waiting for its prefetch")  # fmt: skip
        done, x = self._unreleased.pop(host.data_ptr(), (None, None))
        if done is not None and x is not None:
            torch.cuda.current_stream(x.device).wait_event(done)

    def prefetch(self, host: torch.Tensor, device: torch.device, tag: int) -> torch.Tensor:
        entry = self._copied_out.pop(host.data_ptr(), None)
        if entry is None:
            raise RuntimeError(f"mutwo.prefetch (tag {tag}): this host tensor is not the result of an offload "
                               "still waiting for its prefetch")  # fmt: skip
        if host.data_ptr() in self._unreleased:
            raise RuntimeError(f"mutwo.prefetch (tag {tag}): its offload was not released; a step recorded "
                               "as a CUDA graph frees an offloaded tensor at a mutwo::release_ first")  # fmt: skip
        buffer, copied_out = entry
        target = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)
        ready = None
        if target.is_cuda:
            _, copy_in = self.streams(target.device)
            copy_in.wait_stream(torch.cuda.current_stream(target.device))  # the block may be in use until here
            if copied_out is not None:
                copy_in.wait_event(copied_out)
            with torch.cuda.stream(copy_in):
                target.copy_(host, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(copy_in)
        else:
            target.copy_(host)
        self.buffers.give_back(buffer, ready)
        self._copying_in[target.data_ptr()] = ready
        return target

    def wait(self, x: torch.Tensor, tag: int) -> torch.Tensor:
        if x.data_ptr() not in self._copying_in:
            raise RuntimeError(f"mutwo.wait (tag {tag}): this tensor is not the result of a prefetch still "
                               "waiting for its wait")  # fmt: skip
        ready = self._copying_in.pop(x.data_ptr())
        if ready is not None:
            torch.cuda.current_stream(x.device).wait_event(ready)
        return x

    def wait_in_place(self, x: torch.Tensor, tag: int) -> None:
        """``wait`` as a compiled step calls it (``mutwo::wait_``): the same, returning nothing."""
        self.wait(x, tag)


#: The process's swap runtime.
RUNTIME = SwapRuntime()

_IMPL = torch.library.Library("mutwo", "IMPL")
_IMPL.impl("offload", RUNTIME.offload, "CompositeExplicitAutograd")
_IMPL.impl("offload_elements", RUNTIME.offload_elements, "CompositeExplicitAutograd")
_IMPL.impl("prefetch", RUNTIME.prefetch, "CompositeExplicitAutograd")
_IMPL.impl("wait", RUNTIME.wait, "CompositeExplicitAutograd")
_IMPL.impl("wait_", RUNTIME.wait_in_place, "CompositeExplicitAutograd")
_IMPL.impl("release_", RUNTIME.release, "CompositeExplicitAutograd")
