"""Q2: capture whole FSDP2 steps with explicit funcol all-gathers / reduce-scatters (or SimpleFSDP's
DTensor redistribute) and compare them with eager fully_shard over 3 steps.
usage: p3_fsdp_step_vs_eager.py MODEL OPT VARIANT [--print-graph]"""
import sys, collections, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.fx.experimental.proxy_tensor import make_fx
from common import init, log
from models import build, batch, loss_fn
from fsdp_capture import shard_layouts, make_step
rank, ws = init()

MP = None
if "--mp" in sys.argv:      # MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
    MP = (torch.bfloat16, torch.float32)
if "--mp-bf16-reduce" in sys.argv:
    MP = (torch.bfloat16, None)

def wrap(name):
    from torch.distributed.fsdp import MixedPrecisionPolicy
    kw = dict(mp_policy=MixedPrecisionPolicy(param_dtype=MP[0], reduce_dtype=MP[1])) if MP else {}
    m, children = build(name)
    for c in children:
        if any(True for _ in c.parameters()):
            fully_shard(c, **kw)
    fully_shard(m, **kw)
    return m

def hp_of(kind):
    return dict(lr=0.1, momentum=0.9, weight_decay=1e-2) if kind == "sgd" else \
           dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)

def make_opt(kind, params):
    hp = hp_of(kind)
    return torch.optim.SGD(params, **hp) if kind == "sgd" else torch.optim.AdamW(params, **hp)

def diff(a, b):
    return 0.0 if torch.equal(a, b) else (a - b).abs().max().item()

def run(model_name, kind, variant, print_graph=False):
    ref, cap = wrap(model_name), wrap(model_name)
    ref_opt, cap_opt = make_opt(kind, ref.parameters()), make_opt(kind, cap.parameters())
    layouts = shard_layouts(cap)
    buffer_names = [n for n, _ in cap.named_buffers()]
    buffers = dict(cap.named_buffers())
    lf = lambda out, y: loss_fn(model_name, out, y)
    # optimizer state as plain local tensors (what a captured step reads and writes in place)
    local_state = [dict() for _ in layouts]
    if kind == "adamw":
        for st, l in zip(local_state, layouts):
            st.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(l.local), exp_avg_sq=torch.zeros_like(l.local))
    worst = collections.defaultdict(float)
    for step in range(1, 4):
        x, y = batch(model_name, rank, step)
        # eager FSDP2
        ref_opt.zero_grad(set_to_none=True)
        ref_loss = lf(ref(x), y); ref_loss.backward(); ref_grads = [p.grad.to_local().clone() for p in ref.parameters()]
        ref_opt.step()
        # captured step (traced again each step: the optimizer's step count and first-step state are baked in)
        keys = {"sgd": ["momentum_buffer"] if step > 1 else [], "adamw": ["step", "exp_avg", "exp_avg_sq"]}[kind]
        flat = [l.local for l in layouts] + [buffers[n] for n in buffer_names] + \
               [st[k] for st in local_state for k in keys] + [x, y]
        fn = make_step(cap, layouts, buffer_names, lf, kind, hp_of(kind), step, variant, MP)
        gm = make_fx(fn, tracing_mode="fake", _allow_non_fake_inputs=True)(*flat)
        if "--regather" in sys.argv:
            from fsdp_capture import regather_in_backward
            added = regather_in_backward(gm, len(layouts))
            if step == 1:
                log(f"{model_name}/{kind}/{variant}: re-gather pass added {added} all-gathers in the backward")
        if step == 1:
            ops = collections.Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function"
                                      and "c10d" in str(n.target))
            log(f"{model_name}/{kind}/{variant}: graph of {len(gm.graph.nodes)} nodes, collectives {dict(ops)}")
            if print_graph:
                open(f"graph_{model_name}_{kind}_{variant}{'' if rank == 0 else '.rank1'}.txt", "w").write(gm.code)
        with torch.no_grad():
            outs = gm(*flat)
        loss, grads = outs[0], outs[1:1 + len(layouts)]
        if kind == "sgd":
            for st, b in zip(local_state, outs[1 + len(layouts):]):
                st["momentum_buffer"] = b
        worst["loss"] = max(worst["loss"], diff(loss, ref_loss.detach()))
        worst["grad"] = max([worst["grad"]] + [diff(g, r) for g, r in zip(grads, ref_grads)])
        worst["param"] = max([worst["param"]] + [diff(l.local, p.to_local()) for l, p in zip(layouts, ref.parameters())])
        for st, p in zip(local_state, ref.parameters()):
            for k, v in ref_opt.state[p].items():
                v = v.to_local() if isinstance(v, DTensor) else v
                worst["opt_state"] = max(worst["opt_state"], diff(st[k], v))
        worst["buffers"] = max([worst["buffers"]] + [diff(b, rb) for (_, b), (_, rb) in zip(cap.named_buffers(), ref.named_buffers())])
    # every rank's worst difference
    t = torch.tensor(list(worst.values()), dtype=torch.float64); dist.all_reduce(t, op=dist.ReduceOp.MAX)
    verdict = "BITWISE" if t.max().item() == 0 else "DIFFERS"
    log(f"{model_name}/{kind}/{variant}{'/mp' if MP else ''}{'/regather' if '--regather' in sys.argv else ''}: 3 steps vs eager fully_shard, max |diff| over ranks: "
        + ", ".join(f"{k}={v:.3g}" for k, v in zip(worst, t.tolist())) + f" -> {verdict}")

args = [a for a in sys.argv[1:] if not a.startswith("--")]
models = args[0].split(",") if args else ["mlp", "cnn", "transformer"]
kinds = args[1].split(",") if len(args) > 1 else ["sgd", "adamw"]
variants = args[2].split(",") if len(args) > 2 else ["funcol", "dtensor"]
for m in models:
    for k in kinds:
        for v in variants:
            try:
                run(m, k, v, "--print-graph" in sys.argv)
            except Exception as e:
                import traceback
                log(f"{m}/{k}/{v}: FAIL {type(e).__name__}: {str(e).splitlines()[0][:400]}")
                if rank == 0: traceback.print_exc()
            dist.barrier()
dist.destroy_process_group()
