"""Q1: fake-mode make_fx of loss.backward() under fully_shard after an eager step did lazy init:
it 'works', but what is in the graph, and what did it do to the module?"""
import collections, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.fx.experimental.proxy_tensor import make_fx
from common import init, MLP, log, sharded_mlp
rank, ws = init()
m = sharded_mlp()
x = torch.randn(4, 8)
m(x).sum().backward()
for p in m.parameters(): p.grad = None
def step(x):
    loss = m(x).square().mean(); loss.backward()
    return loss
gm = make_fx(step, tracing_mode="fake", _allow_non_fake_inputs=True)(x)
ops = collections.Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
log("ops with c10d/fsdp/resize/set:", {k: v for k, v in ops.items() if any(s in k for s in ("c10d", "fsdp", "resize", "set_", "copy_"))})
log("placeholders:", [n.name for n in gm.graph.nodes if n.op == "placeholder"],
    "get_attr constants:", sum(n.op == "get_attr" for n in gm.graph.nodes))
log("outputs:", gm.graph.output_node().args)
log("module grads after tracing:", [type(p.grad).__name__ + "/" + type(p.grad._local_tensor).__name__ if p.grad is not None else None for p in m.parameters()])
log("a sharded-param local tensor is now:", type(next(m.parameters())._local_tensor).__name__)
dist.destroy_process_group()
