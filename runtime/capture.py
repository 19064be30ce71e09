"""Capture one whole training iteration — forward, loss, backward, optimizer step — as one graph.

The iteration is traced with ``make_fx`` over fake tensors into a single fx graph of aten ops:

* graph inputs (placeholders), in this order: parameters, buffers, per-parameter optimizer state,
  one 0-dim float64 learning rate per parameter group, then the tensors of the batch; each has an
  :class:`InputSlot` naming what the runtime feeds it;
* the forward runs through ``torch.func.functional_call``, the backward is ``torch.autograd.grad``
  traced into explicit aten ops, the optimizer update is :mod:`mutwo.runtime.optim`;
* parameters, buffers and optimizer state are updated **in place inside the graph** (``add_``,
  ``lerp_``, batch norm's running statistics...), exactly where eager PyTorch updates them, so old
  and new values never coexist; the graph returns ``(loss, *gradients)``;
* the forward/backward and backward/optimizer boundaries are recorded while tracing: every fx
  node gets ``meta["mutwo_phase"]``, set from the tracer's own graph when each phase ends, so no
  marker op is needed and none can be reordered or dropped.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx
from torch.utils import _pytree as pytree

from mutwo.ir.from_fx import PHASE_META
from mutwo.ir.node import NodeKind, Phase
from mutwo.runtime import optim as functional_optim
from mutwo.runtime.collectives import GradientBuckets, broadcast_coalesced
from mutwo.runtime.input_aliasing import refuse_written_aliases, separate_aliases
from mutwo.runtime.rnn import run_rnn_layers_in_training_mode
from mutwo.runtime.tracing import (
    CaptureError,
    compiler_tracing,
    debug_enabled,
    explain_capture_failure,
    forbid_value_dependent_shapes,
    quiet_torch_errors,
)

if TYPE_CHECKING:
    from mutwo.runtime.distributed import DataParallel

LossFn = Callable[[Any, Any], torch.Tensor]


class StaleCaptureError(RuntimeError):
    """The live model or optimizer no longer matches what the step was captured from."""


@dataclass(frozen=True)
class InputSlot:
    """What the runtime feeds one placeholder: its kind and qualified name."""

    kind: NodeKind
    label: str


@dataclass
class CapturedStep:
    """The traced iteration and how to feed it.

    ``slots[i]`` describes placeholder ``i``; ``gradient_labels[j]`` names the parameter whose
    gradient is output ``j + 1`` (output 0 is the loss); ``constants`` are tensors the model
    holds outside parameters and buffers, fed like inputs.
    """

    graph_module: fx.GraphModule
    slots: list[InputSlot]
    gradient_labels: list[str]
    batch_spec: pytree.TreeSpec
    constants: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class StepBinding:
    """Ties a model, its optimizer and batches to the slots of a captured step."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: LossFn
    spec: functional_optim.OptimizerSpec
    param_names: list[str]
    buffer_names: list[str]
    trainable: list[str]  #: names of the parameters the optimizer updates, in group order
    group_of: dict[str, int]  #: trainable parameter name -> index of its param group
    foreach_layout: list[list[str]] = field(default_factory=list)  #: buckets of the multi-tensor update
    checked_steps: list[int] = field(default_factory=list)  #: ids of the step tensors last checked
    data_parallel: DataParallel | None = None  #: how gradients are averaged across ranks, if they are
    gradient_buckets: list[list[str]] = field(default_factory=list)  #: the all-reduce buckets, in issue order

    @classmethod
    def bind(cls, model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn,
             data_parallel: DataParallel | None = None) -> StepBinding:  # fmt: skip
        spec = functional_optim.describe(optimizer)
        params = dict(model.named_parameters())
        name_of = {id(p): name for name, p in params.items()}
        trainable: list[str] = []
        group_of: dict[str, int] = {}
        for index, group in enumerate(optimizer.param_groups):
            for param in group["params"]:
                if id(param) not in name_of:
                    raise CaptureError("the optimizer holds a tensor that is not a parameter of the model; "
                                       "build the optimizer from model.parameters()")  # fmt: skip
                name = name_of[id(param)]
                if param.requires_grad:
                    trainable.append(name)
                    group_of[name] = index
        return cls(model, optimizer, loss_fn, spec, list(params), [n for n, _ in model.named_buffers()],
                   trainable, group_of, data_parallel=data_parallel)  # fmt: skip

    # -- the flat input list ---------------------------------------------------------------
    def state_names(self, name: str) -> tuple[str, ...]:
        group = self.optimizer.param_groups[self.group_of[name]]
        return functional_optim.state_names_for(self.spec, group)

    def slots(self, batch: Any) -> list[InputSlot]:
        slots = [InputSlot(NodeKind.PARAMETER, n) for n in self.param_names]
        slots += [InputSlot(NodeKind.BUFFER, n) for n in self.buffer_names]
        slots += [InputSlot(NodeKind.OPTIMIZER_STATE, f"{n}:{s}") for n in self.trainable for s in self.state_names(n)]
        slots += [InputSlot(NodeKind.OTHER, f"lr:group{i}") for i in range(len(self.optimizer.param_groups))]
        leaves, _ = pytree.tree_flatten_with_path(batch)
        slots += [InputSlot(NodeKind.INPUT, "batch" + pytree.keystr(path)) for path, leaf in leaves
                  if isinstance(leaf, torch.Tensor)]  # fmt: skip
        return slots

    def flat_inputs(self, batch: Any) -> list[torch.Tensor]:
        """The tensors to call the captured graph with, in slot order (the real, live tensors)."""
        params = dict(self.model.named_parameters())
        buffers = dict(self.model.named_buffers())
        flat: list[torch.Tensor] = [params[n].detach() for n in self.param_names]
        flat += [buffers[n] for n in self.buffer_names]
        for name in self.trainable:
            state = self.optimizer.state[params[name]]
            flat += [state[s] for s in self.state_names(name)]
        flat += [learning_rate(g) for g in self.optimizer.param_groups]
        flat += [leaf for leaf in pytree.tree_leaves(batch) if isinstance(leaf, torch.Tensor)]
        return flat

    def trace_inputs(self, batch: Any) -> list[torch.Tensor]:
        """Like :meth:`flat_inputs`, with trainable parameters marked as requiring grad."""
        flat = self.flat_inputs(batch)
        trainable = set(self.trainable)
        for index, name in enumerate(self.param_names):
            flat[index] = flat[index].requires_grad_(name in trainable)
        return flat

    # -- the optimizer's multi-tensor form --------------------------------------------------
    def foreach_buckets(self) -> list[list[str]]:
        """The trainable parameters updated together by one multi-tensor update, read from the
        live model and optimizer: per param group taking torch.optim's foreach form, one bucket
        per device, dtype and (for Adam) step count, whose bias corrections are then one number.

        The graph keeps each bucket's step counts equal (it steps them together); the bucket
        layout is remembered so that :meth:`check_foreach_buckets` can tell when someone else
        changed them.
        """
        params = dict(self.model.named_parameters())
        buckets: dict[tuple[Any, ...], list[str]] = {}
        for index, group in enumerate(self.optimizer.param_groups):
            names = [n for n in self.trainable if self.group_of[n] == index]
            if not functional_optim.uses_foreach(group, [params[n] for n in names]):
                continue
            for name in names:
                param = params[name]
                key: tuple[Any, ...] = (index, param.device, param.dtype)
                if self.spec.algorithm != "sgd":
                    key += (float(self.optimizer.state[param]["step"]),)
                buckets.setdefault(key, []).append(name)
        self.foreach_layout = list(buckets.values())
        self.checked_steps = []
        return self.foreach_layout

    def check_foreach_buckets(self) -> None:
        """Raise :class:`StaleCaptureError` if an Adam bucket's step counts are no longer equal
        (optimizer state replaced, say by ``load_state_dict`` from another run)."""
        layout = self.foreach_layout
        if self.spec.algorithm == "sgd" or not any(layout):
            return
        params = dict(self.model.named_parameters())
        steps = [[self.optimizer.state[params[n]]["step"] for n in bucket] for bucket in layout]
        identities = [id(t) for bucket in steps for t in bucket]
        if identities == self.checked_steps:  # the graph itself keeps its own step tensors equal
            return
        for bucket, tensors in zip(layout, steps, strict=True):
            if len({float(t) for t in tensors}) > 1:
                raise StaleCaptureError(
                    f"the optimizer's step counts of {bucket[0]} and the parameters updated with it are no "
                    "longer equal (was the optimizer state replaced?); capture the step again"
                )
        self.checked_steps = identities

    # -- the traced function ---------------------------------------------------------------
    def step_function(self, batch: Any, gradient_labels: list[str]) -> Callable[..., tuple[torch.Tensor, ...]]:
        leaves, batch_spec = pytree.tree_flatten(batch)
        tensor_positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        n_params, n_buffers = len(self.param_names), len(self.buffer_names)
        state_layout = [(n, self.state_names(n)) for n in self.trainable]
        n_state = sum(len(s) for _, s in state_layout)
        n_groups = len(self.optimizer.param_groups)
        buckets = self.foreach_buckets()
        in_buckets = {name for bucket in buckets for name in bucket}

        def step(*flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
            forbid_value_dependent_shapes()
            params = dict(zip(self.param_names, flat[:n_params], strict=True))
            buffers = dict(zip(self.buffer_names, flat[n_params:n_params + n_buffers], strict=True))
            cursor = n_params + n_buffers
            states: dict[str, dict[str, torch.Tensor]] = {}
            for name, names in state_layout:
                states[name] = dict(zip(names, flat[cursor:cursor + len(names)], strict=True))
                cursor += len(names)
            lrs = flat[cursor:cursor + n_groups]
            batch_leaves = list(leaves)
            for position, tensor in zip(tensor_positions, flat[n_params + n_buffers + n_state + n_groups:],
                                        strict=True):  # fmt: skip
                batch_leaves[position] = tensor
            traced_batch = pytree.tree_unflatten(batch_leaves, batch_spec)

            averaging = self._begin_data_parallel(params, buffers)
            with torch.enable_grad():
                output = _call_model(self.model, params, buffers, traced_batch)
                loss = self.loss_fn(output, traced_batch)
                _check_loss(loss)
            _end_phase(Phase.FORWARD)
            wanted = [params[n] for n in self.trainable]
            grads = torch.autograd.grad(loss, wanted, allow_unused=True)
            if averaging is not None:  # gradients final: their average over the ranks replaces them
                grads = averaging.averaged(self.trainable, grads)
                self.gradient_buckets = averaging.layout
            _end_phase(Phase.BACKWARD)
            with torch.no_grad():
                grad_of = {name: grad for name, grad in zip(self.trainable, grads, strict=True) if grad is not None}
                # torch.optim skips parameters without a gradient.
                gradient_labels.extend(name for name in self.trainable if name in grad_of)
                for name in self.trainable:
                    if name in grad_of and name not in in_buckets:
                        group_index = self.group_of[name]
                        functional_optim.update(self.spec, self.optimizer.param_groups[group_index], params[name],
                                                grad_of[name], states[name], lrs[group_index])  # fmt: skip
                # Parameters without a gradient are not stepped: the layout to check is what is updated.
                self.foreach_layout = [[name for name in bucket if name in grad_of] for bucket in buckets]
                for names in self.foreach_layout:
                    if names:
                        group_index = self.group_of[names[0]]
                        functional_optim.update_foreach(
                            self.spec, self.optimizer.param_groups[group_index], [params[n] for n in names],
                            [grad_of[n] for n in names], [states[n] for n in names], lrs[group_index])
                outputs = (loss.detach(), *[g for g in grads if g is not None])
            _end_phase(Phase.OPTIMIZER)
            return outputs

        return step

    def _begin_data_parallel(self, params: dict[str, torch.Tensor],
                             buffers: dict[str, torch.Tensor]) -> GradientBuckets | None:  # fmt: skip
        """Data parallel: trace rank 0's buffers into every rank's, and hook the trainable
        parameters so that their gradients are bucketed and all-reduced as they become final."""
        dp = self.data_parallel
        if dp is None:
            return None
        if dp.sync_buffers:
            broadcast_coalesced([b for n, b in buffers.items() if n not in dp.ignored], dp.group_name)
        buckets = GradientBuckets(dp.group_name, dp.world_size, dp.bucket_limits,
                                  [n for n in self.trainable if n not in dp.ignored])  # fmt: skip
        buckets.watch(params)
        return buckets


def learning_rate(group: dict[str, Any]) -> torch.Tensor:
    """A param group's learning rate as the 0-dim tensor fed to the graph: a Python number as
    float64 on CPU (torch.optim computes with it in double precision), a tensor as it is."""
    lr = group["lr"]
    if isinstance(lr, torch.Tensor):
        return lr.detach().reshape(()).clone()
    return torch.tensor(float(lr), dtype=torch.float64)


def _call_model(model: torch.nn.Module, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor],
                batch: Any) -> Any:  # fmt: skip
    if isinstance(batch, dict):
        args, kwargs = (), batch
    elif isinstance(batch, (tuple, list)):
        args, kwargs = tuple(batch), {}
    else:
        args, kwargs = (batch,), {}
    return torch.func.functional_call(model, (params, buffers), args, kwargs, tie_weights=True, strict=False)


def _check_loss(loss: Any) -> None:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.dtype.is_floating_point:
        what = type(loss).__name__ if not isinstance(loss, torch.Tensor) else f"a tensor of shape {tuple(loss.shape)}"
        raise CaptureError(f"the loss function must return a scalar floating-point tensor, it returned {what}")
    if not loss.requires_grad:
        raise CaptureError("the loss does not depend on any trainable parameter; check that the model's "
                           "parameters require grad and that loss_fn uses the model's output")  # fmt: skip


def _end_phase(phase: Phase) -> None:
    """Tag every traced node that has no phase yet with ``phase``."""
    mode = get_proxy_mode()
    if mode is None:
        return
    for node in mode.tracer.graph.nodes:
        node.meta.setdefault(PHASE_META, phase)


@contextlib.contextmanager
def _training_mode_kept(model: torch.nn.Module) -> Iterator[None]:
    modes = {m: m.training for m in model.modules()}
    try:
        yield
    finally:
        for module, training in modes.items():
            module.train(training)


def capture(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Any, loss_fn: LossFn,
            data_parallel: DataParallel | None = None) -> tuple[CapturedStep, StepBinding]:  # fmt: skip
    """Trace one training iteration of ``model`` on ``batch`` into a :class:`CapturedStep`.

    Missing optimizer state is created as torch.optim's first step would create it. Raises
    :class:`CaptureError` with one sentence naming the cause (and the model's line, for
    data-dependent control flow) when the iteration cannot be traced. With ``data_parallel``, the
    graph also averages the gradients across ranks (:mod:`mutwo.runtime.collectives`).
    """
    binding = StepBinding.bind(model, optimizer, loss_fn, data_parallel)
    if not binding.trainable:
        raise CaptureError("the optimizer has no parameter that requires grad; nothing would be trained")
    functional_optim.init_state(optimizer, binding.spec)
    gradient_labels: list[str] = []
    slots = binding.slots(batch)
    n_batch = sum(1 for leaf in pytree.tree_leaves(batch) if isinstance(leaf, torch.Tensor))
    inputs, aliases = separate_aliases(binding.trace_inputs(batch), len(slots) - n_batch)
    try:
        with compiler_tracing(), quiet_torch_errors(), _training_mode_kept(model):
            graph_module = make_fx(binding.step_function(batch, gradient_labels), tracing_mode="fake",
                                   _allow_non_fake_inputs=True)(*inputs)  # fmt: skip
    except CaptureError:
        raise
    except Exception as error:  # every tracing failure becomes one readable sentence
        # torch's traceback says nothing to the user once explained; MUTWO_DEBUG=1 keeps it as the cause.
        raise explain_capture_failure(error) from (error if debug_enabled() else None)
    refuse_written_aliases(graph_module.graph, aliases, [s.label for s in slots])
    run_rnn_layers_in_training_mode(graph_module.graph)
    constants = _lift_constants(graph_module, slots)
    _, batch_spec = pytree.tree_flatten(batch)
    return CapturedStep(graph_module, slots, gradient_labels, batch_spec, constants), binding


def _lift_constants(graph_module: fx.GraphModule, slots: list[InputSlot]) -> dict[str, torch.Tensor]:
    """Turn ``get_attr`` constants (tensors the model keeps outside parameters and buffers) into
    trailing placeholders, so the graph's only inputs are placeholders."""
    graph = graph_module.graph
    constants: dict[str, torch.Tensor] = {}
    placeholders: dict[str, fx.Node] = {}  # one placeholder per constant, however many nodes read it
    last_placeholder = [n for n in graph.nodes if n.op == "placeholder"][-1]
    for node in [n for n in graph.nodes if n.op == "get_attr"]:
        if node.target not in placeholders:
            with graph.inserting_after(last_placeholder):
                placeholder = graph.placeholder(f"constant_{node.target}")
            placeholder.meta.update(node.meta)
            placeholder.meta[PHASE_META] = Phase.FORWARD
            placeholders[node.target] = last_placeholder = placeholder
            label = f"constant:{node.target}"
            constants[label] = getattr(graph_module, node.target)
            slots.append(InputSlot(NodeKind.INPUT, label))
        node.replace_all_uses_with(placeholders[node.target])
        graph.erase_node(node)
    graph_module.recompile()
    return constants
