import torch, copy, sys
sys.path.insert(0, '.')
from mutwo.tools.experiment import build_training
t = build_training(sys.argv[2] if len(sys.argv) > 2 else 'examples/resnet152.yaml', int(sys.argv[1]))
m32 = t.model; m64 = copy.deepcopy(m32).double()
def grads(m, batch):
    m.zero_grad()
    out = m(*batch) if not isinstance(batch, dict) else m(**batch)
    loss = t.loss_fn(out, batch); loss.backward()
    return loss.item(), {n: p.grad.detach().clone() for n, p in m.named_parameters()}
b = t.batch
l32, g32 = grads(m32, b)
b64 = tuple(x.double() if x.is_floating_point() else x for x in b)
l64, g64 = grads(m64, b64)
print('loss', l32, l64)
worst = []
for n in g32:
    d = (g32[n].double() - g64[n]).abs().max().item(); mx = g64[n].abs().max().item()
    worst.append((d / max(mx, 1e-30), n, d, mx))
worst.sort(reverse=True)
for w in worst[:8]: print(w)
print('conv1', [w for w in worst if w[1]=='net.conv1.weight'])
