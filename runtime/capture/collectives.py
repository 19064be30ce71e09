"""The collectives of a data-parallel iteration, written with torch's functional collectives
(``torch.ops._c10d_functional``) so that ``make_fx`` traces them into the iteration's graph.

* Before the forward, rank 0's buffers (batch-norm statistics...) overwrite every rank's, as
  ``DistributedDataParallel`` does at the start of every forward (``broadcast_buffers``).
* During the backward, every gradient is put in a bucket the moment it is final — a tensor hook
  fires where the autograd engine produces it — and a bucket is all-reduced as soon as it is
  full, so its communication overlaps the rest of the backward. Buckets are filled as DDP
  rebuilds them after its first iteration: in the order gradients become ready, one open bucket
  per dtype and device, closed when it reaches its size limit (DDP's first limit is 1 MiB, the
  next ones 25 MiB; ``torch.distributed._compute_bucket_assignment_by_size``).
* The arithmetic is DDP's: each bucket is multiplied by ``1 / world_size`` (the Python float DDP
  wraps as a scalar) and then summed across ranks; the waits come at the end of the backward,
  where DDP's reducer finalizes, and the gradients the optimizer reads are views of the buckets.

An issued collective runs asynchronously until its ``wait_tensor``: the graph must not read the
buffer in between (the IR verifier's ``collective-wait`` invariant).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from mutwo.runtime.capture.tracing import CaptureError

if torch.distributed.is_available():
    # Registers the meta kernels of the functional collectives, which tracing with fake tensors runs.
    import torch.distributed._functional_collectives  # noqa: F401

#: DDP broadcasts buffers (and, at construction, parameters) in chunks of this many bytes.
BROADCAST_CHUNK_BYTES = 250 * 1024 * 1024

_C10D = torch.ops._c10d_functional


def broadcast_coalesced(tensors: Sequence[torch.Tensor], group_name: str, src: int = 0,
                        chunk_bytes: int = BROADCAST_CHUNK_BYTES) -> None:  # fmt: skip
    """Overwrite ``tensors`` in place with rank ``src``'s, a few collectives per dtype and device
    (one per ``chunk_bytes``) as DDP's ``_broadcast_coalesced``; eagerly or while tracing."""
    chunks: dict[tuple[torch.dtype, torch.device], list[list[torch.Tensor]]] = {}
    for tensor in tensors:
        groups = chunks.setdefault((tensor.dtype, tensor.device), [[]])
        if groups[-1] and sum(t.numel() * t.element_size() for t in groups[-1]) >= chunk_bytes:
            groups.append([])
        groups[-1].append(tensor)
    for chunk in (c for groups in chunks.values() for c in groups):
        flat = torch.cat([t.reshape(-1) for t in chunk])
        flat = _C10D.wait_tensor(_C10D.broadcast_(flat, src, group_name))
        for tensor, piece in zip(chunk, flat.split([t.numel() for t in chunk]), strict=True):
            tensor.copy_(piece.view(tensor.shape))


@dataclass
class _Bucket:
    names: list[str] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)
    bytes: int = 0


@dataclass
class _Issued:
    names: list[str]
    shapes: list[torch.Size]
    flat: torch.Tensor


class GradientBuckets:
    """Averages the gradients of ``names`` across the ranks of ``group_name`` while the backward
    is traced (see the module docstring). Call :meth:`watch` before the backward and
    :meth:`averaged` after it; ``layout`` then lists the buckets in the order they were issued."""

    def __init__(self, group_name: str, world_size: int, limits: Sequence[int], names: Sequence[str]) -> None:
        self.group_name = group_name
        self.scale = 1.0 / world_size  # DDP: a double, wrapped as a scalar by the multiplication
        self.limits = tuple(limits)
        self.names = list(names)
        self.open: dict[tuple[torch.dtype, torch.device], _Bucket] = {}
        self.limit_index: dict[tuple[torch.dtype, torch.device], int] = {}
        self.issued: list[_Issued] = []
        self.seen: set[str] = set()

    @property
    def layout(self) -> list[list[str]]:
        return [bucket.names for bucket in self.issued]

    def watch(self, params: dict[str, torch.Tensor]) -> None:
        """Hook every watched parameter: its hook runs where the backward makes its gradient final."""
        for name in self.names:
            params[name].register_hook(lambda grad, name=name: self._ready(name, grad))

    def _ready(self, name: str, grad: torch.Tensor) -> None:
        if name in self.seen:
            raise CaptureError(f"the gradient of {name} became ready twice in one backward; data-parallel "
                               "capture needs one gradient per parameter per iteration")  # fmt: skip
        if grad.layout is not torch.strided:
            raise CaptureError(f"the gradient of {name} is sparse; data-parallel capture averages dense gradients "
                               "only (build the embedding with sparse=False)")  # fmt: skip
        self.seen.add(name)
        key = (grad.dtype, grad.device)
        bucket = self.open.setdefault(key, _Bucket())
        bucket.names.append(name)
        bucket.grads.append(grad)
        bucket.bytes += grad.numel() * grad.element_size()
        index = self.limit_index.setdefault(key, 0)
        if bucket.bytes >= self.limits[index]:
            self.limit_index[key] = min(index + 1, len(self.limits) - 1)
            self._issue(self.open.pop(key))

    def _issue(self, bucket: _Bucket) -> None:
        flat = torch.cat([g.reshape(-1) for g in bucket.grads])
        flat.mul_(self.scale)
        flat = _C10D.all_reduce_(flat, "sum", self.group_name)
        self.issued.append(_Issued(bucket.names, [g.shape for g in bucket.grads], flat))

    def averaged(self, names: Sequence[str], grads: Sequence[torch.Tensor | None]) -> tuple[torch.Tensor | None, ...]:
        """``grads`` (one per name, None where a parameter got no gradient) with every watched
        gradient replaced by its average over the ranks: the last, partly filled buckets are
        issued, then every bucket is waited for in order."""
        for key in list(self.open):
            self._issue(self.open.pop(key))
        averaged: dict[str, torch.Tensor] = {}
        for bucket in self.issued:
            flat = _C10D.wait_tensor(bucket.flat)
            pieces = flat.split([shape.numel() for shape in bucket.shapes])
            averaged.update((name, piece.view(shape)) for name, piece, shape
                            in zip(bucket.names, pieces, bucket.shapes, strict=True))  # fmt: skip
        return tuple(averaged.get(name, grad) for name, grad in zip(names, grads, strict=True))
