"""Replaying a dropout from the mask it drew, for backends that cannot replay a generator state.

A recompute block regenerates a random op's output by replaying the op with the generator state
it consumed (:mod:`mutwo.ir.replay`). Compiled backends cannot do that: Inductor would trace the
host read of the state into a constant, and a CUDA graph cannot read host state at replay. Until
now they therefore never recomputed through a random op, and on the H100 that kept BERT's dropout
outputs stored under ``--backend inductor``: the plans at checkpointing's peak paid for the memory
with 41 fp32 matmuls (docs/benchmarks.md, "Channels-last ResNet-152 and calibrated BERT").

A dropout needs no generator to be replayed. ``aten.native_dropout`` (what dropout traces to on a
GPU) returns its output and the boolean mask it drew, and its backward keeps the mask anyway. So
the output is ``input * mask * scale``, a deterministic pointwise function of values the block can
read at no memory cost, and one Inductor fuses into the clone's consumers. The same holds for any
backend, but the eager backend keeps the generator replay, whose bitwise equality with the original
was verified on the H100; this replay is used where generator replay is unavailable.

The arithmetic follows the kernels (so the result is bitwise where the eager backend runs it):

* CPU (``native_dropout_cpu``): ``input.mul(mask).mul_(scale)``, the scale rounded to the input's
  dtype, each product rounded in the input's dtype (checked bitwise for float32, float64, bfloat16
  and float16 in ``tests/test_mask_replay.py``);
* CUDA (``fused_dropout_kernel_vec``): ``src * mask * scale`` computed in float32 for float32 and
  reduced-precision inputs (``accscalar_t``), with ``scale = 1.0 / float32(1 - p)``, rounded to the
  input's dtype once. Not verified bitwise on a GPU (compiled backends compare within a tolerance).
"""

from __future__ import annotations

import operator
import struct

import torch

from mutwo.ir.node import Node

__all__ = ["DROPOUT_MASKS", "dropout_from_mask", "mask_holder"]

#: Random ops replayable from a mask they return: schema name -> output position of the mask.
DROPOUT_MASKS: dict[str, int] = {"aten::native_dropout": 1}


def mask_holder(node: Node) -> Node | None:
    """The getitem of ``node`` holding the mask a training dropout drew, if ``node`` is one and the
    graph reads its mask, else None."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or schema.name not in DROPOUT_MASKS or not isinstance(node.args[0], Node):
        return None
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train")
    if train is False:
        return None  # an evaluation-mode dropout draws nothing: it is not random
    position = DROPOUT_MASKS[schema.name]
    return next((u for u in node.users if u.target is operator.getitem and u.args[1] == position), None)


def _float32(value: float) -> float:
    """``value`` rounded to float32, in pure Python (this runs while Inductor traces with fakes)."""
    return struct.unpack("f", struct.pack("f", value))[0]


def dropout_from_mask(input: torch.Tensor, mask: torch.Tensor, p: float) -> tuple[torch.Tensor]:
    """The output of ``native_dropout(input, p, train=True)`` that drew ``mask``, as a one-element
    tuple (the position the dropout's output has: a getitem of output 0 reads it)."""
    keep = 1.0 - p
    if input.device.type == "cpu":
        scale = torch.full((), 0.0 if keep == 0 else 1.0 / keep, dtype=input.dtype)
        return (input.mul(mask).mul_(scale),)
    scale = 0.0 if keep == 0 else 1.0 / _float32(keep)
    math = torch.float32 if input.dtype in (torch.float16, torch.bfloat16) else input.dtype
    return (input.to(math).mul(mask).mul_(scale).to(input.dtype),)
