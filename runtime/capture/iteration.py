"""Capture one whole training iteration — forward, loss, backward, optimizer step — as one graph.

The iteration is traced with ``make_fx`` over fake tensors into a single fx graph of aten ops:

* graph inputs (placeholders), in this order: parameters, buffers, per-parameter optimizer state,
  the scheduled hyperparameters of each param group (its learning rate...: 0-dim tensors,
  :func:`mutwo.runtime.capture.optim.scheduled_inputs`), then the tensors of the batch; each has an
  :class:`InputSlot` naming what the runtime feeds it;
* the forward runs through ``torch.func.functional_call``, the backward is ``torch.autograd.grad``
  traced into explicit aten ops, the optimizer update is :mod:`mutwo.runtime.capture.optim`;
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
from mutwo.ir.fx_modules import lazy_graph_modules
from mutwo.ir.node import NodeKind, Phase
from mutwo.runtime.capture import optim as functional_optim
from mutwo.runtime.capture.batch_call import BatchCall, batch_call
from mutwo.runtime.capture.collectives import GradientBuckets, broadcast_coalesced
from mutwo.runtime.capture.device_state import state_for_cuda_graphs, state_on_device
from mutwo.runtime.capture.fully_sharded import (
    ELEMENTWISE_OPTIMIZERS,
    FullySharded,
    ShardedGradients,
    fsdp_hooks_removed,
)
from mutwo.runtime.capture.gather_schedule import schedule_gathers
from mutwo.runtime.capture.guards import RecordedGuard, TraceDecider
from mutwo.runtime.capture.input_aliasing import refuse_written_aliases, separate_aliases
from mutwo.runtime.capture.rnn import run_rnn_layers_in_training_mode
from mutwo.runtime.capture.tracing import (
    CaptureError,
    compiler_tracing,
    debug_enabled,
    explain_capture_failure,
    forbid_value_dependent_shapes,
    is_data_dependent,
    quiet_torch_errors,
)
from mutwo.runtime.capture.training import TrainingOptions

if TYPE_CHECKING:
    from mutwo.runtime.parallel.distributed import DataParallel

LossFn = Callable[[Any, Any], torch.Tensor]

#: The state name of a parameter's accumulated gradient in its slot label (``name:accumulated_grad``).
ACCUMULATED_GRAD = "accumulated_grad"


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
    holds outside parameters and buffers, fed like inputs; ``guards`` the branches the optimizer
    took on host numbers, which must still go the same way for the graph to be run; ``call`` how
    the model and the loss were called with the batch (its ``sentence()`` is for the log).
    """

    graph_module: fx.GraphModule
    slots: list[InputSlot]
    gradient_labels: list[str]
    batch_spec: pytree.TreeSpec
    constants: dict[str, torch.Tensor] = field(default_factory=dict)
    guards: list[RecordedGuard] = field(default_factory=list)  #: branches taken on host numbers
    call: BatchCall = field(default_factory=lambda: BatchCall("whole"))  #: how the model and loss took the batch


@dataclass
class StepBinding:
    """Ties a model, its optimizer and batches to the slots of a captured step."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: LossFn
    param_names: list[str]
    buffer_names: list[str]
    trainable: list[str]  #: names of the parameters the optimizer updates, in group order
    group_names: list[list[str]]  #: every parameter of each param group, by name
    state_layout: dict[str, tuple[str, ...]]  #: the optimizer state tensors of each trainable parameter
    #: state the optimizer creates inside step(), and the tensors allocated to receive it
    fresh: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict)
    training: TrainingOptions = field(default_factory=TrainingOptions)  #: clipping and precision
    #: with gradient accumulation, which micro-batch the graph runs: "first" (returns the gradients),
    #: "middle" (adds them to ``accumulated``) or "last" (adds them, then clips and steps); else "step"
    micro: str = "step"
    #: the gradients accumulated so far, by parameter name (inputs of the middle and last graphs)
    accumulated: dict[str, torch.Tensor] = field(default_factory=dict)
    data_parallel: DataParallel | None = None  #: how gradients are averaged across ranks, if they are
    gradient_buckets: list[list[str]] = field(default_factory=list)  #: the all-reduce buckets, in issue order
    call: BatchCall = field(default_factory=lambda: BatchCall("whole"))  #: how the model and loss take the batch
    #: the step is recorded as a CUDA graph: the optimizer's groups are traced in torch.optim's
    #: capturable form where they have it (:mod:`mutwo.runtime.capture.optim`)
    graphed: bool = False
    #: the trainable parameters whose optimizer state is kept on their device (``graphed``)
    device_state: frozenset[str] = frozenset()

    @classmethod
    def bind(cls, model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn,
             training: TrainingOptions | None = None, micro: str = "step",
             accumulated: dict[str, torch.Tensor] | None = None,
             data_parallel: DataParallel | None = None, graphed: bool = False) -> StepBinding:  # fmt: skip
        params = dict(model.named_parameters())
        # A step on the CPU is never recorded (the CUDA-graph backends refuse it in one line).
        graphed = graphed and any(p.is_cuda for p in params.values())
        functional_optim.check_supported(optimizer, graphed)
        name_of = {id(p): name for name, p in params.items()}
        group_names: list[list[str]] = []
        for group in optimizer.param_groups:
            for param in group["params"]:
                if id(param) not in name_of:
                    raise CaptureError("the optimizer holds a tensor that is not a parameter of the model; "
                                       "build the optimizer from model.parameters()")  # fmt: skip
            group_names.append([name_of[id(p)] for p in group["params"]])
        trainable = [name for names in group_names for name in names if params[name].requires_grad]
        if not trainable:
            raise CaptureError("the optimizer has no parameter that requires grad; nothing would be trained")
        functional_optim.init_state(optimizer, [params[n] for n in trainable])
        sharded = data_parallel.sharded if data_parallel is not None else None
        if sharded is not None:
            refuse_with_fully_shard(optimizer, training or TrainingOptions())
            sharded.pad_state(optimizer, {n: params[n] for n in trainable})
        device_state: set[torch.Tensor] = set()
        if graphed:
            device_state = state_for_cuda_graphs(optimizer, [params[n] for n in trainable])
        layout = {name: functional_optim.state_names(optimizer, params[name]) for name in trainable}
        return cls(model, optimizer, loss_fn, list(params), [n for n, _ in model.named_buffers()], trainable,
                   group_names, layout, training=training or TrainingOptions(), micro=micro,
                   accumulated=accumulated if accumulated is not None else {}, data_parallel=data_parallel,
                   graphed=graphed,
                   device_state=frozenset(n for n in trainable if params[n] in device_state))  # fmt: skip

    # -- the flat input list ---------------------------------------------------------------
    def state_names(self, name: str) -> tuple[str, ...]:
        return self.state_layout[name] + tuple(key for (owner, key) in self.fresh if owner == name)

    def slots(self, batch: Any) -> list[InputSlot]:
        slots = [InputSlot(NodeKind.PARAMETER, n) for n in self.param_names]
        slots += [InputSlot(NodeKind.BUFFER, n) for n in self.buffer_names]
        slots += [InputSlot(NodeKind.OPTIMIZER_STATE, f"{n}:{s}") for n in self.trainable for s in self.state_names(n)]
        slots += [InputSlot(NodeKind.OPTIMIZER_STATE, f"{n}:{ACCUMULATED_GRAD}") for n in self.accumulated_inputs()]
        if self.training.scaler is not None:
            slots += [InputSlot(NodeKind.OPTIMIZER_STATE, "scaler:scale"),
                      InputSlot(NodeKind.OPTIMIZER_STATE, "scaler:growth_tracker")]  # fmt: skip
        slots += [InputSlot(NodeKind.OTHER, functional_optim.scheduled_label(entry, i))
                  for i, group in enumerate(self.optimizer.param_groups)
                  for entry in functional_optim.scheduled_entries(group, self.graphed)]  # fmt: skip
        leaves, _ = pytree.tree_flatten_with_path(batch)
        slots += [InputSlot(NodeKind.INPUT, "batch" + pytree.keystr(path)) for path, leaf in leaves
                  if isinstance(leaf, torch.Tensor)]  # fmt: skip
        return slots

    @property
    def sharded(self) -> FullySharded | None:
        """The sharding of a ``fully_shard`` model, else None."""
        return self.data_parallel.sharded if self.data_parallel is not None else None

    def flat_inputs(self, batch: Any) -> list[torch.Tensor]:
        """The tensors to call the captured graph with, in slot order (the real, live tensors; of a
        ``fully_shard`` model, the padded shards of its parameters and optimizer state)."""
        params = dict(self.model.named_parameters())
        buffers = dict(self.model.named_buffers())
        sharded = self.sharded
        if sharded is not None:
            flat: list[torch.Tensor] = [sharded.padded(n, params[n]) for n in self.param_names]
        else:
            flat = [params[n].detach() for n in self.param_names]
        flat += [buffers[n] for n in self.buffer_names]
        for name in self.trainable:
            state = self.optimizer.state[params[name]]
            if name in self.device_state:  # load_state_dict may have brought step counts back to the CPU
                state_on_device(state, params[name].device)
            if sharded is not None:
                flat += [sharded.padded(name, state[s]) if state[s].shape == params[name].shape else state[s]
                         for s in self.state_layout[name]]  # fmt: skip
            else:
                flat += [state[s] for s in self.state_layout[name]]
            flat += [tensor for (owner, _), tensor in self.fresh.items() if owner == name]
        flat += list(self.accumulated_inputs().values())
        flat += self.training.scaler_state(params[self.trainable[0]].device)
        flat += [value for group in self.optimizer.param_groups
                 for value in functional_optim.scheduled_inputs(group, self.graphed)]  # fmt: skip
        flat += [leaf for leaf in pytree.tree_leaves(batch) if isinstance(leaf, torch.Tensor)]
        return flat

    def trace_inputs(self, batch: Any) -> list[torch.Tensor]:
        """Like :meth:`flat_inputs`, with trainable parameters marked as requiring grad."""
        flat = self.flat_inputs(batch)
        # A fully_shard step differentiates the gathered parameters, not the shards.
        trainable = set(self.trainable) if self.sharded is None else set()
        for index, name in enumerate(self.param_names):
            flat[index] = flat[index].requires_grad_(name in trainable)
        return flat

    def accumulated_inputs(self) -> dict[str, torch.Tensor]:
        """The accumulated gradients the graph reads and adds to (middle and last micro-batches)."""
        return self.accumulated if self.micro in ("middle", "last") else {}

    def allocate_fresh(self, created: dict[tuple[str, str], torch.Tensor]) -> None:
        """Allocate real tensors for the state the optimizer creates inside step() (their values are
        written by the first run)."""
        for entry, fake in created.items():
            self.fresh[entry] = torch.empty_strided(tuple(fake.shape), tuple(fake.stride()), dtype=fake.dtype,
                                                    device=fake.device)  # fmt: skip

    def fresh_labels(self) -> set[str]:
        """The slot labels of the state the optimizer creates inside step() (:attr:`fresh`)."""
        return {f"{name}:{key}" for name, key in self.fresh}

    def install_fresh(self) -> None:
        """After a run: hand the state the optimizer created to the optimizer, as its step() would."""
        params = dict(self.model.named_parameters())
        sharded = self.sharded
        for (name, key), tensor in self.fresh.items():
            if sharded is not None and tensor.shape == sharded.parameters[name].padded_shape:
                tensor = sharded.local_dtensor(name, tensor, params[name])
            self.optimizer.state[params[name]][key] = tensor
        self.fresh = {}

    # -- the traced function ---------------------------------------------------------------
    def step_function(self, batch: Any, gradient_labels: list[str],
                      decide: Callable[[Any], bool]) -> Callable[..., tuple[torch.Tensor, ...]]:  # fmt: skip
        leaves, batch_spec = pytree.tree_flatten(batch)
        tensor_positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        n_params, n_buffers = len(self.param_names), len(self.buffer_names)
        state_layout = [(n, self.state_names(n)) for n in self.trainable]
        accumulated_names = list(self.accumulated_inputs())
        n_scaler = 2 if self.training.scaler is not None else 0
        n_state = sum(len(s) for _, s in state_layout) + len(accumulated_names) + n_scaler
        in_optimizer_order = [name for names in self.group_names for name in names]
        k = self.training.accumulation_steps
        n_scheduled = sum(len(functional_optim.scheduled_entries(g, self.graphed)) for g in self.optimizer.param_groups)

        def step(*flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
            forbid_value_dependent_shapes()
            params = dict(zip(self.param_names, flat[:n_params], strict=True))
            buffers = dict(zip(self.buffer_names, flat[n_params:n_params + n_buffers], strict=True))
            cursor = n_params + n_buffers
            states: dict[str, dict[str, torch.Tensor]] = {}
            for name, names in state_layout:
                states[name] = dict(zip(names, flat[cursor:cursor + len(names)], strict=True))
                cursor += len(names)
            accumulated = dict(zip(accumulated_names, flat[cursor:cursor + len(accumulated_names)], strict=True))
            cursor += len(accumulated_names)
            scaler_state = flat[cursor:cursor + n_scaler]  # the scale and the growth tracker
            cursor += n_scaler
            scheduled = list(flat[cursor:cursor + n_scheduled])
            batch_leaves = list(leaves)
            for position, tensor in zip(tensor_positions, flat[n_params + n_buffers + n_state + n_scheduled:],
                                        strict=True):  # fmt: skip
                batch_leaves[position] = tensor
            traced_batch = pytree.tree_unflatten(batch_leaves, batch_spec)

            device = next(iter(params.values())).device
            averaging, weights = self._begin_data_parallel(params, buffers)
            sharded = self.sharded
            with torch.enable_grad(), self.training.forward_context(device), \
                    fsdp_hooks_removed(self.model) if sharded is not None else contextlib.nullcontext():  # fmt: skip
                args, kwargs = self.call.model_arguments(traced_batch)
                output = torch.func.functional_call(self.model, (weights, buffers), args, kwargs, tie_weights=True,
                                                    strict=False)  # fmt: skip
                loss = self._loss(output, traced_batch)
            _check_loss(loss)
            _end_phase(Phase.FORWARD)
            wanted = [weights[n] for n in self.trainable]
            # An eager loop accumulating over k micro-batches calls (loss / k).backward() on each;
            # with a grad scaler, scaler.scale(loss / k).backward().
            objective = loss / k if k > 1 else loss
            if scaler_state:
                objective = objective * scaler_state[0].to(objective.device)
            grads = torch.autograd.grad(objective, wanted, allow_unused=True)
            if averaging is not None:  # gradients final: their average over the ranks replaces them
                grads = averaging.averaged(self.trainable, grads)
                self.gradient_buckets = averaging.layout
            grad_of = {name: grad for name, grad in zip(self.trainable, grads, strict=True) if grad is not None}
            if accumulated:
                grad_of = _accumulate(accumulated, grad_of)
            if self.micro in ("step", "last"):
                if scaler_state:
                    found_inf = self.training.unscale([grad_of[n] for n in in_optimizer_order if n in grad_of],
                                                      scaler_state[0])  # fmt: skip
                # Unscaling and clipping write the gradients: they end the backward, as in the eager loop.
                self.training.clip([(params[n], grad_of[n]) for n in self.param_names if n in grad_of])
            if self.micro in ("first", "middle"):
                # No optimizer step: the first returns its gradients (the accumulation starts from
                # them, as .grad does), the middle ones have added theirs to the inputs in place.
                returned = grad_of if self.micro == "first" else {}
                gradient_labels.extend(returned)
                outputs = (loss.detach(), *returned.values())
                _end_phase(Phase.BACKWARD)
                return outputs
            _end_phase(Phase.BACKWARD)
            with torch.no_grad():
                # torch.optim skips parameters without a gradient.
                gradient_labels.extend(name for name in self.trainable if name in grad_of and name not in accumulated)
                fresh = {(name, key): states[name][key] for name, key in self.fresh}
                written = [t for n in grad_of for t in (params[n], *states.get(n, {}).values())]
                skipped = (self.training.skipped_on_inf(found_inf, written) if scaler_state
                           else contextlib.nullcontext())  # fmt: skip
                with skipped:
                    functional_optim.traced_step(self.optimizer, self.group_names, params, grad_of, states, scheduled,
                                                 decide, fresh, self.graphed)  # fmt: skip
                if scaler_state:
                    self.training.update_scale(scaler_state[0], scaler_state[1], found_inf)
                outputs = (loss.detach(), *[grad_of[n] for n in gradient_labels])
            _end_phase(Phase.OPTIMIZER)
            return outputs

        return step

    def _loss(self, output: Any, batch: Any) -> torch.Tensor:
        """``loss_fn(output, ...)`` as :attr:`call` says; a loss function that fails on the labels of an
        (inputs, labels) batch is told it got the labels, not the batch."""
        try:
            return self.loss_fn(output, self.call.loss_batch(batch))
        except CaptureError:
            raise
        except Exception as error:
            if self.call.how != "pair" or is_data_dependent(error):
                raise
            raise CaptureError(f"{explain_capture_failure(error)}; the batch is (inputs, labels) and the model "
                               "takes the inputs, so the loss is called as loss_fn(output, batch[1]), with the "
                               "labels (F.cross_entropy works as it is)") from (error if debug_enabled() else None)

    def _begin_data_parallel(self, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> tuple[
            GradientBuckets | ShardedGradients | None, dict[str, torch.Tensor]]:  # fmt: skip
        """Data parallel: trace rank 0's buffers into every rank's, and hook the trainable
        parameters so that their gradients are bucketed and all-reduced as they become final. A
        ``fully_shard`` model's parameters are all-gathered instead, and the gathered ones hooked
        to be reduce-scattered. Returns the hooks and the parameters the model runs with."""
        dp = self.data_parallel
        if dp is None:
            return None, params
        if dp.sharded is not None:
            full = dp.sharded.gathered(params, set(self.trainable))
            return dp.sharded.reduce_scatter(full, self.trainable), full
        if dp.sync_buffers:
            broadcast_coalesced([b for n, b in buffers.items() if n not in dp.ignored], dp.group_name)
        buckets = GradientBuckets(dp.group_name, dp.world_size, dp.bucket_limits,
                                  [n for n in self.trainable if n not in dp.ignored])  # fmt: skip
        buckets.watch(params)
        return buckets, params


def refuse_with_fully_shard(optimizer: torch.optim.Optimizer, training: TrainingOptions) -> None:
    """What a ``fully_shard`` step cannot capture yet, in one sentence each: options that need a
    norm or a sum over every rank's shards, and an optimizer whose update is not element-wise."""
    name = type(optimizer).__name__
    if name not in ELEMENTWISE_OPTIMIZERS:
        raise CaptureError(f"{name} is not an element-wise torch.optim optimizer, so its update of a shard is not "
                           f"that of the whole parameter; with fully_shard use one of "
                           f"{', '.join(sorted(ELEMENTWISE_OPTIMIZERS))}")  # fmt: skip
    for option, asked in (("max_grad_norm", training.max_grad_norm is not None),
                          ("accumulation_steps", training.accumulation_steps > 1),
                          ("grad_scaler", training.grad_scaler is not None)):  # fmt: skip
        if asked:
            raise CaptureError(f"{option} is not supported with fully_shard yet (it needs the gradients of every "
                               f"rank's shard together); drop {option}")  # fmt: skip


def _accumulate(accumulated: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Add this micro-batch's gradients to the accumulated ones in place, as ``.grad`` accumulates."""
    if set(grads) != set(accumulated):
        raise CaptureError("this micro-batch gives gradients to other parameters than the first one did; "
                           "gradient accumulation needs the same parameters used in every micro-batch")  # fmt: skip
    with torch.no_grad():
        for name, grad in grads.items():
            accumulated[name].add_(grad)
    return accumulated


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
            training: TrainingOptions | None = None, micro: str = "step",
            accumulated: dict[str, torch.Tensor] | None = None,
            data_parallel: DataParallel | None = None,
            graphed: bool = False) -> tuple[CapturedStep, StepBinding]:  # fmt: skip
    """Trace one training iteration of ``model`` on ``batch`` into a :class:`CapturedStep`.

    The model and ``loss_fn`` are called with the batch as :mod:`mutwo.runtime.capture.batch_call`
    decides from the model's ``forward`` (``model(*batch)``; an ``(inputs, labels)`` pair whose
    forward takes the inputs: ``model(inputs)`` and ``loss_fn(output, labels)``); the captured
    step's ``call`` says which.
    ``training`` adds gradient clipping, mixed precision and gradient accumulation
    (:mod:`mutwo.runtime.capture.training`); with accumulation, ``micro`` says which micro-batch the graph
    runs and ``accumulated`` holds the gradients accumulated before it (see :class:`StepBinding`).
    Missing optimizer state is created as torch.optim's first step would create it. Raises
    :class:`CaptureError` with one sentence naming the cause (and the model's line, for
    data-dependent control flow) when the iteration cannot be traced. With ``data_parallel``, the
    graph also averages the gradients across ranks (:mod:`mutwo.runtime.capture.collectives`).
    ``graphed``: the step will be recorded as a CUDA graph; on a GPU, the optimizer's step is then
    traced in torch.optim's capturable form where it has one, its step counts moved to the device
    in ``optimizer.state`` (:mod:`mutwo.runtime.capture.device_state`), and one whose state stays on
    the host is refused (:class:`~mutwo.runtime.capture.optim.UnsupportedOptimizerError`).
    """
    binding = StepBinding.bind(model, optimizer, loss_fn, training, micro, accumulated, data_parallel, graphed)
    binding.call = batch_call(binding.model, batch)
    try:
        graph_module, gradient_labels, guards, aliases = _trace(binding, batch)
    except functional_optim.FreshStateCreated as fresh:
        binding.allocate_fresh(fresh.created)  # and trace again, writing the new state into them
        graph_module, gradient_labels, guards, aliases = _trace(binding, batch)
    if binding.sharded is not None:
        schedule_gathers(graph_module, len(binding.param_names), binding.sharded)
    slots = binding.slots(batch)
    refuse_written_aliases(graph_module.graph, aliases, [s.label for s in slots])
    run_rnn_layers_in_training_mode(graph_module.graph)
    constants = _lift_constants(graph_module, slots)
    _, batch_spec = pytree.tree_flatten(batch)
    return CapturedStep(graph_module, slots, gradient_labels, batch_spec, constants, guards, binding.call), binding


def _trace(binding: StepBinding, batch: Any) -> tuple[fx.GraphModule, list[str], list[RecordedGuard], Any]:
    """Trace the step; also return the batch's aliases of the state (:mod:`mutwo.runtime.capture.input_aliasing`)."""
    gradient_labels: list[str] = []
    n_batch = sum(1 for leaf in pytree.tree_leaves(batch) if isinstance(leaf, torch.Tensor))
    flat = binding.trace_inputs(batch)
    inputs, aliases = separate_aliases(flat, len(flat) - n_batch)
    decide = TraceDecider(inputs)
    try:
        # the captured module is read node by node, never run: its code is generated only if asked
        with compiler_tracing(), quiet_torch_errors(), _training_mode_kept(binding.model), lazy_graph_modules():
            graph_module = make_fx(binding.step_function(batch, gradient_labels, decide), tracing_mode="fake",
                                   _allow_non_fake_inputs=True)(*inputs)  # fmt: skip
    except (CaptureError, functional_optim.FreshStateCreated, functional_optim.UnsupportedOptimizerError):
        raise
    except Exception as error:  # every tracing failure becomes one readable sentence
        # torch's traceback says nothing to the user once explained; MUTWO_DEBUG=1 keeps it as the cause.
        raise explain_capture_failure(error) from (error if debug_enabled() else None)
    return graph_module, gradient_labels, decide.recorded, aliases


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
