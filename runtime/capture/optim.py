"""The optimizer update inside the captured iteration: torch.optim's own ``step()``, traced.

The captured iteration calls the optimizer's own ``step`` — whatever its class, its single-tensor
or multi-tensor (foreach) form, its options — on the traced parameters, gradients and state: the
param groups and ``optimizer.state`` are pointed at the traced tensors for the duration of the call.
What torch.optim computes on the host from the step count and the learning rate (``lr / (1 -
beta1 ** step)``) stays symbolic (:mod:`mutwo.runtime.capture.host_scalars`), so step counts and learning
rates are inputs of the graph, never constants, and the captured update is bitwise equal to eager
``optimizer.step()`` on every device: it performs the same operations with the same numbers. So are
the other hyperparameters schedulers change (:data:`SCHEDULED`: OneCycleLR and CyclicLR cycle
``momentum`` or ``betas``); the rest (eps, weight decay) are read when the step is captured.

State is created before capture as the optimizer's first step would create it (its own
``_init_group``). What an optimizer only creates inside ``step`` (SGD's momentum buffer, which
starts as a copy of the first gradient) is *fresh* state: the first captured iteration creates it
in the graph and writes it into tensors allocated for it, and the next iteration is captured again
with the state in place. SGD with ``dampening=0`` avoids that second capture: its buffer starts at
``-0.0``, and ``-0.0 * momentum + grad`` equals the first gradient bit for bit, signed zeros
included.

A step recorded as a CUDA graph (``graphed``) cannot read host numbers at replay: a kernel
launched with one keeps the value it had at recording. Where the optimizer has torch.optim's
``capturable`` option, mutwo traces its capturable form, whatever the user's group says
(:func:`made_capturable`): the learning rate is fed as a float64 tensor on the parameters' device
whose value mutwo writes from ``group["lr"]`` at every call, and the state torch.optim keeps on the
CPU for a non-capturable group (step counts, NAdam's ``mu_product``) lives on the parameter's
device in ``optimizer.state`` itself, where torch.optim keeps it for a capturable group
(:mod:`mutwo.runtime.capture.device_state`). The user's param groups keep their own ``capturable`` and float
learning rate; the update is the one torch.optim's capturable form computes, bit for bit.
"""

from __future__ import annotations

import contextlib
import inspect
import re
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.optim import optimizer as optimizer_module

from mutwo.runtime.capture.host_expressions import HostScalar
from mutwo.runtime.capture.host_scalars import HostScalarMode
from mutwo.runtime.capture.tracing import not_compiling

#: Optimizers whose update one captured iteration cannot express, and why.
REFUSED = {
    "LBFGS": "re-evaluates the model through a closure several times per step, which one captured iteration "
             "cannot express; use another optimizer, or train eagerly",
    "SparseAdam": "needs sparse gradients, which the captured backward does not produce; use torch.optim.Adam",
}  # fmt: skip


#: The hyperparameters schedulers change while training: every learning-rate scheduler changes
#: ``lr``; OneCycleLR and CyclicLR with ``cycle_momentum`` (their default) change ``momentum``, or the
#: first of ``betas``, at every step. Each, when a Python number, is an input of the graph read from
#: ``param_groups`` at every call, so a change captures nothing again. In a group traced capturable
#: (the user's, or one mutwo makes so for a CUDA graph, which cannot read host numbers) only ``lr``
#: is, as a device tensor (a float learning rate of the user's capturable group stays a host number).
SCHEDULED = ("lr", "momentum", "betas")

#: (key, index into a tuple of numbers or None): one scheduled hyperparameter's input.
ScheduledEntry = tuple[str, int | None]

#: A scheduled hyperparameter's input label (:func:`scheduled_label`): ``lr:group0``, ``betas[1]:group2``.
SCHEDULED_LABEL = re.compile(r"(lr|momentum|betas\[\d+\]):group\d+")


class UnsupportedOptimizerError(ValueError):
    """The optimizer, or one of its options, has no traceable update here."""


class FreshStateCreated(Exception):
    """Raised while tracing: ``step()`` created state tensors the graph must then keep (see the module
    docstring). ``created`` maps (parameter name, state name) to the traced tensor."""

    def __init__(self, created: dict[tuple[str, str], torch.Tensor]) -> None:
        super().__init__(f"{len(created)} state tensors created by the optimizer step")
        self.created = created


def check_supported(optimizer: torch.optim.Optimizer, graphed: bool = False) -> None:
    """Refuse, in one sentence, an optimizer whose ``step()`` cannot be traced into the iteration
    (``graphed``: into a step recorded as a CUDA graph, see the module docstring)."""
    name = type(optimizer).__name__
    for cls in type(optimizer).__mro__:
        if cls.__name__ in REFUSED and cls.__module__.startswith("torch.optim"):
            raise UnsupportedOptimizerError(f"torch.optim.{cls.__name__} {REFUSED[cls.__name__]}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UnsupportedOptimizerError(f"{name} is not a torch.optim.Optimizer")
    for flag in ("differentiable", "fused"):
        if any(group.get(flag) for group in optimizer.param_groups):
            raise UnsupportedOptimizerError(f"{name}({flag}=True) is not supported; construct it with {flag}=False")
    hooks = (optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks,
             optimizer_module._global_optimizer_pre_hooks, optimizer_module._global_optimizer_post_hooks)  # fmt: skip
    if any(hooks):
        raise UnsupportedOptimizerError(
            f"{name} has optimizer step hooks, which would not run in the captured step; remove them "
            "(register_step_pre_hook, register_step_post_hook)"
        )
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor) and not traced_capturable(group, graphed):
            raise UnsupportedOptimizerError(
                f"{name} has a tensor learning rate, which torch.optim reads on the host at every step; give it "
                "as a Python float (mutwo feeds the learning rate to the graph as a tensor anyway, so schedulers "
                "need no recapture), or use capturable=True on a GPU"
            )


def made_capturable(group: dict[str, Any], graphed: bool) -> bool:
    """Whether mutwo traces ``group`` in torch.optim's capturable form although the group is not
    capturable: the step is recorded as a CUDA graph (``graphed``) and the optimizer has the
    option (Adam, AdamW, Adamax, NAdam, RAdam, ASGD, Adadelta, RMSprop, Rprop; not SGD, Adagrad).
    Its learning rate is then fed as a tensor on the parameters' device (:func:`scheduled_inputs`)."""
    return graphed and "capturable" in group and not group["capturable"]


def traced_capturable(group: dict[str, Any], graphed: bool) -> bool:
    """Whether ``group``'s step is traced in torch.optim's capturable form: the user's group is
    capturable, or mutwo makes it so for a CUDA graph (:func:`made_capturable`)."""
    return bool(group.get("capturable")) or made_capturable(group, graphed)


def init_state(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    """Create the missing state of ``params`` exactly as the optimizer's first ``step()`` would."""
    missing = {p for p in params if not optimizer.state.get(p)}
    if not missing:
        return
    init_group = getattr(optimizer, "_init_group", None)
    if init_group is not None:
        lists = len(inspect.signature(init_group).parameters) - 1  # (group, then lists it fills)
        saved = {p: p.grad for p in missing}  # the real gradients, if any, are put back
        try:
            for p in missing:
                p.grad = torch.zeros_like(p)
            for group in optimizer.param_groups:
                if any(p in saved for p in group["params"]):
                    init_group(group, *([] for _ in range(lists)))
        finally:
            for p, grad in saved.items():
                p.grad = grad
    if isinstance(optimizer, torch.optim.SGD):
        for group in optimizer.param_groups:
            if group["momentum"] != 0 and group["dampening"] == 0:
                for p in group["params"]:
                    if p in missing and "momentum_buffer" not in optimizer.state[p]:
                        optimizer.state[p]["momentum_buffer"] = torch.full_like(
                            p, -0.0, memory_format=torch.preserve_format)


def state_names(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> tuple[str, ...]:
    """The state tensors of ``param`` the graph takes as inputs, in the optimizer's order."""
    state = optimizer.state.get(param, {})
    for key, value in state.items():
        if not isinstance(value, torch.Tensor) and value is not None:
            raise UnsupportedOptimizerError(
                f"{type(optimizer).__name__} keeps state '{key}' as a Python {type(value).__name__}, which the "
                "graph cannot update in place; load a state dict saved by a recent torch or start afresh"
            )
    return tuple(key for key, value in state.items() if isinstance(value, torch.Tensor))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def scheduled_entries(group: dict[str, Any], graphed: bool = False) -> list[ScheduledEntry]:
    """The graph inputs of ``group``'s scheduled hyperparameters (:data:`SCHEDULED`), in order:
    the learning rate always; ``momentum`` (unless 0: SGD without momentum, whose graph has no
    use for it; a scheduler that turns it on captures once more) and each of ``betas`` when the
    group has them as Python numbers and is not traced capturable (:func:`traced_capturable`;
    ``graphed``: the step is recorded as a CUDA graph)."""
    entries: list[ScheduledEntry] = [("lr", None)]
    if traced_capturable(group, graphed):
        return entries
    if _is_number(group.get("momentum")) and group["momentum"] != 0:
        entries.append(("momentum", None))
    betas = group.get("betas")
    if isinstance(betas, tuple) and all(_is_number(beta) for beta in betas):
        entries += [("betas", index) for index in range(len(betas))]
    return entries


def _value_of(group: dict[str, Any], entry: ScheduledEntry) -> Any:
    """The group's value of one scheduled hyperparameter (an entry of ``betas`` by its index)."""
    key, index = entry
    return group[key] if index is None else group[key][index]


def scheduled_label(entry: ScheduledEntry, group_index: int) -> str:
    """The input's label: ``lr:group0``, ``momentum:group0``, ``betas[0]:group0``."""
    key, index = entry
    return f"{key}:group{group_index}" if index is None else f"{key}[{index}]:group{group_index}"


def scheduled_inputs(group: dict[str, Any], graphed: bool = False) -> list[torch.Tensor]:
    """The 0-dim tensors fed to the graph for ``group``'s scheduled hyperparameters: a Python
    number as a CPU tensor whose ``.item()`` is that very number (float64 for a float, int64 for
    an int: the step computes with the number eager would), a tensor learning rate as it is. The
    learning rate of a group mutwo makes capturable (:func:`made_capturable`) is made on the
    parameters' device, a Python number as float64 (the value ``graphable_optimizer`` gives a
    capturable optimizer's ``lr``, so the two compute the same bits)."""
    values = []
    on_device = made_capturable(group, graphed)
    for entry in scheduled_entries(group, graphed):
        key, value = entry[0], _value_of(group, entry)
        if key == "lr" and on_device:
            values.append(_device_rate(value, next((p.device for p in group["params"]), torch.device("cpu"))))
        elif isinstance(value, torch.Tensor):
            values.append(value.detach().reshape(()).clone())
        else:
            values.append(torch.tensor(value, dtype=torch.float64 if key == "lr" or isinstance(value, float)
                                       else torch.int64))  # fmt: skip
    return values


def _device_rate(value: Any, device: torch.device) -> torch.Tensor:
    """A learning rate as a 0-dim tensor on ``device``: a number as float64, a tensor in its dtype."""
    if isinstance(value, torch.Tensor):
        return value.detach().reshape(()).to(device, copy=True)
    return torch.tensor(value, dtype=torch.float64, device=device)


def scheduled_kinds(group: dict[str, Any], graphed: bool = False) -> dict[str, str]:
    """For the hyperparameters of ``group`` that are graph inputs, the Python type of their values
    (a graph is specific to those types, not to the values); ``graphed`` as for :func:`scheduled_entries`."""
    kinds: dict[str, list[str]] = {}
    for entry in scheduled_entries(group, graphed):
        kinds.setdefault(entry[0], []).append(type(_value_of(group, entry)).__name__)
    return {key: ",".join(names) for key, names in kinds.items()}


def _traced_values(optimizer: torch.optim.Optimizer, inputs: list[torch.Tensor],
                   graphed: bool) -> list[dict[str, Any]]:  # fmt: skip
    """Per group, the values the traced step reads for its scheduled hyperparameters: a Python
    number read from its input (a host number of the graph, like a step count), a tensor learning
    rate (capturable groups only, and those mutwo makes capturable) as the tensor, as torch.optim
    computes with it."""
    values: list[dict[str, Any]] = []
    position = 0
    for group in optimizer.param_groups:
        read: dict[str, Any] = {}
        device_rate = made_capturable(group, graphed)
        for key, index in scheduled_entries(group, graphed):
            tensor = inputs[position]
            position += 1
            as_tensor = isinstance(group[key], torch.Tensor) or (key == "lr" and device_rate)
            value = tensor if as_tensor else tensor.item()
            if index is None:
                read[key] = value
            else:
                read[key] = (*read.get(key, ()), value)
        values.append(read)
    return values


def _step_function(optimizer: torch.optim.Optimizer) -> Callable[[torch.optim.Optimizer], Any]:
    """The class's ``step`` without torch.optim's profiling and hook wrapper (hooks are refused)."""
    step = type(optimizer).step
    return step.__wrapped__ if getattr(step, "hooked", False) else step  # type: ignore[attr-defined]


#: The attribute torch.optim sets on an optimizer once it has warned that a capturable step ran
#: outside a CUDA graph capture (``Optimizer._cuda_graph_capture_health_check``).
_WARNED_UNCAPTURED = "_warned_capturable_if_run_uncaptured"


@contextlib.contextmanager
def _pointed_at(optimizer: torch.optim.Optimizer, groups: list[list[torch.Tensor]], scheduled: list[dict[str, Any]],
                state: dict[torch.Tensor, dict[str, Any]], graphed: bool = False) -> Iterator[None]:  # fmt: skip
    """Point the param groups and the state at traced tensors and the scheduled hyperparameters at
    their traced values, and back afterwards; with ``graphed``, turn ``capturable`` on in the
    groups mutwo makes capturable (:func:`made_capturable`) for as long.

    A group that leaves ``foreach`` to torch.optim gets the form eager would pick for its real
    parameters (multi-tensor on a GPU): torch.optim decides from the tensors' types, and would
    pick the single-tensor form for traced ones, whose kernels round differently on a GPU.
    """
    made = [made_capturable(group, graphed) for group in optimizer.param_groups]
    saved = [({key: group[key] for key in ("params", *values, *(("capturable",) if m else ()))}, group.get("foreach"))
             for group, values, m in zip(optimizer.param_groups, scheduled, made, strict=True)]  # fmt: skip
    saved_state = optimizer.state
    # torch.optim warns once, and marks the optimizer, when a capturable step runs outside a CUDA
    # graph capture: tracing is not the user's step, and the user's optimizer is not capturable.
    warned = optimizer.__dict__.get(_WARNED_UNCAPTURED, None)
    try:
        for group, params, values, m in zip(optimizer.param_groups, groups, scheduled, made, strict=True):
            if "foreach" in group and group["foreach"] is None and not group.get("fused"):
                group["foreach"] = _eager_foreach(group)
            group.update(values, params=params)
            if m:
                group["capturable"] = True
        if any(made):
            setattr(optimizer, _WARNED_UNCAPTURED, True)
        # Copies: what step() writes must not show in ``state``, which says what existed before.
        optimizer.state = defaultdict(dict, {param: dict(entries) for param, entries in state.items()})
        yield
    finally:
        for group, (entries, foreach) in zip(optimizer.param_groups, saved, strict=True):
            group.update(entries)
            if "foreach" in group:
                group["foreach"] = foreach
        optimizer.state = saved_state
        if any(made):
            if warned is None:
                optimizer.__dict__.pop(_WARNED_UNCAPTURED, None)
            else:
                setattr(optimizer, _WARNED_UNCAPTURED, warned)


def _eager_foreach(group: dict[str, Any]) -> bool:
    """Whether eager torch.optim takes the multi-tensor form for ``group``'s (real) parameters."""
    differentiable = bool(group.get("differentiable", False))
    _, foreach = optimizer_module._default_to_fused_or_foreach(list(group["params"]), differentiable, use_fused=False)
    return bool(foreach)


def traced_step(
    optimizer: torch.optim.Optimizer,
    group_names: list[list[str]],
    params: dict[str, torch.Tensor],
    grads: dict[str, torch.Tensor],
    states: dict[str, dict[str, torch.Tensor]],
    scheduled: list[torch.Tensor],
    decide: Callable[[HostScalar], bool],
    fresh: dict[tuple[str, str], torch.Tensor],
    graphed: bool = False,
) -> None:
    """Run ``optimizer.step()`` on traced tensors: ``group_names`` names each group's parameters,
    ``grads`` holds the gradient of every parameter that has one, ``scheduled`` the inputs of the
    groups' scheduled hyperparameters (:func:`scheduled_entries`, group after group). ``fresh``
    maps (parameter, state name) to the input that receives state the step creates; state it
    creates otherwise raises :class:`FreshStateCreated`. ``graphed``: the step is recorded as a
    CUDA graph, and groups with the option are traced capturable (see the module docstring)."""
    hidden = {(name, key) for name, key in fresh}
    traced_state = {
        params[name]: {key: value for key, value in states.get(name, {}).items() if (name, key) not in hidden}
        for names in group_names for name in names
    }
    with HostScalarMode(decide), not_compiling():
        values = _traced_values(optimizer, scheduled, graphed)
        with _pointed_at(optimizer, [[params[n] for n in names] for names in group_names], values, traced_state,
                         graphed):  # fmt: skip
            for name, grad in grads.items():
                params[name].grad = grad
            try:
                _step_function(optimizer)(optimizer)
            finally:
                for name in grads:
                    params[name].grad = None
            after = optimizer.state
    created: dict[tuple[str, str], torch.Tensor] = {}
    for names in group_names:
        for name in names:
            before = traced_state.get(params[name], {})
            for key, value in after.get(params[name], {}).items():
                if isinstance(value, torch.Tensor) and before.get(key) is not value:
                    created[(name, key)] = value
    if set(created) != set(fresh):
        raise FreshStateCreated(created)
    for entry, value in created.items():
        fresh[entry].copy_(value)
