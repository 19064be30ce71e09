"""Q1/Q3: what fully_shard does to a module, eager on 2 gloo ranks."""
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard, FSDPModule
from torch.distributed.tensor import DTensor
from common import init, MLP, log, sharded_mlp
rank, ws = init()
m = sharded_mlp()
log("type:", type(m).__mro__[:3])
for n, p in m.named_parameters():
    log(n, type(p).__name__, p.placements, "global", tuple(p.shape), "local", tuple(p.to_local().shape),
        "is Parameter", isinstance(p, torch.nn.Parameter))
state = m.l1._get_fsdp_state()
pg = state._fsdp_param_group
log("param group:", pg, [ (fp._param_fqn, tuple(fp.padded_sharded_param_size), tuple(fp.sharded_size), fp._sharded_param_data.shape) for fp in pg.fsdp_params])
log("forward pre hooks on l1:", m.l1._forward_pre_hooks, "post:", m.l1._forward_hooks)
opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
loss = m(x).square().mean(); loss.backward()
for n, p in m.named_parameters():
    log("grad", n, type(p.grad).__name__, p.grad.placements, tuple(p.grad.to_local().shape))
opt.step()
for p, st in opt.state.items():
    log("opt state", {k: (type(v).__name__, getattr(v, 'placements', None), tuple(v.shape)) for k, v in st.items()})
    break
sd = m.state_dict()
log("state_dict l1.weight:", type(sd["l1.weight"]).__name__, sd["l1.weight"].placements)
ALL = dict(m.named_parameters())["l1.weight"]
fp = pg.fsdp_params[0]
log("local tensor is narrow view of padded storage:", ALL._local_tensor.data_ptr() == fp._sharded_param_data.data_ptr(),
    ALL._local_tensor.untyped_storage().nbytes())
import os
os.environ["ALL_RANKS"] = "1"
log("local shape of l1.weight", tuple(ALL.to_local().shape), "padded", tuple(fp.padded_sharded_param_size))
dist.destroy_process_group()
