"""An fp64 run of the original graph: what a compiled step's rounding is judged against when it
misses the direct tolerance.

A compiled step's fused kernels round differently from eager's, and on an ill-conditioned model
(ResNet-152 with its default initialization: eager fp32 is 11% off fp64 in a gradient) eager's
own fp32 result is no better a reference than the compiled one. torch's accuracy runs
(``benchmarks/dynamo/common.py`` with ``torch._dynamo.utils.same(ref, res, fp64_ref, tol=...)``)
settle it with a third run in float64: a tensor that misses ``allclose`` passes when the compiled
result's root-mean-square error from the fp64 one is at most a multiple of eager fp32's:

    rmse(fp64, compiled) <= multiplier * rmse(fp64, eager) + floor

with ``same``'s multipliers (:func:`multiplier`) and a floor of a tenth of the absolute tolerance
(``same``: ``tol / 10``, its ``tol`` being its ``allclose`` atol as well as its rtol).

The fp64 run is the original graph's fx module with every floating dtype it names (a
``_to_copy``'s target, ``_log_softmax_backward_data``'s ``input_dtype``, an autocast region's
bfloat16) widened to float64, run under float64 as the default dtype, from a float64 copy of
the state and batch (non-floating tensors unchanged). As in torch's runs, autocast regions and
reduced-precision parameters compute in float64 there too. Random ops must draw the same numbers
in float64 as in float32, or the fp64 run is no reference: on the CPU a dropout's Bernoulli
draws do (its mask does not depend on the dtype); other random ops, and any on a GPU, leave the
fp64 rule out, and the check says so.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

#: ``torch._dynamo.utils.same``'s multiplier of eager fp32's error ...
MULTIPLIER = 2.0
#: ... and its larger one where noise may dominate the error: a result in fp16/bf16, a tensor of
#: fewer than :data:`NOISY_NUMEL` elements, a 1x1-kernel-shaped 4-d tensor, or a loose tolerance
#: (rtol of at least :data:`LOOSE_RTOL`).
NOISY_MULTIPLIER = 3.0
NOISY_NUMEL = 1000
LOOSE_RTOL = 2e-2
#: The floor added to the allowed error, as a fraction of the absolute tolerance.
FLOOR_FRACTION = 0.1

_WIDENED = frozenset({torch.float32, torch.float16, torch.bfloat16})
#: Random ops whose draws on the CPU do not depend on the dtype (dropout's Bernoulli masks).
SAME_DRAWS_ON_CPU = frozenset({torch.ops.aten.bernoulli_.float, torch.ops.aten.bernoulli.p,
                               torch.ops.aten.native_dropout.default})  # fmt: skip


def criterion(atol: float) -> str:
    """The rule in words, with its constants, for the check's message."""
    return (f"RMSE from an fp64 run of the original within {MULTIPLIER:g}x eager fp32's ({NOISY_MULTIPLIER:g}x under "
            f"{NOISY_NUMEL} elements, for 1x1 kernels and fp16/bf16 results) + {FLOOR_FRACTION * atol:g}, "
            "torch._dynamo.utils.same's fp64 criterion")  # fmt: skip


def multiplier(result: torch.Tensor, rtol: float) -> float:
    """``torch._dynamo.utils.same``'s multiplier for ``result`` (its defaults: no model-specific
    larger multipliers)."""
    noisy = (result.dtype in (torch.float16, torch.bfloat16) or result.numel() < NOISY_NUMEL
             or (result.ndim == 4 and result.shape[-1] == result.shape[-2] == 1) or rtol >= LOOSE_RTOL)  # fmt: skip
    return NOISY_MULTIPLIER if noisy else MULTIPLIER


def rmse(reference: torch.Tensor, result: torch.Tensor) -> float:
    """Root-mean-square difference, computed in float64."""
    if not reference.numel():
        return 0.0
    return float((reference.double() - result.double()).square().mean().sqrt())


@dataclass(frozen=True)
class Verdict:
    """How far a compiled result and eager's are from the fp64 one, and what the rule allows."""

    compiled_error: float
    eager_error: float
    allowed: float

    @property
    def passed(self) -> bool:
        # NaN errors fail, as in ``same`` (a NaN in eager fp32 only: see the check's direct rule).
        return self.compiled_error <= self.allowed

    def __str__(self) -> str:
        return (f"RMSE from fp64: compiled {self.compiled_error:.3g}, eager fp32 {self.eager_error:.3g}, allowed "
                f"{self.allowed:.3g}")  # fmt: skip


def verdict(eager: torch.Tensor, compiled: torch.Tensor, fp64: torch.Tensor, rtol: float,
            atol: float) -> Verdict | None:  # fmt: skip
    """The fp64 rule's verdict on ``compiled``, or None where ``fp64`` is no float64 counterpart
    of ``eager`` (a tensor the fp64 run did not compute in float64, or of another shape)."""
    if fp64.dtype != torch.float64 or fp64.shape != eager.shape or not eager.is_floating_point():
        return None
    eager_error = rmse(fp64, eager)
    allowed = multiplier(compiled, rtol) * eager_error + FLOOR_FRACTION * atol
    return Verdict(rmse(fp64, compiled), eager_error, allowed if not math.isnan(allowed) else -math.inf)


def widen(module: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``module`` whose nodes name torch.float64 wherever they named a floating dtype."""
    graph = copy.deepcopy(module.graph)
    for node in graph.nodes:
        node.args = fx.node.map_aggregate(node.args, _widened)
        node.kwargs = fx.node.map_aggregate(node.kwargs, _widened)
    return fx.GraphModule(module, graph)  # capture made the model's constants inputs: no attributes to widen


def _widened(value: Any) -> Any:
    return torch.float64 if isinstance(value, torch.dtype) and value in _WIDENED else value


def as_fp64(tensor: torch.Tensor) -> torch.Tensor:
    """A float64 copy of a floating tensor, a copy of any other."""
    return tensor.to(torch.float64, copy=True) if tensor.is_floating_point() else tensor.clone()


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """``dtype`` as torch's default (factory calls without a dtype) for the duration."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def random_ops_differ(module: fx.GraphModule, device: torch.device) -> str | None:
    """Why ``module``'s random ops may draw other numbers in float64 on ``device``, or None."""
    seeded = sorted({str(node.target) for node in module.graph.nodes if isinstance(node.target, torch._ops.OpOverload)
                     and torch.Tag.nondeterministic_seeded in node.target.tags
                     and (device.type != "cpu" or node.target not in SAME_DRAWS_ON_CPU)})  # fmt: skip
    if not seeded:
        return None
    return (f"not run: its random ops ({', '.join(seeded[:3])}) need not draw the same numbers in float64 as in "
            f"float32 on {device.type}")


class Fp64Run:
    """The original graph run in float64, each iteration from the fp32 reference's state.

    ``failure`` says, in one line, why it stopped (an op without a float64 kernel, memory): from
    then on :meth:`step` returns None and the check compares by its direct tolerance only.
    """

    def __init__(self, module: fx.GraphModule, inputs: Sequence[torch.Tensor], device: torch.device) -> None:
        self.module = widen(module)
        self.failure = random_ops_differ(module, device)
        self.state = [as_fp64(t) for t in inputs] if self.failure is None else []

    def step(self, start: Sequence[torch.Tensor], iteration: int, seed: int) -> Any:
        """One iteration from a float64 copy of ``start`` (the fp32 state before the iteration),
        the generators seeded with ``seed`` as for the other runs. Returns the graph's outputs, or
        None once the run has failed."""
        if self.failure is not None:
            return None
        for mine, theirs in zip(self.state, start, strict=True):
            mine.copy_(theirs)
        torch.manual_seed(seed)
        try:
            with torch.no_grad(), default_dtype(torch.float64):
                return self.module(*self.state)
        except Exception as error:  # noqa: BLE001 - any failure is reported, and the direct rule still runs
            first_line = (str(error).strip().splitlines() or [""])[0][:200]
            self.failure = f"failed in iteration {iteration}: {type(error).__name__}: {first_line}"
            self.state = []  # its memory back to the rest of the check
            return None
