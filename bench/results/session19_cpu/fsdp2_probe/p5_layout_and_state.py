"""Q3: reading each parameter's shard layout, optimizer state and state_dict from a fully_shard model,
and whether writing the plain local tensors in place is seen by FSDP2 (its padded storage) and by DTensor."""
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard, FSDPModule
from torch.distributed.tensor import DTensor
from common import init, MLP, log, sharded_mlp
import os; os.environ["ALL_RANKS"] = "1"
from fsdp_capture import shard_layouts
rank, ws = init()
m = sharded_mlp()
opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
m(torch.randn(4, 8)).sum().backward(); opt.step(); opt.zero_grad()
p = m.l1.weight
log("to_local() shares the local storage:", p.to_local().data_ptr() == p._local_tensor.data_ptr(),
    "| to_local() is _local_tensor:", p.to_local() is p._local_tensor)
# FSDP2's private view of the same parameter
fp = m.l1._get_fsdp_state()._fsdp_param_group.fsdp_params[0]
log("FSDPParam: orig", tuple(fp._orig_size), "sharded_size", tuple(fp.sharded_size), "padded", tuple(fp.padded_sharded_param_size),
    "_sharded_param_data", tuple(fp._sharded_param_data.shape), "same storage as local:",
    fp._sharded_param_data.untyped_storage().data_ptr() == p._local_tensor.untyped_storage().data_ptr())
for l in shard_layouts(m):
    log("layout", l.name, "global", tuple(l.global_shape), "local_rows", l.local_rows, "padded_rows", l.padded_rows,
        "group", l.group_name)
# in-place write to the local tensor: seen by the next eager FSDP2 all-gather?
with torch.no_grad():
    p._local_tensor.add_(1.0)
    full = p.full_tensor()   # DTensor all-gather (public API)
m.l1.unshard(); unsharded = m.l1.weight.detach().clone(); m.l1.reshard()   # FSDP2's own all-gather
log("after in-place add on the local tensor: FSDP2 unshard == DTensor.full_tensor():", torch.equal(full, unsharded),
    "; padding of FSDP storage still zero:", bool((fp._sharded_param_data[p._local_tensor.numel():] == 0).all()))
st = opt.state[p]
log("opt state:", {k: (type(v).__name__, tuple(v.to_local().shape) if isinstance(v, DTensor) else tuple(v.shape)) for k, v in st.items()})
sd = opt.state_dict()["state"][0]
log("optimizer.state_dict() state[0]:", {k: type(v).__name__ for k, v in sd.items()})
msd = m.state_dict()
log("model.state_dict():", {k: (type(v).__name__, v.placements) for k, v in msd.items()})
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict, StateDictOptions
full_sd = get_model_state_dict(m, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
log("get_model_state_dict(full_state_dict=True):", {k: (type(v).__name__, tuple(v.shape)) for k, v in full_sd.items()})
osd = get_optimizer_state_dict(m, opt)
k0 = next(iter(osd["state"]))
log("get_optimizer_state_dict:", k0, {k: type(v).__name__ for k, v in osd["state"][k0].items()})
dist.destroy_process_group()
