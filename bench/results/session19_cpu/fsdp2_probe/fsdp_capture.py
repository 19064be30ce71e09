"""The prototype: capture one whole FSDP2 training step (all-gathers, forward, loss, backward,
reduce-scatters, optimizer on the local shards) as one make_fx graph of aten ops, from a model
wrapped with fully_shard, whose DTensor parameters are only used for their layout and storage."""
from __future__ import annotations
import contextlib, math, os
from dataclasses import dataclass
import torch, torch.distributed as dist
import importlib
sgd_mod = importlib.import_module("torch.optim.sgd")
adam_mod = importlib.import_module("torch.optim.adam")
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard, Replicate, Partial
from torch.fx.experimental.proxy_tensor import make_fx

C10D = torch.ops._c10d_functional


@dataclass
class ShardLayout:
    """How fully_shard laid one parameter out on this rank (from public DTensor attributes only)."""
    name: str
    param: DTensor            # the sharded nn.Parameter(DTensor)
    global_shape: torch.Size
    local_rows: int           # rows this rank holds (0 < local_rows <= padded_rows, or 0)
    padded_rows: int          # ceil(dim0 / world_size): every rank's shard padded to this
    world_size: int
    group_name: str

    @property
    def local(self) -> torch.Tensor:   # the plain local tensor, a view into FSDP's padded storage
        return self.param._local_tensor


def shard_layouts(model: torch.nn.Module) -> list[ShardLayout]:
    out = []
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor) or tuple(p.placements) != (Shard(0),):
            raise ValueError(f"{name}: expected a DTensor sharded Shard(0) on a 1-D mesh, got {type(p).__name__}")
        mesh = p.device_mesh
        ws, rank = mesh.size(), mesh.get_local_rank()
        n = p.shape[0]
        padded = math.ceil(n / ws)
        local_rows = max(0, min(padded, n - rank * padded))
        assert p._local_tensor.shape[0] == local_rows, (name, p._local_tensor.shape, local_rows)
        out.append(ShardLayout(name, p, p.shape, local_rows, padded, ws, mesh.get_group().group_name))
    return out


@contextlib.contextmanager
def fsdp_hooks_disabled(model: torch.nn.Module):
    """Take FSDP2's forward pre/post hooks off every fully_shard module while tracing (put back after)."""
    saved = []
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        for dname in ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                      "_forward_hooks_with_kwargs", "_forward_hooks_always_called"):
            d = getattr(module, dname)
            saved.append((d, dict(d)))
        ids = {state._pre_forward_hook_handle.id, state._post_forward_hook_handle.id}
        for d, _ in saved[-5:]:
            for i in ids:
                d.pop(i, None)
    try:
        yield
    finally:
        for d, copy in saved:
            d.clear(); d.update(copy)


def all_gather_param(lay: ShardLayout, local: torch.Tensor, param_dtype=None) -> torch.Tensor:
    """local shard -> full parameter: pad dim 0 to padded_rows, all-gather, wait, drop the padding."""
    if param_dtype is not None:
        local = local.to(param_dtype)                      # FSDP2 casts before the all-gather
    # pad unconditionally (0 rows on ranks whose shard is full), so that every rank traces the same ops
    # and only the shapes of its local shard differ
    pad = lay.padded_rows - local.shape[0]
    local = torch.constant_pad_nd(local, [0, 0] * (local.dim() - 1) + [0, pad])
    full = C10D.all_gather_into_tensor(local.contiguous(), lay.world_size, lay.group_name)
    full = C10D.wait_tensor(full)
    return full.narrow(0, 0, lay.global_shape[0])


def reduce_scatter_grad(lay: ShardLayout, grad: torch.Tensor, reduce_dtype=None, orig_dtype=None) -> torch.Tensor:
    """full gradient -> this rank's averaged shard: pad dim 0, reduce-scatter (avg), wait, drop padding."""
    if reduce_dtype is not None:
        grad = grad.to(reduce_dtype)
    pad = lay.padded_rows * lay.world_size - grad.shape[0]
    if pad:
        grad = torch.cat([grad, grad.new_zeros((pad, *grad.shape[1:]))])
    shard = C10D.reduce_scatter_tensor(grad.contiguous(), os.environ.get("RS_OP", "avg"), lay.world_size, lay.group_name)
    shard = C10D.wait_tensor(shard)
    shard = shard.narrow(0, 0, lay.local_rows)
    return shard.to(orig_dtype) if orig_dtype is not None else shard


def dtensor_full_param(lay: ShardLayout, local: torch.Tensor) -> torch.Tensor:
    """SimpleFSDP's way: wrap the local shard as Shard(0) DTensor, redistribute to Replicate (all-gather);
    to_local(grad_placements=Partial('avg')) makes the backward a reduce-scatter(avg) to Shard(0)."""
    p = lay.param
    d = DTensor.from_local(local, p.device_mesh, [Shard(0)], run_check=False, shape=p.shape, stride=p.stride())
    return d.redistribute(p.device_mesh, [Replicate()]).to_local(grad_placements=[Partial("avg")])


def optimizer_update(kind, hp, step, locals_, grads, states):
    """torch.optim's own single-tensor math on the local shards (states: per-param dict of plain tensors)."""
    if kind == "sgd":
        bufs = [s.get("momentum_buffer") for s in states]
        sgd_mod.sgd(locals_, grads, bufs, foreach=False, weight_decay=hp["weight_decay"],
                            momentum=hp["momentum"], lr=hp["lr"], dampening=0.0, nesterov=False,
                            maximize=False, has_sparse_grad=False)
        for s, b in zip(states, bufs):
            s["momentum_buffer"] = b
        return [s["momentum_buffer"] for s in states]
    # AdamW: torch.optim.adam._single_tensor_adam with decoupled weight decay; its host read of the
    # step count (_get_value) is answered with the Python step number (mutwo's host_scalars does this properly)

    orig = adam_mod._get_value
    adam_mod._get_value = lambda t: float(step)
    try:
        adam_mod._single_tensor_adam(
            locals_, grads, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], [],
            [s["step"] for s in states], grad_scale=None, found_inf=None, amsgrad=False, has_complex=False,
            beta1=hp["betas"][0], beta2=hp["betas"][1], lr=hp["lr"], weight_decay=hp["weight_decay"],
            eps=hp["eps"], maximize=False, capturable=False, differentiable=False,
            decoupled_weight_decay=True)
    finally:
        adam_mod._get_value = orig
    return []


def fsdp_groups(model: torch.nn.Module, layouts: list[ShardLayout]) -> list[list[int]]:
    """Indices of layouts per fully_shard module (its FSDPParamGroup): the parameters under it that are not
    under a nested fully_shard module; found from the module tree and isinstance(m, FSDPModule) only."""
    index = {l.name: i for i, l in enumerate(layouts)}
    groups = []
    def visit(module, prefix, group):
        if isinstance(module, FSDPModule):
            group = []
            groups.append(group)
        for pname, _ in module.named_parameters(recurse=False):
            group.append(index[prefix + pname])
        for cname, child in module.named_children():
            visit(child, prefix + cname + ".", group)
    visit(model, "", None)
    return [g for g in groups if g]


def all_gather_group(lays, locals_, param_dtype=None):
    """FSDP2's foreach_all_gather: one all-gather of the concatenated padded shards, then copy-out per param."""
    ws, group_name = lays[0].world_size, lays[0].group_name
    flat = []
    for lay, local in zip(lays, locals_):
        if param_dtype is not None:
            local = local.to(param_dtype)
        local = torch.constant_pad_nd(local, [0, 0] * (local.dim() - 1) + [0, lay.padded_rows - local.shape[0]])
        flat.append(local.reshape(-1))
    numels = [t.numel() for t in flat]
    out = C10D.wait_tensor(C10D.all_gather_into_tensor(torch.cat(flat), ws, group_name)).view(ws, -1)
    fulls = []
    for lay, piece in zip(lays, out.split(numels, dim=1)):
        full = piece.contiguous().view(ws * lay.padded_rows, *lay.global_shape[1:])   # split_with_sizes_copy
        fulls.append(full.narrow(0, 0, lay.global_shape[0]))
    return fulls


def reduce_scatter_group(lays, grads, reduce_dtype=None, orig_dtype=None):
    """FSDP2's foreach_reduce: chunk_cat the padded gradients, one reduce-scatter (avg), view out per param."""
    ws, group_name = lays[0].world_size, lays[0].group_name
    chunks = []
    for lay, g in zip(lays, grads):
        if reduce_dtype is not None:
            g = g.to(reduce_dtype)
        g = torch.constant_pad_nd(g, [0, 0] * (g.dim() - 1) + [0, ws * lay.padded_rows - g.shape[0]])
        chunks.append(g.reshape(ws, -1))
    numels = [c.shape[1] for c in chunks]
    out = C10D.wait_tensor(C10D.reduce_scatter_tensor(torch.cat(chunks, dim=1).reshape(-1), os.environ.get("RS_OP", "avg"),
                                                      ws, group_name))
    shards = []
    for lay, piece in zip(lays, out.split(numels)):
        shard = piece.view(lay.padded_rows, *lay.global_shape[1:]).narrow(0, 0, lay.local_rows)
        shards.append(shard.to(orig_dtype) if orig_dtype is not None else shard)
    return shards


def make_step(model, layouts, buffer_names, loss_fn, kind, hp, step, variant, mp=None):
    """mp: (param_dtype, reduce_dtype) as fully_shard's MixedPrecisionPolicy, or None."""
    param_dtype, reduce_dtype = mp if mp else (None, None)
    groups = fsdp_groups(model, layouts)
    names = [l.name for l in layouts]
    n_p, n_b = len(layouts), len(buffer_names)
    state_keys = {"sgd": ["momentum_buffer"] if step > 1 else [], "adamw": ["step", "exp_avg", "exp_avg_sq"]}[kind]

    def fn(*flat):
        locals_ = list(flat[:n_p])
        buffers = dict(zip(buffer_names, flat[n_p:n_p + n_b]))
        cursor = n_p + n_b
        states = []
        for _ in layouts:
            states.append(dict(zip(state_keys, flat[cursor:cursor + len(state_keys)])))
            cursor += len(state_keys)
        x, y = flat[cursor:]
        if param_dtype is not None and x.is_floating_point():   # MixedPrecisionPolicy.cast_forward_inputs
            x = x.to(param_dtype)
        if variant == "funcol":
            with torch.no_grad():  # FSDP2's unsharded parameters are autograd leaves too
                fulls = [all_gather_param(l, t, param_dtype).detach().requires_grad_() for l, t in zip(layouts, locals_)]
        elif variant == "grouped":
            fulls = [None] * len(layouts)
            with torch.no_grad():
                for g in groups:
                    for i, f in zip(g, all_gather_group([layouts[i] for i in g], [locals_[i] for i in g], param_dtype)):
                        fulls[i] = f.detach().requires_grad_()
        else:
            leaves = [t.detach().requires_grad_() for t in locals_]
            fulls = [dtensor_full_param(l, t) for l, t in zip(layouts, leaves)]
        with torch.enable_grad(), fsdp_hooks_disabled(model):
            out = torch.func.functional_call(model, ({**dict(zip(names, fulls)), **buffers}), (x,))
            loss = loss_fn(out, y)
        end_phase("fwd")
        orig_dtype = layouts[0].local.dtype if param_dtype is not None else None
        if variant == "funcol":
            full_grads = torch.autograd.grad(loss, fulls)
            grads = [reduce_scatter_grad(l, g, reduce_dtype, orig_dtype) for l, g in zip(layouts, full_grads)]
        elif variant == "grouped":
            full_grads = torch.autograd.grad(loss, fulls)
            grads = [None] * len(layouts)
            for g in reversed(groups):   # backward order
                for i, sh in zip(g, reduce_scatter_group([layouts[i] for i in g], [full_grads[i] for i in g],
                                                         reduce_dtype, orig_dtype)):
                    grads[i] = sh
        else:  # grads w.r.t. the DTensor-wrapped local shards come out reduce-scattered
            grads = torch.autograd.grad(loss, leaves)
        end_phase("bwd")
        with torch.no_grad():
            new_state = optimizer_update(kind, hp, step, locals_, grads, states)
        return (loss.detach(), *grads, *new_state)
    return fn



# ---------------------------------------------------------------------------------------------------
# "re-gathering a parameter is recomputing it": a tiny planner pass on the captured graph
PHASE = "proto_phase"


def end_phase(tag: str) -> None:
    """Tag every node traced so far that has no phase yet (as mutwo's _end_phase does)."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode
    mode = get_proxy_mode()
    if mode is not None:
        for node in mode.tracer.graph.nodes:
            node.meta.setdefault(PHASE, tag)


_CHEAP = {"constant_pad_nd", "all_gather_into_tensor", "wait_tensor", "slice", "alias", "t", "view", "detach",
          "_to_copy", "cat", "reshape", "split_with_sizes", "split", "getitem", "clone", "permute", "transpose",
          "expand", "unsqueeze", "squeeze", "_unsafe_view", "narrow"}


def _name(node):
    t = node.target
    return getattr(t, "__name__", str(t)).split(".")[0]


def regather_in_backward(gm: torch.fx.GraphModule, n_params: int) -> int:
    """Every forward value computed from parameter shards only (through their all-gathers and views) that the
    backward reads is computed again right before its first backward use: the full parameter then dies after
    its last forward use, as under fully_shard(reshard_after_forward=True). Returns the all-gathers added."""
    g = gm.graph
    param_placeholders = [n for n in g.nodes if n.op == "placeholder"][:n_params]
    from_params: set = set(param_placeholders)
    for n in g.nodes:   # forward nodes whose inputs all come from parameter shards through cheap ops
        if n.op == "call_function" and n.meta.get(PHASE) == "fwd" and _name(n) in _CHEAP and n.all_input_nodes \
                and all(i in from_params for i in n.all_input_nodes):
            from_params.add(n)
    gathered = {n for n in from_params if n.op == "call_function" and _name(n) == "all_gather_into_tensor"}
    memo: dict = {}
    added = 0

    def clone(n, before):
        nonlocal added
        if n in memo or n.op == "placeholder":
            return memo.get(n, n)
        for i in n.all_input_nodes:
            clone(i, before)
        with g.inserting_before(before):
            memo[n] = g.node_copy(n, lambda a: memo.get(a, a))
        memo[n].meta[PHASE] = "bwd"
        added += _name(n) == "all_gather_into_tensor"
        return memo[n]

    def needs_gather(n):   # does n's ancestry inside from_params contain an all-gather?
        stack, seen = [n], set()
        while stack:
            m = stack.pop()
            if m in gathered:
                return True
            if m in seen or m.op == "placeholder":
                continue
            seen.add(m)
            stack.extend(i for i in m.all_input_nodes if i in from_params)
        return False

    for u in list(g.nodes):
        if u.meta.get(PHASE) != "bwd" or u.op != "call_function":
            continue
        for v in u.all_input_nodes:
            if v in from_params and v.op != "placeholder" and v.meta.get(PHASE) == "fwd" and needs_gather(v):
                u.replace_input_with(v, clone(v, u))
    g.lint()
    gm.recompile()
    return added
