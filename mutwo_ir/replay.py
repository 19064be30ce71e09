"""How a recompute clone replays a forward op whose plain copy would not give the same values or
would do more work than needed: random ops, replayed with the random state they consumed, and
training batch norms, replayed from the statistics they saved.

* **Random ops** (``native_dropout``, ``bernoulli_``, SDPA kernels with dropout, anything tagged
  ``nondeterministic_seeded``): a node right before the original in the forward pass snapshots the
  generator of its device (:func:`rng_state`); the clone runs the same op through torch's
  ``run_with_rng_state`` (``torch._prims.rng_prims``, the primitive of functionalized RNG in
  ``torch.compile``'s partitioner), which sets that state, runs the op and puts the generator back
  where it was. The clone therefore draws exactly the numbers the original drew (same kernel, same
  state: bitwise on every device), and the random stream after the iteration is where the
  original iteration left it. A random op that takes its own ``generator`` cannot be replayed so:
  it is refused (:func:`rng_refusal`).
* **Training batch norms** (``native_batch_norm``, ``cudnn_batch_norm``): the clone computes the
  normalisation from the saved mean and inverse standard deviation, which the backward keeps
  anyway (:func:`batch_norm_from_stats`): one pointwise pass, no reduction, no running-statistics
  update. On CPU it mirrors the kernel's arithmetic and is bitwise equal to it; on CUDA it is
  ``batch_norm_elemt``, the normalisation kernel of ATen's own CUDA batch norm, which matches
  cuDNN's only to rounding (:func:`exact_on`). Inductor has no lowering for that op: a compiled
  step decomposes it with :func:`batch_norm_elemt_decomposition`, its arithmetic in pointwise ops.

Nothing here touches CUDA at import time.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch._prims.rng_prims import run_with_rng_state

from mutwo.ir.node import Node

__all__ = ["BATCH_NORM_STATS", "batch_norm_elemt_decomposition", "batch_norm_from_stats", "describe", "exact_on",
           "random_device", "rng_refusal", "rng_state", "rng_state_bytes", "run_with_rng_state", "stats_holders",
           "training_batch_norm_stats"]  # fmt: skip

#: Training batch norms replayable from their saved statistics: schema name -> output positions of
#: (mean, inverse std). Operands 0, 1, 2 are input, weight and bias for all of them.
BATCH_NORM_STATS: dict[str, tuple[int, int]] = {
    "aten::native_batch_norm": (1, 2),
    "aten::cudnn_batch_norm": (1, 2),
}

_RNG_DEVICES = ("cpu", "cuda")

#: Bytes of a generator state: the CPU's Mersenne Twister state, a CUDA generator's (seed, offset).
_RNG_STATE_BYTES = {"cpu": 5056, "cuda": 16}


def rng_state(device: str) -> torch.Tensor:
    """A copy of the default generator's state on ``device`` (what a random op there will consume)."""
    if device.startswith("cuda"):
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def rng_state_bytes(device: str) -> int:
    """Size of what :func:`rng_state` returns for ``device`` (a CPU tensor of bytes)."""
    return _RNG_STATE_BYTES["cuda" if device.startswith("cuda") else "cpu"]


def rng_refusal(node: Node) -> str | None:
    """Why the random op ``node`` cannot be replayed with a restored generator state, or None."""
    if node.kwargs.get("generator") is not None:
        return "it draws from its own generator, whose state cannot be restored"
    device = random_device(node)
    if device is None or not device.startswith(_RNG_DEVICES):
        return f"its device ({device}) has no generator state mutwo can restore"
    return None


def random_device(node: Node) -> str | None:
    """The device whose generator a random op draws from: its outputs' (or a device argument's)."""
    for meta in node.tensors:
        if meta is not None:
            return meta.device
    device = node.kwargs.get("device")
    return str(device) if device is not None else None


def stats_holders(node: Node) -> tuple[Node, Node] | None:
    """The nodes holding the saved mean and inverse std of a training batch norm, if the graph has
    them (getitems of the node), else None."""
    positions = training_batch_norm_stats(node)
    if positions is None:
        return None
    found: dict[int, Node] = {}
    for user in node.users:
        if user.target is operator.getitem and user.args[1] in positions:
            found.setdefault(user.args[1], user)
    if len(found) != 2:
        return None
    return found[positions[0]], found[positions[1]]


def training_batch_norm_stats(node: Node) -> tuple[int, int] | None:
    """Output positions of (mean, inverse std) for a batch norm in training mode, else None."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or schema.name not in BATCH_NORM_STATS or len(node.args) < 6 or node.args[5] is not True:
        return None
    return BATCH_NORM_STATS[schema.name]


def exact_on(device: str) -> bool:
    """Whether :func:`batch_norm_from_stats` is bitwise equal to the batch norm kernels on ``device``."""
    return device.startswith("cpu")


def batch_norm_from_stats(input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                          mean: torch.Tensor, invstd: torch.Tensor) -> tuple[torch.Tensor]:  # fmt: skip
    """The output of a training batch norm of ``input``, from its saved ``mean`` and ``invstd``.

    Returned as a one-element tuple, the value position the batch norm's output has (a getitem
    of output 0 reads it). On CPU this follows ``batch_norm_cpu`` operation by operation (its
    output layout, its fast path for contiguous and channels-last inputs, whose linear and
    constant terms are computed with a fused multiply-add, and its element-wise path otherwise),
    so the result is bitwise equal to the kernel's.
    """
    if input.device.type != "cpu":
        return (torch.batch_norm_elemt(input, weight, bias, mean, invstd, 0.0),)
    shape = [1, input.shape[1]] + [1] * (input.dim() - 2)
    if _dense(input) and (weight is None or weight.is_contiguous()) and (bias is None or bias.is_contiguous()):
        # output = input * alpha + beta with alpha = invstd * weight, beta = bias - mean * alpha,
        # in the operator math type, each step a fused multiply-add as the kernel's is.
        math = torch.float32 if input.dtype in (torch.bfloat16, torch.float16) else input.dtype
        invstd_m = invstd.to(math)
        alpha = invstd_m * weight.to(math) if weight is not None else invstd_m
        beta_base = bias.to(math) if bias is not None else torch.zeros_like(invstd_m)
        beta = torch.addcmul(beta_base, mean.to(math), alpha, value=-1)
        out = torch.addcmul(beta.view(shape), input.to(math), alpha.view(shape)).to(input.dtype)
        return (out.contiguous(memory_format=_dense_format(input)),)
    # The kernel's element-wise path: ((input - mean) * invstd) * weight + bias, one rounding per step.
    output = torch.empty_like(input, memory_format=_suggested_format(input))
    scaled = (input - mean.view(shape)) * invstd.view(shape)
    scaled = scaled * (weight.view(shape) if weight is not None else 1)
    torch.add(scaled, bias.view(shape) if bias is not None else 0, out=output)
    return (output,)


def batch_norm_elemt_decomposition(input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                                   mean: torch.Tensor, invstd: torch.Tensor, eps: float) -> torch.Tensor:  # fmt: skip
    """``aten.batch_norm_elemt`` (the CUDA replay of :func:`batch_norm_from_stats`) in pointwise ops,
    for Inductor, which has neither a lowering nor a decomposition for it.

    The arithmetic of ATen's CUDA kernel (``batch_norm_elementwise``'s general path; its contiguous
    and channels-last paths multiply by the weight first, a rounding apart): ``((input - mean) *
    invstd) * weight + bias`` per element, each per-channel tensor viewed as ``[1, C, 1, ...]``, in
    float32 for a half-precision input and cast back. The output takes the input's suggested
    memory format, as the kernel's does (channels-last stays channels-last). ``eps`` is unused:
    ``invstd`` already holds it.
    """
    del eps
    shape = [1, input.shape[1]] + [1] * (input.dim() - 2)
    math = torch.float32 if input.dtype in (torch.bfloat16, torch.float16) else input.dtype
    out = (input.to(math) - mean.to(math).view(shape)) * invstd.to(math).view(shape)
    if weight is not None:
        out = out * weight.to(math).view(shape)
    if bias is not None:
        out = out + bias.to(math).view(shape)
    return out.to(input.dtype).contiguous(memory_format=_suggested_format(input))


def _dense(tensor: torch.Tensor) -> bool:
    return any(tensor.is_contiguous(memory_format=f) for f in _DENSE_FORMATS)


def _dense_format(tensor: torch.Tensor) -> torch.memory_format:
    """The layout the kernel gives the output of a dense input (``suggest_memory_format_contig``)."""
    if tensor.is_contiguous():
        return torch.contiguous_format
    return torch.channels_last_3d if tensor.is_contiguous(memory_format=torch.channels_last_3d) \
        else torch.channels_last  # fmt: skip


def _suggested_format(tensor: torch.Tensor) -> torch.memory_format:
    """``Tensor::suggest_memory_format``: channels-last when the strides say so."""
    from torch._prims_common import suggest_memory_format

    return suggest_memory_format(tensor)


_DENSE_FORMATS = (torch.contiguous_format, torch.channels_last, torch.channels_last_3d)


def describe(target: Any) -> str:
    """How a clone's target replays its original, for plans and reports."""
    if target is run_with_rng_state:
        return "rng-state"
    if target is batch_norm_from_stats:
        return "batch-norm-from-stats"
    return "copy"
