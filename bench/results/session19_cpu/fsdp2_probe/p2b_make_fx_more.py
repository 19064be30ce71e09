"""Q1 continued: the real-mode graph of loss.backward() under fully_shard, and fake mode after lazy init
with _allow_non_fake_inputs=True."""
import sys, traceback, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.fx.experimental.proxy_tensor import make_fx
from common import init, MLP, log, sharded_mlp
rank, ws = init()
x = torch.randn(4, 8)

m = sharded_mlp()
def step(x):
    loss = m(x).square().mean(); loss.backward()
    return loss
gm = make_fx(step, tracing_mode="real")(x)
lines = [l for l in gm.code.splitlines() if "c10d" in l or "fsdp" in l or "getitem" in l and "_base_" in l]
log("REAL-MODE graph, communication lines:\n" + "\n".join(lines[:20]))
log("placeholders:", [n.name for n in gm.graph.nodes if n.op == "placeholder"], "get_attr:", len([n for n in gm.graph.nodes if n.op == 'get_attr']))
log("grads after tracing (written eagerly by hooks, outside the graph):", [type(p.grad).__name__ for p in m.parameters()])
# replay it: does running the graph update .grad? (no: .grad writes are Python side effects)
for p in m.parameters(): p.grad = None
try:
    out = gm(x); log("replay OK, loss", out.item(), "grads after replay:", [p.grad is not None for p in m.parameters()])
except Exception as e:
    log("replay FAIL:", type(e).__name__, str(e).splitlines()[0][:300])
dist.barrier()

# fake mode after an eager step did the lazy init
m = sharded_mlp(); m(x).sum().backward()
for p in m.parameters(): p.grad = None
try:
    gm = make_fx(step, tracing_mode="fake", _allow_non_fake_inputs=True)(x)
    log("FAKE OK", len(gm.graph.nodes))
except Exception as e:
    tb = traceback.extract_tb(e.__traceback__)
    where = [f"{f.filename.split('site-packages/')[-1]}:{f.lineno}" for f in tb if "torch" in f.filename][-4:]
    log(f"FAKE FAIL: {type(e).__name__}: {str(e).strip().splitlines()[0][:300]}\n      at {where}")
dist.destroy_process_group()
