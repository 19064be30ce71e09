"""Q1: can make_fx trace forward+backward of a fully_shard-wrapped 2-layer MLP? (2 gloo ranks)"""
import sys, traceback, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.fx.experimental.proxy_tensor import make_fx
from common import init, MLP, log, sharded_mlp
rank, ws = init()

x = torch.randn(4, 8)

def attempt(name, build):
    m = sharded_mlp()
    try:
        gm = build(m)
        ops = sorted({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        log(f"OK   {name}: {len(gm.graph.nodes)} nodes; collectives:",
            [o for o in ops if "c10d" in o or "fsdp" in o])
    except Exception as e:
        tb = traceback.extract_tb(e.__traceback__)
        where = [f"{f.filename.split('site-packages/')[-1]}:{f.lineno}" for f in tb if "torch" in f.filename][-3:]
        log(f"FAIL {name}: {type(e).__name__}: {str(e).strip().splitlines()[0][:300]}\n      at {where}")
    dist.barrier()

# (a) plain: forward with autograd.grad wrt the sharded DTensor parameters
def a(m):
    params = list(m.parameters())
    def step(x):
        loss = m(x).square().mean()
        return (loss, *torch.autograd.grad(loss, params))
    return make_fx(step, tracing_mode=MODE)(x)

# (b) loss.backward() (FSDP's post-backward writes .grad of sharded params)
def b(m):
    def step(x):
        loss = m(x).square().mean(); loss.backward()
        return loss
    return make_fx(step, tracing_mode=MODE)(x)

# (c) mutwo-style: functional_call with the parameters as graph inputs
def c(m):
    names = [n for n, _ in m.named_parameters()]
    def step(x, *ps):
        out = torch.func.functional_call(m, dict(zip(names, ps)), (x,))
        loss = out.square().mean()
        return (loss, *torch.autograd.grad(loss, ps))
    ps = [p.detach().requires_grad_() for p in m.parameters()]
    return make_fx(step, tracing_mode=MODE, _allow_non_fake_inputs=True)(x, *ps)

for MODE in sys.argv[1:] or ["real", "fake"]:
    for name, fn in [("a autograd.grad", a), ("b loss.backward", b), ("c functional_call", c)]:
        attempt(f"[{MODE}] {name}", fn)
dist.destroy_process_group()
