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

On CUDA, where torch.optim defaults to its multi-tensor (``foreach``) form, :func:`update_foreach`
updates a whole bucket of parameters with ``torch._foreach_*`` ops instead, as torch.optim's
``_multi_tensor_*`` functions do: a handful of kernels per bucket rather than a dozen per
parameter, which would make the captured step launch-bound. :func:`uses_foreach` picks the form
torch.optim would pick for the group.

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


def uses_foreach(group: dict[str, Any], params: list[torch.Tensor]) -> bool:
    """Whether to update ``group`` with :func:`update_foreach`, as eager torch.optim would.

    ``foreach=True`` takes it; ``foreach=None`` is torch.optim's default, foreach when every
    parameter is a CUDA tensor, unless the learning rate is a tensor. ``capturable`` groups keep
    their step counts on the device and take the single-tensor form here.
    """
    if group.get("foreach") is False or group.get("capturable"):
        return False
    if group.get("foreach"):
        return True
    return (not isinstance(group["lr"], torch.Tensor) and bool(params)
            and all(p.device.type == "cuda" for p in params))  # fmt: skip


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


def update_foreach(
    spec: OptimizerSpec,
    group: dict[str, Any],
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    states: list[dict[str, torch.Tensor]],
    lr: torch.Tensor,
) -> None:
    """Update a bucket of parameters of one group, device and dtype in place, as torch.optim's
    ``_multi_tensor_sgd`` / ``_multi_tensor_adam`` do; ``lr`` is a 0-dim float64 CPU tensor.

    For Adam, every parameter of the bucket must have the same step count (the capture buckets
    them so): the bias corrections are then one number for the bucket, applied with one kernel.
    """
    if spec.algorithm == "sgd":
        _sgd_foreach(group, params, grads, states, lr)
    else:
        _adam_foreach(group, params, grads, states, lr, decoupled=spec.algorithm == "adamw")


def _sgd_foreach(group: dict[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor],
                 states: list[dict[str, torch.Tensor]], lr: torch.Tensor) -> None:  # fmt: skip
    momentum, weight_decay = group["momentum"], group["weight_decay"]
    if group["maximize"]:
        grads = torch._foreach_neg(grads)
    if weight_decay != 0:
        grads = torch._foreach_add(grads, params, alpha=weight_decay)
    if momentum != 0:
        bufs = [state["momentum_buffer"] for state in states]
        torch._foreach_mul_(bufs, momentum)
        torch._foreach_add_(bufs, grads, alpha=1 - group["dampening"])
        # Out of place: torch.optim adds into the .grad tensors, which the graph returns.
        grads = torch._foreach_add(grads, bufs, alpha=momentum) if group["nesterov"] else bufs
    torch.ops.mutwo.foreach_add_scaled_(params, grads, -lr)


def _adam_foreach(group: dict[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor],
                  states: list[dict[str, torch.Tensor]], lr: torch.Tensor, *, decoupled: bool) -> None:  # fmt: skip
    beta1, beta2 = float(group["betas"][0]), float(group["betas"][1])
    weight_decay, eps = group["weight_decay"], group["eps"]
    steps = [state["step"] for state in states]
    exp_avgs = [state["exp_avg"] for state in states]
    exp_avg_sqs = [state["exp_avg_sq"] for state in states]
    if group["maximize"]:
        grads = torch._foreach_neg(grads)
    torch._foreach_add_(steps, 1)
    if weight_decay != 0:
        if decoupled:
            # A CPU 0-dim scalar is read with .item(), like torch.optim's Python number.
            torch._foreach_mul_(params, 1 - lr * weight_decay)
        else:
            grads = torch._foreach_add(grads, params, alpha=weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
    # The bucket shares one step count: Python-number arithmetic on it, in float64 tensors.
    step = steps[0].to(dtype=torch.float64)
    bias_correction1 = 1 - torch.pow(beta1, step)
    bias_correction2_sqrt = (1 - torch.pow(beta2, step)).sqrt()
    neg_step_size = -(lr / bias_correction1)
    if group["amsgrad"]:
        max_exp_avg_sqs = [state["max_exp_avg_sq"] for state in states]
        torch._foreach_maximum_(max_exp_avg_sqs, exp_avg_sqs)
        denoms = torch._foreach_sqrt(max_exp_avg_sqs)
    else:
        denoms = torch._foreach_sqrt(exp_avg_sqs)
    torch.ops.mutwo.foreach_div_(denoms, bias_correction2_sqrt)
    torch._foreach_add_(denoms, eps)
    torch.ops.mutwo.foreach_addcdiv_(params, exp_avgs, denoms, neg_step_size)


# The multi-tensor updates that take a step-dependent Python number in torch.optim are custom ops:
# aten's tensor-scalar overloads of them cannot be traced with fake tensors (their fake kernels
# move the scalar to the meta device, then refuse it) or round differently. Their scalar is a
# 0-dim CPU tensor, read on the host, so no device synchronisation happens.


@torch.library.custom_op("mutwo::foreach_add_scaled_", mutates_args=("params",))
def foreach_add_scaled_(params: list[torch.Tensor], tensors: list[torch.Tensor], alpha: torch.Tensor) -> None:
    """``params[i] += alpha * tensors[i]``, exactly as torch.optim's ``_foreach_add_(params, grads, alpha=-lr)``."""
    torch._foreach_add_(params, tensors, alpha=alpha.item())


@foreach_add_scaled_.register_fake
def _foreach_add_scaled_fake(params: list[torch.Tensor], tensors: list[torch.Tensor], alpha: torch.Tensor) -> None:
    return None


@torch.library.custom_op("mutwo::foreach_div_", mutates_args=("tensors",))
def foreach_div_(tensors: list[torch.Tensor], value: torch.Tensor) -> None:
    """``tensors[i] /= value``, exactly as torch.optim's ``_foreach_div_(denoms, [bias_correction2_sqrt, ...])``
    (on CUDA, aten's one-scalar overload multiplies by the reciprocal instead, which rounds differently)."""
    torch._foreach_div_(tensors, [value.item()] * len(tensors))


@foreach_div_.register_fake
def _foreach_div_fake(tensors: list[torch.Tensor], value: torch.Tensor) -> None:
    return None


@torch.library.custom_op("mutwo::foreach_addcdiv_", mutates_args=("params",))
def foreach_addcdiv_(params: list[torch.Tensor], tensor1: list[torch.Tensor], tensor2: list[torch.Tensor],
                     value: torch.Tensor) -> None:  # fmt: skip
    """``params[i] += value * tensor1[i] / tensor2[i]``, exactly as torch.optim's
    ``_foreach_addcdiv_(params, exp_avgs, denoms, [step_size, ...])``."""
    torch._foreach_addcdiv_(params, tensor1, tensor2, [value.item()] * len(params))


@foreach_addcdiv_.register_fake
def _foreach_addcdiv_fake(params: list[torch.Tensor], tensor1: list[torch.Tensor], tensor2: list[torch.Tensor],
                          value: torch.Tensor) -> None:  # fmt: skip
    return None
