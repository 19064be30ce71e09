"""FSDP2 (``torch.distributed.fsdp.fully_shard``) inside the captured iteration.

``fully_shard`` itself cannot be traced: its hooks swap in unsharded parameters that autograd
never reaches from the sharded ones, and its lazy initialisation reads data pointers
(``bench/results/session19_cpu/fsdp2_probe/``). The captured step therefore writes FSDP2's
communication itself, with torch's functional collectives, the way FSDP2 lays it out:

* The graph takes each parameter's local shard **padded** to FSDP2's shard size,
  ``ceil(rows / world)`` rows: the storage ``fully_shard`` keeps (``_sharded_param_data``), of
  which the DTensor's local tensor is the first rows. Every rank's graph then has the same shapes,
  so every rank captures, plans and checks the same graph, uneven dimensions included.
* Per ``fully_shard`` module (its parameter group), one all-gather of the concatenated padded
  shards (FSDP2's ``foreach_all_gather``) gives the full parameters, which are the autograd leaves
  the model runs with; :mod:`~mutwo.runtime.capture.gather_schedule` then moves each group's
  all-gather to just before the group's first use, and, for a group ``fully_shard`` reshards
  after the forward, gathers it again before its first use in the backward instead of keeping it
  (FSDP2's ``reshard_after_forward=True``; the root module's group is kept, as FSDP2 keeps it).
* Per group, as soon as the backward has made all its gradients, one reduce-scatter with
  ``"avg"`` of the concatenated, padded gradients (FSDP2's ``foreach_reduce``) gives each rank its
  padded gradient shard; the waits come at the end of the backward.
* The optimizer updates the padded shards and optimizer state in place. Its state is moved into
  padded storage too (:meth:`FullySharded.pad_state`), still DTensors of the local rows in
  ``optimizer.state``; the padding rows hold zeros, and an element-wise optimizer
  (:data:`ELEMENTWISE_OPTIMIZERS`) never mixes them into a real row.

The parameters' DTensors, the optimizer's state and the gradients handed back (``keep_grads``)
stay what eager FSDP2 has: DTensors of the local rows, so state_dict and checkpointing work as
they do for ``fully_shard``. FSDP2 does not broadcast buffers; neither does the captured step.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mutwo.runtime.capture.tracing import CaptureError

_C10D = torch.ops._c10d_functional

#: The optimizers whose update is the same function of every element on its own, so that the
#: padding rows of a shard never change a real row (and a shard's update is the whole tensor's).
ELEMENTWISE_OPTIMIZERS = frozenset({"SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta",
                                    "RMSprop", "ASGD", "Rprop"})  # fmt: skip


class FullyShardedError(ValueError):
    """A ``fully_shard`` model that mutwo cannot capture as it is; the message says why and what to do."""


@dataclass(frozen=True)
class ShardedParameter:
    """How ``fully_shard`` laid one parameter out: ``rows`` of its first dimension in all, each
    rank's shard padded to ``padded_rows``, of which this rank holds ``local_rows``."""

    name: str
    shape: torch.Size  #: the whole parameter's
    padded_rows: int
    local_rows: int

    @property
    def padded_shape(self) -> tuple[int, ...]:
        return (self.padded_rows, *self.shape[1:])


@dataclass(frozen=True)
class ShardGroup:
    """The parameters one ``fully_shard`` module gathers and reduces together, in its order."""

    module: str  #: the module's qualified name ("" for the root)
    names: tuple[str, ...]
    regathered: bool  #: freed after the forward and gathered again for the backward


@dataclass(frozen=True)
class FullySharded:
    """The sharding of a ``fully_shard`` model (see the module docstring)."""

    mesh: Any  #: the 1-D DeviceMesh every parameter is sharded over
    parameters: dict[str, ShardedParameter] = field(compare=False)
    groups: tuple[ShardGroup, ...]

    @property
    def world_size(self) -> int:
        return self.mesh.size()

    @property
    def group_name(self) -> str:
        return self.mesh.get_group().group_name

    # -- the real tensors around the graph --------------------------------------------------------
    def padded(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The padded shard behind parameter ``name``'s DTensor (or a state tensor shaped like it):
        a view of the storage its local rows start, ``padded_rows`` rows long."""
        layout = self.parameters[name]
        shape = layout.padded_shape
        if not _is_dtensor(tensor) and tuple(tensor.shape) != shape:
            raise FullyShardedError(f"a state tensor of {name} is a plain tensor of shape {tuple(tensor.shape)}, not "
                                    "a DTensor of this rank's shard; load the optimizer's state as FSDP2 keeps it "
                                    "(DTensors, e.g. through torch.distributed.checkpoint)")  # fmt: skip
        local = tensor._local_tensor if _is_dtensor(tensor) else tensor
        rows_bytes = math.prod(shape) * local.element_size()
        storage = local.untyped_storage()
        if not local.is_contiguous() or storage.nbytes() < local.storage_offset() * local.element_size() + rows_bytes:
            raise FullyShardedError(f"the local shard of {name} is not backed by fully_shard's padded storage "
                                    f"({layout.padded_rows} rows); do not replace a sharded parameter's data after "
                                    "fully_shard (load values with load_state_dict or copy_)")  # fmt: skip
        return local.new_empty(0).set_(storage, local.storage_offset(), shape, _contiguous_strides(shape))

    def local_dtensor(self, name: str, padded: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """``padded``'s local rows as a DTensor shaped like parameter ``like``, as FSDP2 hands out."""
        from torch.distributed.tensor import DTensor, Shard

        rows = self.parameters[name].local_rows
        return DTensor.from_local(padded[:rows], self.mesh, [Shard(0)], run_check=False, shape=like.shape,
                                  stride=like.stride())  # fmt: skip

    def pad_state(self, optimizer: torch.optim.Optimizer, params: dict[str, torch.Tensor]) -> None:
        """Move every state tensor shaped like its parameter into padded storage of its own, a
        DTensor of the local rows as before, so the graph reads and writes it as it does the
        parameter's padded shard (the padding rows are zeros)."""
        for name, param in params.items():
            state = optimizer.state.get(param, {})
            for key, value in list(state.items()):
                if not (_is_dtensor(value) and value.shape == param.shape):
                    continue
                local = value._local_tensor
                layout = self.parameters[name]
                if local.untyped_storage().nbytes() >= math.prod(layout.padded_shape) * local.element_size():
                    continue  # already padded (an earlier capture)
                padded = local.new_zeros(layout.padded_shape)
                padded[:layout.local_rows].copy_(local)
                state[key] = self.local_dtensor(name, padded, param)

    # -- inside the traced step -------------------------------------------------------------------
    def gathered(self, shards: dict[str, torch.Tensor], trainable: set[str]) -> dict[str, torch.Tensor]:
        """The full parameters, from the padded shards: one all-gather per group; the trainable
        ones are new autograd leaves (as FSDP2's unsharded parameters are)."""
        full: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for group in self.groups:
                flat = torch.cat([shards[n].reshape(-1) for n in group.names])
                gathered = _C10D.wait_tensor(_C10D.all_gather_into_tensor(flat, self.world_size, self.group_name))
                pieces = gathered.view(self.world_size, -1).split([shards[n].numel() for n in group.names], dim=1)
                for name, piece in zip(group.names, pieces, strict=True):
                    layout = self.parameters[name]
                    whole = piece.contiguous().view(self.world_size * layout.padded_rows, *layout.shape[1:])
                    full[name] = whole.narrow(0, 0, layout.shape[0]).detach().requires_grad_(name in trainable)
        return full

    def reduce_scatter(self, full: dict[str, torch.Tensor], trainable: Sequence[str]) -> ShardedGradients:
        """Hook the trainable full parameters so that each group's gradients are reduce-scattered
        as soon as the backward has made all of them."""
        gradients = ShardedGradients(self, [n for n in trainable if n in full])
        for name in gradients.names:
            full[name].register_hook(lambda grad, name=name: gradients.ready(name, grad))
        return gradients


class ShardedGradients:
    """Reduce-scatters each group's gradients while the backward is traced (see
    :meth:`FullySharded.reduce_scatter`); :meth:`averaged` waits for them at its end."""

    def __init__(self, sharded: FullySharded, names: Sequence[str]) -> None:
        self.sharded = sharded
        self.names = list(names)
        watched = set(names)
        self.pending = [[n for n in g.names if n in watched] for g in sharded.groups]
        self.arrived: dict[str, torch.Tensor] = {}
        self.issued: list[tuple[list[str], torch.Tensor]] = []

    @property
    def layout(self) -> list[list[str]]:
        """The reduce-scatters' parameters, in the order they were issued."""
        return [names for names, _ in self.issued]

    def ready(self, name: str, grad: torch.Tensor) -> None:
        if name in self.arrived:
            raise CaptureError(f"the gradient of {name} became ready twice in one backward; a fully_shard step "
                               "needs one gradient per parameter per iteration")  # fmt: skip
        self.arrived[name] = grad
        for names in self.pending:
            if names and all(n in self.arrived for n in names):
                self._issue(names)
                names.clear()

    def _issue(self, names: list[str]) -> None:
        world = self.sharded.world_size
        chunks = []
        for name in names:
            layout = self.sharded.parameters[name]
            grad = self.arrived[name]
            pad = world * layout.padded_rows - grad.shape[0]
            grad = torch.constant_pad_nd(grad, [0, 0] * (grad.dim() - 1) + [0, pad])
            chunks.append(grad.reshape(world, -1))
        flat = torch.cat(chunks, dim=1).reshape(-1)
        self.issued.append((list(names), _C10D.reduce_scatter_tensor(flat, "avg", world, self.sharded.group_name)))

    def averaged(self, names: Sequence[str], grads: Sequence[torch.Tensor | None]) -> tuple[torch.Tensor | None, ...]:
        """``grads`` with every watched gradient replaced by this rank's padded shard of its
        average over the ranks (a group whose parameters did not all get a gradient is issued
        here, with those that did)."""
        for pending in self.pending:
            got = [n for n in pending if n in self.arrived]
            if got:
                self._issue(got)
            pending.clear()
        averaged: dict[str, torch.Tensor] = {}
        for issued_names, flat in self.issued:
            shard = _C10D.wait_tensor(flat)
            layouts = [self.sharded.parameters[n] for n in issued_names]
            pieces = shard.split([math.prod(layout.padded_shape) for layout in layouts])
            averaged.update((layout.name, piece.view(layout.padded_shape))
                            for layout, piece in zip(layouts, pieces, strict=True))  # fmt: skip
        return tuple(averaged.get(name, grad) for name, grad in zip(names, grads, strict=True))


# -- reading a fully_shard model ------------------------------------------------------------------------
def is_fully_sharded(model: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``model`` or one of its modules."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def fully_sharded_layout(model: nn.Module) -> FullySharded:
    """The sharding of a ``fully_shard`` model, refused in one sentence where mutwo would compute
    something else than eager FSDP2 does."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import Shard

    if not isinstance(model, FSDPModule):
        raise FullyShardedError("fully_shard was applied to submodules but not to the model itself; apply "
                                "fully_shard(model) last, as FSDP2 requires")  # fmt: skip
    mesh = None
    parameters: dict[str, ShardedParameter] = {}
    for name, param in model.named_parameters():
        if not _is_dtensor(param):
            raise FullyShardedError(f"parameter {name} is not sharded by fully_shard; apply fully_shard to the "
                                    "model itself so that every parameter is sharded")  # fmt: skip
        if param.device_mesh.ndim != 1 or tuple(param.placements) != (Shard(0),):
            raise FullyShardedError(f"parameter {name} is placed {tuple(param.placements)} on a "
                                    f"{param.device_mesh.ndim}-D mesh; mutwo captures fully_shard over a 1-D mesh "
                                    "(Shard(0)) only, not HSDP or tensor parallelism")  # fmt: skip
        if mesh is None:
            mesh = param.device_mesh
        elif param.device_mesh != mesh:
            raise FullyShardedError(f"parameter {name} is sharded over another device mesh than the first "
                                    "parameter; shard the whole model over one mesh")  # fmt: skip
        world, rank = mesh.size(), mesh.get_local_rank()
        padded = math.ceil(param.shape[0] / world) if param.dim() else 0
        if param.dim() == 0:
            raise FullyShardedError(f"parameter {name} is a scalar, which fully_shard does not shard row-wise; "
                                    "make it a 1-element tensor")  # fmt: skip
        local_rows = max(0, min(padded, param.shape[0] - rank * padded))
        parameters[name] = ShardedParameter(name, param.shape, padded, local_rows)
    if mesh is None:
        raise FullyShardedError("the fully_shard model has no parameter to shard")
    groups = []
    claimed: set[str] = set()
    for module_name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        _refuse_policies(module, module_name)
        names = _own_parameters(model, module, claimed)
        if names:
            reshard = _reshards_after_forward(module)
            groups.append(ShardGroup(module_name, tuple(names), regathered=reshard and module is not model))
    return FullySharded(mesh, parameters, tuple(groups))


def _own_parameters(model: nn.Module, module: nn.Module, claimed: set[str]) -> list[str]:
    """The parameters of ``module`` not under a nested ``fully_shard`` module and not claimed by an
    earlier group, as fully-qualified names of ``model`` (a tied parameter under its first name)."""
    from torch.distributed.fsdp import FSDPModule

    names = {id(p): n for n, p in model.named_parameters()}
    own: list[str] = []

    def visit(current: nn.Module) -> None:
        for param in current.parameters(recurse=False):
            name = names.get(id(param))
            if name is not None and name not in claimed:
                claimed.add(name)
                own.append(name)
        for child in current.children():
            if not isinstance(child, FSDPModule):
                visit(child)

    visit(module)
    return own


def _refuse_policies(module: nn.Module, name: str) -> None:
    """Mixed precision and CPU offload change what FSDP2 computes; neither is captured yet."""
    state = module._get_fsdp_state()
    group = getattr(state, "_fsdp_param_group", None)
    where = f" on {name}" if name else ""
    policy = getattr(group, "mp_policy", None)
    if policy is not None and (policy.param_dtype is not None or policy.reduce_dtype is not None):
        raise FullyShardedError(f"fully_shard's mixed precision policy{where} is not supported yet; build it without "
                                "mp_policy (mutwo's precision='bf16' autocasts the step instead)")  # fmt: skip
    offload = getattr(group, "offload_policy", None)
    if offload is not None and type(offload).__name__ != "OffloadPolicy":
        raise FullyShardedError(f"fully_shard's {type(offload).__name__}{where} is not supported; build it "
                                "without offload_policy (mutwo's swap passes move activations to the host "
                                "instead)")  # fmt: skip


def _reshards_after_forward(module: nn.Module) -> bool:
    group = getattr(module._get_fsdp_state(), "_fsdp_param_group", None)
    return getattr(group, "post_forward_mesh_info", True) is not None


def _is_dtensor(tensor: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, running = [], 1
    for size in reversed(shape):
        strides.append(running)
        running *= max(size, 1)
    return tuple(reversed(strides))


@contextlib.contextmanager
def fsdp_hooks_removed(model: nn.Module) -> Iterator[None]:
    """Take ``fully_shard``'s forward hooks off every module while the step is traced (they
    would all-gather and reshard in place), and put them back after."""
    from torch.distributed.fsdp import FSDPModule

    saved: list[tuple[dict[int, Any], dict[int, Any]]] = []
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        ids = {state._pre_forward_hook_handle.id, state._post_forward_hook_handle.id}
        for hooks in (module._forward_pre_hooks, module._forward_hooks, module._forward_pre_hooks_with_kwargs,
                      module._forward_hooks_with_kwargs, module._forward_hooks_always_called):  # fmt: skip
            saved.append((hooks, dict(hooks)))
            for hook_id in ids:
                hooks.pop(hook_id, None)
    try:
        yield
    finally:
        for hooks, kept in saved:
            hooks.clear()
            hooks.update(kept)
