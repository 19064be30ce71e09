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
  so the memory simulator and ``select`` see them live throughout;
- ``grad_scaler``: a ``torch.amp.GradScaler``, for the eager loop ``scaler.scale(loss).backward();
  scaler.unscale_(optimizer); clip; scaler.step(optimizer); scaler.update()``. The scaler's scale
  and growth tracker are inputs of the graph, updated in place with torch's own
  ``_amp_update_scale_``; the gradients are unscaled and checked with
  ``_amp_foreach_non_finite_check_and_unscale_``. Where eager skips ``optimizer.step()`` on an
  inf or NaN (a host sync), the graph steps anyway and puts back the parameters and optimizer
  state it saved before (``torch.where`` on the found-inf flag: the same bits, and no branch on
  the host): that costs a copy of the updated parameters and their state during the step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mutwo.runtime.capture.tracing import CaptureError

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
    grad_scaler: Any = None  #: a ``torch.amp.GradScaler`` or None

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
        if self.grad_scaler is not None and not isinstance(self.grad_scaler, torch.amp.GradScaler):
            raise TrainingOptionError("grad_scaler must be a torch.amp.GradScaler, not "
                                      f"{type(self.grad_scaler).__name__}")  # fmt: skip
        if not float(self.norm_type) > 0:
            raise TrainingOptionError(f"norm_type must be positive (2.0, 1.0 or inf), not {self.norm_type!r}")

    @contextlib.contextmanager
    def forward_context(self, device: torch.device) -> Iterator[None]:
        """Around the model and the loss: autocast if asked for, and a guard against clipping there."""
        dtype = PRECISIONS[self.precision]
        autocast = torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()
        with autocast, _clipping_refused():
            yield

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The grad scaler, when there is one and it is enabled (a disabled one changes nothing)."""
        return self.grad_scaler if self.grad_scaler is not None and self.grad_scaler.is_enabled() else None

    def scaler_state(self, device: torch.device) -> list[torch.Tensor]:
        """The scaler's scale and growth tracker (created as its first ``scale()`` would), the
        graph's inputs."""
        scaler = self.scaler
        if scaler is None:
            return []
        if scaler._scale is None:
            scaler._lazy_init_scale_growth_tracker(device)
        return [scaler._scale, scaler._growth_tracker]  # type: ignore[list-item]

    def unscale(self, grads: Sequence[torch.Tensor], scale: torch.Tensor) -> torch.Tensor:
        """``scaler.unscale_(optimizer)`` on the traced gradients (in the optimizer's order): unscale
        them in place and return the found-inf flag."""
        inv_scale = scale.double().reciprocal().float()
        found_inf = torch.full((), 0.0, dtype=torch.float32, device=scale.device)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for grad in grads:
            if grad.device != scale.device:
                raise CaptureError("a grad scaler needs the parameters on one device; mutwo captures one device")
            by_dtype.setdefault(grad.dtype, []).append(grad)
        for group in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(group, found_inf, inv_scale)
        return found_inf

    @contextlib.contextmanager
    def skipped_on_inf(self, found_inf: torch.Tensor, written: Sequence[torch.Tensor]) -> Iterator[None]:
        """Around the optimizer step: afterwards, ``written`` hold their values from before wherever
        ``found_inf`` is set, as if the step had been skipped."""
        saved = [tensor.clone() for tensor in written]
        yield
        flags: dict[torch.device, torch.Tensor] = {}
        for tensor, before in zip(written, saved, strict=True):
            if tensor.device not in flags:
                flags[tensor.device] = found_inf.to(tensor.device) != 0
            tensor.copy_(torch.where(flags[tensor.device], before, tensor))

    def update_scale(self, scale: torch.Tensor, growth_tracker: torch.Tensor, found_inf: torch.Tensor) -> None:
        """``scaler.update()``: torch's own in-place scale update."""
        scaler = self.scaler
        torch._amp_update_scale_(scale, growth_tracker, found_inf, scaler._growth_factor,  # type: ignore[union-attr]
                                 scaler._backoff_factor, scaler._growth_interval)  # type: ignore[union-attr]  # fmt: skip

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
