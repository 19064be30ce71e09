"""Q4: which tensor collectives does gloo (CPU) support, eagerly and as functional collectives."""
import torch, torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.distributed_c10d import ReduceOp
from common import init, log
rank, ws = init()
x = torch.arange(4.0) + 10 * rank
def t(name, fn):
    try:
        r = fn(); log(f"OK   {name}: {r}")
    except Exception as e:
        log(f"FAIL {name}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
def rs(op):
    out = torch.empty(2); dist.reduce_scatter_tensor(out, x.clone(), op=op); return out
def ag():
    out = torch.empty(8); dist.all_gather_into_tensor(out, x[:4].clone()); return out
t("c10d all_gather_into_tensor", ag)
t("c10d reduce_scatter_tensor SUM", lambda: rs(ReduceOp.SUM))
t("c10d reduce_scatter_tensor AVG", lambda: rs(ReduceOp.AVG))
t("c10d reduce_scatter_tensor PREMUL_SUM(0.5)", lambda: rs(ReduceOp.PREMUL_SUM(0.5)))
t("c10d all_reduce AVG", lambda: (lambda y: (dist.all_reduce(y, op=ReduceOp.AVG), y)[1])(x.clone()))
t("c10d reduce_scatter (list)", lambda: (lambda o: (dist.reduce_scatter(o, list(x.clone().chunk(2))), o)[1])(torch.empty(2)))
if hasattr(dist, "reduce_scatter_single"):
    t("c10d reduce_scatter_single AVG", lambda: (lambda o: (dist.reduce_scatter_single(o, x.clone(), op=ReduceOp.AVG), o)[1])(torch.empty(2)))
    t("c10d all_gather_single", lambda: (lambda o: (dist.all_gather_single(o, x.clone()), o)[1])(torch.empty(8)))
g = dist.group.WORLD
t("funcol all_gather_tensor", lambda: funcol.all_gather_tensor(x, 0, g).wait() if hasattr(funcol.all_gather_tensor(x,0,g),'wait') else funcol.all_gather_tensor(x, 0, g))
t("funcol reduce_scatter_tensor sum", lambda: funcol.reduce_scatter_tensor(x, "sum", 0, g) * 1)
t("funcol reduce_scatter_tensor avg", lambda: funcol.reduce_scatter_tensor(x, "avg", 0, g) * 1)
t("funcol all_reduce avg", lambda: funcol.all_reduce(x, "avg", g) * 1)
t("torch.ops._c10d_functional.reduce_scatter_tensor avg", lambda: torch.ops._c10d_functional.wait_tensor(
    torch.ops._c10d_functional.reduce_scatter_tensor(x, "avg", ws, g.group_name)))
t("ops._c10d_functional.all_gather_into_tensor", lambda: torch.ops._c10d_functional.wait_tensor(
    torch.ops._c10d_functional.all_gather_into_tensor(x, ws, g.group_name)))
t("ops._c10d_functional.all_gather_into_tensor_out (2.14?)", lambda: hasattr(torch.ops._c10d_functional, "all_gather_into_tensor_out"))
log("pg backend:", dist.get_backend(), type(g).__name__, g._get_backend(torch.device('cpu')).__class__.__name__)
dist.destroy_process_group()
