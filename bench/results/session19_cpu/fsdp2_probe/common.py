import os, torch, torch.distributed as dist
from torch import nn

def init():
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    return dist.get_rank(), dist.get_world_size()

class MLP(nn.Module):
    # 5 rows in the first weight: uneven over 2 ranks -> padding
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(8, 5)
        self.l2 = nn.Linear(5, 3)
    def forward(self, x):
        return self.l2(torch.relu(self.l1(x)))

def sharded_mlp():
    """The MLP from seed 0, each layer and the root wrapped with fully_shard."""
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    m = MLP(); fully_shard(m.l1); fully_shard(m.l2); fully_shard(m)
    return m

def log(*a):
    if dist.get_rank() == 0 or os.environ.get("ALL_RANKS"):
        print(f"[rank{dist.get_rank()}]", *a, flush=True)
