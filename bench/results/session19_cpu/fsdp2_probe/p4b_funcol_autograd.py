"""Q4: the raw functional collectives have no autograd formula; the *_autograd variants back-propagate
with a 'sum' reduce-scatter only (no 'avg'): why the captured step makes the gathered parameters leaves."""
import warnings, torch, torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from common import init, log
rank, ws = init()
C = torch.ops._c10d_functional
g = dist.group.WORLD.group_name
x = torch.randn(2, 3, requires_grad=True)
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    y = C.wait_tensor(C.all_gather_into_tensor(x, ws, g))
    try:
        y.sum().backward(); log("raw all_gather_into_tensor backward: grad", x.grad)
    except Exception as e:
        log("raw all_gather_into_tensor backward FAILS:", type(e).__name__, str(e).splitlines()[0][:200])
    log("warnings:", [str(m.message).splitlines()[0][:160] for m in w][:2])
try:
    z = funcol.all_gather_tensor_autograd(x, 0, dist.group.WORLD)
    z = funcol.wait_tensor(z) if not isinstance(z, torch.Tensor) or type(z) is not torch.Tensor else z
    x.grad = None; (z * 1.0).sum().backward(); log("all_gather_tensor_autograd backward (reduce_scatter sum): grad", x.grad[0].tolist())
except Exception as e:
    log("all_gather_tensor_autograd FAIL", type(e).__name__, str(e).splitlines()[0][:200])
try:
    big = torch.randn(4, 3, requires_grad=True)
    r = funcol.reduce_scatter_tensor_autograd(big, "avg", 0, dist.group.WORLD)
    (r * 1.0).sum().backward(); log("reduce_scatter_tensor_autograd avg backward: OK")
except Exception as e:
    log("reduce_scatter_tensor_autograd('avg') backward FAILS:", type(e).__name__, str(e).splitlines()[0][:200])
dist.destroy_process_group()
