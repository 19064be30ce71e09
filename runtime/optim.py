"""Optimizer updates written with plain tensor ops, traceable into the captured iteration.

torch.optim reads the step count and learning rate as Python numbers, which tracing would bake
into the graph as constants, and its ``capturable`` variant refuses CPU tensors. These updates
instead read the learning rate and step count from tensors fed to the graph, and reproduce
torch.optim's single-tensor arithmetic operation by operation so that, on CPU, the captured
iteration is bitwise equal to eager ``torch.optim``:

- Python-number arithmetic on the step count and learning rate (``1 - beta1 ** step``, ``lr /
  bias_correction1``...) is done on 0-dim float64 tensors, which round like Python floats.
- An op that takes a step-dependent Python scalar is replaced by one with the same rounding:
  ``add_(g, alpha=-lr)`` by ``addcmul_(g, -lr)`` and ``addcdiv_(m, d, value=-s)`` by
  ``add_(m * -s / d)``.

Constants that do not change between iterations (betas, eps, momentum, weight decay) stay
constants of the graph: changing them in ``param_groups`` needs a new capture.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED = "torch.optim.SGD, torch.optim.Adam and torch.optim.AdamW"


class UnsupportedOptimizerError(ValueError):
    """The optimizer, or one of its options, has no traceable update here."""


@dataclass(frozen=True)
class OptimizerSpec:
    """What the capture needs to know about a torch.optim optimizer."""

    algorithm: str  #: 'sgd', 'adam' or 'adamw'
    state_names: tuple[str, ...]  #: per-parameter state tensors, in graph-input order


def describe(optimizer: torch.optim.Optimizer) -> OptimizerSpec:
    """Check that ``optimizer`` is supported and say which state each parameter carries."""
    # AdamW subclasses Adam in recent torch releases: test it first.
    if isinstance(optimizer, torch.optim.AdamW) or (isinstance(optimizer, torch.optim.Adam) and any(
            g.get("decoupled_weight_decay") for g in optimizer.param_groups)):  # fmt: skip
        algorithm = "adamw"
    elif isinstance(optimizer, torch.optim.Adam):
        algorithm = "adam"
    elif isinstance(optimizer, torch.optim.SGD):
        algorithm = "sgd"
    else:
        raise UnsupportedOptimizerError(
            f"optimizer {type(optimizer).__name__} is not supported; use {SUPPORTED}"
        )
    groups = optimizer.param_groups
    for group in groups:
        for flag in ("differentiable", "fused"):
            if group.get(flag):
                raise UnsupportedOptimizerError(f"{type(optimizer).__name__}({flag}=True) is not supported; "
                                                f"construct it with {flag}=False")  # fmt: skip
        if algorithm == "sgd" and group["momentum"] != 0 and group["dampening"] != 0:
            missing = [p for p in group["params"] if "momentum_buffer" not in optimizer.state.get(p, {})]
            if missing:
                raise UnsupportedOptimizerError(
                    "SGD with dampening starts its momentum buffer from the first gradient, which one "
                    "graph cannot express; run one eager optimizer step first or set dampening=0"
                )
    if algorithm == "sgd":
        has_momentum = any(group["momentum"] != 0 for group in groups)
        names: tuple[str, ...] = ("momentum_buffer",) if has_momentum else ()
    else:
        amsgrad = any(group["amsgrad"] for group in groups)
        names = ("step", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())
    return OptimizerSpec(algorithm, names)


def state_names_for(spec: OptimizerSpec, group: dict[str, Any]) -> tuple[str, ...]:
    """The state tensors one parameter of ``group`` carries."""
    if spec.algorithm == "sgd":
        return ("momentum_buffer",) if group["momentum"] != 0 else ()
    return ("step", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())


def init_state(optimizer: torch.optim.Optimizer, spec: OptimizerSpec) -> None:
    """Create missing per-parameter state exactly as torch.optim's first step would.

    SGD's momentum buffer starts at -0.0: with dampening 0 (checked by :func:`describe`), the
    first update ``-0.0 * momentum + grad`` equals torch.optim's ``clone(grad)`` bit for bit,
    signed zeros included (``-0.0 + g`` is ``g`` for every ``g``; ``+0.0 + -0.0`` would not be).
    """
    for group in optimizer.param_groups:
        names = state_names_for(spec, group)
        for param in group["params"]:
            if not param.requires_grad or not names:
                continue
            state = optimizer.state[param]
            if all(name in state for name in names):
                continue
            if spec.algorithm == "sgd":
                state["momentum_buffer"] = torch.full_like(param, -0.0, memory_format=torch.preserve_format)
                continue
            if group["capturable"]:
                state["step"] = torch.zeros((), dtype=_scalar_dtype(), device=param.device)
            else:
                state["step"] = torch.tensor(0.0, dtype=_scalar_dtype(), device="cpu")
            for name in names[1:]:
                state[name] = torch.zeros_like(param, memory_format=torch.preserve_format)


def _scalar_dtype() -> torch.dtype:
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def update(
    spec: OptimizerSpec,
    group: dict[str, Any],
    param: torch.Tensor,
    grad: torch.Tensor,
    state: dict[str, torch.Tensor],
    lr: torch.Tensor,
) -> None:
    """Update ``param`` and its ``state`` in place; ``lr`` is a 0-dim float64 tensor."""
    if spec.algorithm == "sgd":
        _sgd(group, param, grad, state, lr)
    else:
        _adam(group, param, grad, state, lr, decoupled=spec.algorithm == "adamw")


def _sgd(group: dict[str, Any], param: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor],
         lr: torch.Tensor) -> None:  # fmt: skip
    momentum, weight_decay = group["momentum"], group["weight_decay"]
    if group["maximize"]:
        grad = -grad
    if weight_decay != 0:
        grad = grad.add(param, alpha=weight_decay)
    if momentum != 0:
        buf = state["momentum_buffer"]
        buf.mul_(momentum).add_(grad, alpha=1 - group["dampening"])
        grad = grad.add(buf, alpha=momentum) if group["nesterov"] else buf
    # torch.optim: param.add_(grad, alpha=-lr); addcmul_ with a 0-dim tensor rounds the same.
    param.addcmul_(grad, -lr)


def _adam(group: dict[str, Any], param: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor],
          lr: torch.Tensor, *, decoupled: bool) -> None:  # fmt: skip
    beta1, beta2 = group["betas"]
    beta1, beta2 = float(beta1), float(beta2)
    weight_decay, eps = group["weight_decay"], group["eps"]
    if group["maximize"]:
        grad = -grad
    step_t, exp_avg, exp_avg_sq = state["step"], state["exp_avg"], state["exp_avg_sq"]
    step_t.add_(1)
    if weight_decay != 0:
        if decoupled:
            param.mul_(1 - lr * weight_decay)
        else:
            grad = grad.add(param, alpha=weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step = step_t.to(device=lr.device, dtype=torch.float64)
    bias_correction1 = 1 - torch.pow(beta1, step)
    bias_correction2 = 1 - torch.pow(beta2, step)
    # A tensor learning rate keeps its dtype in torch.optim (the bias correction is a Python
    # number, which does not promote): divide in that dtype.
    step_size = lr / bias_correction1.to(lr.dtype)
    bias_correction2_sqrt = bias_correction2.sqrt()
    if group["amsgrad"]:
        max_exp_avg_sq = state["max_exp_avg_sq"]
        max_exp_avg_sq.copy_(torch.maximum(max_exp_avg_sq, exp_avg_sq))
        denom = (max_exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    else:
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    # torch.optim: param.addcdiv_(exp_avg, denom, value=-step_size). The CPU kernel computes
    # param + ((-step_size) * exp_avg) / denom; the CUDA kernel fma(-step_size, exp_avg / denom,
    # param), which addcmul_ with a scalar tensor reproduces.
    neg_step_size = (-step_size).to(param.dtype)
    if param.device.type == "cuda":
        param.addcmul_(exp_avg / denom, neg_step_size)
    else:
        param.add_(exp_avg * neg_step_size / denom)
