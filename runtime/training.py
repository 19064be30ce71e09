"""How the captured iteration trains, beyond forward, backward and ``optimizer.step()``: gradient
clipping, mixed precision and gradient accumulation, each traced into the graph with torch's own
code so that the captured iteration stays bitwise equal to the eager loop it stands for:

- ``max_grad_norm`` / ``norm_type``: ``torch.nn.utils.clip_grad_norm_(model.parameters(),
  max_grad_norm, norm_type)`` between ``backward()`` and ``optimizer.step()`` (torch's own function,
  on the traced gradients, in the model's parameter order, foreach where torch uses it);
- ``precision``: ``"fp32"`` (the model's own dtypes), or ``"bf16-autocast"`` / ``"fp16-autocast"``:
  the model and the loss run under ``torch.autocast(device_type, dtype)``, as in an eager loop that
  wraps them in it (the backward and the optimizer step run outside it, as there);
- ``accumulation_steps=k``: each call of the step takes one micro-batch; the loop it stands for
  calls ``(loss_fn(model(x), batch) / k).backward()`` on each and ``optimizer.step()`` (then
  ``zero_grad``) after every k-th. Three graphs express it: the first micro-batch returns its
  gradients, the middle ones add theirs to them in place (``.grad``'s own accumulation), the last
  adds its own, clips and steps. The accumulated gradients are inputs of the middle and last graphs,
  so the memory simulator and ``select`` see them live throughout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from mutwo.runtime.tracing import CaptureError

#: precision name -> the autocast dtype (None: no autocast)
PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16-autocast": torch.bfloat16,
                                             "fp16-autocast": torch.float16}  # fmt: skip


class TrainingOptionError(ValueError):
    """A training option has a value the captured iteration cannot take."""


@dataclass(frozen=True)
class TrainingOptions:
    """Clipping and precision of the captured iteration (see the module docstring)."""

    max_grad_norm: float | None = None
    norm_type: float = 2.0
    precision: str = "fp32"
    accumulation_steps: int = 1

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise TrainingOptionError(f"precision {self.precision!r} is not known; use one of "
                                      f"{', '.join(PRECISIONS)}")  # fmt: skip
        if self.max_grad_norm is not None and not float(self.max_grad_norm) > 0:
            raise TrainingOptionError(f"max_grad_norm must be a positive number, not {self.max_grad_norm!r}")
        if isinstance(self.accumulation_steps, bool) or not isinstance(self.accumulation_steps, int) \
                or self.accumulation_steps < 1:  # fmt: skip
            raise TrainingOptionError(f"accumulation_steps must be a whole number of micro-batches (1 or more), "
                                      f"not {self.accumulation_steps!r}")  # fmt: skip
        if not float(self.norm_type) > 0:
            raise TrainingOptionError(f"norm_type must be positive (2.0, 1.0 or inf), not {self.norm_type!r}")

    @contextlib.contextmanager
    def forward_context(self, device: torch.device) -> Iterator[None]:
        """Around the model and the loss: autocast if asked for, and a guard against clipping there."""
        dtype = PRECISIONS[self.precision]
        autocast = torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()
        with autocast, _clipping_refused():
            yield

    def clip(self, ordered: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Clip the gradients in place as ``clip_grad_norm_`` would: ``ordered`` pairs each traced
        parameter that has a gradient with it, in the model's parameter order."""
        if self.max_grad_norm is None:
            return
        params = [param for param, _ in ordered]
        for param, grad in ordered:
            param.grad = grad
        try:
            _ORIGINAL_CLIP(params, self.max_grad_norm, norm_type=self.norm_type)
        finally:
            for param in params:
                param.grad = None


_ORIGINAL_CLIP = torch.nn.utils.clip_grad_norm_


def _refuse_clipping(*_: object, **__: object) -> None:
    raise CaptureError(
        "the loss function clips gradients, which do not exist before backward (it would clip nothing); "
        "remove the clip_grad_norm_ call and pass max_grad_norm= to mutwo.optimize (or to the YAML config)"
    )


@contextlib.contextmanager
def _clipping_refused() -> Iterator[None]:
    """While the model and the loss are traced, gradient clipping is refused in one sentence."""
    modules = (torch.nn.utils, torch.nn.utils.clip_grad)
    names = ("clip_grad_norm_", "clip_grad_value_")
    saved = [(module, name, getattr(module, name)) for module in modules for name in names]
    try:
        for module, name, _ in saved:
            setattr(module, name, _refuse_clipping)
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)
