"""ResNet-152 (zero-init residuals, batch 2) on the CPU: torch.compile(model) gradients against eager's,
compared as mutwo's check does (rtol 1e-3, atol 1e-5)."""
import copy, sys, time, torch
sys.path.insert(0, '.')
from mutwo.tools.experiment import build_training
t = build_training('/tmp/w17c/resnet152_zir.yaml', 2)
a = t.model; b = torch.compile(copy.deepcopy(a))
def grads(m):
    m.zero_grad()
    loss = t.loss_fn(m(*t.batch), t.batch); loss.backward()
    return loss.item(), {n.replace('_orig_mod.', ''): p.grad.detach().clone() for n, p in m.named_parameters()}
la, ga = grads(a)
start = time.perf_counter(); lb, gb = grads(b); print('compile + step', round(time.perf_counter() - start, 1), 's')
print('loss', la, lb)
bad = [(n, (gb[n] - ga[n]).abs().max().item(), ga[n].abs().max().item()) for n in ga
       if not torch.allclose(gb[n], ga[n], rtol=1e-3, atol=1e-5)]
print(len(bad), 'of', len(ga), 'gradients outside rtol 1e-3 atol 1e-5')
for x in bad[:12]: print(x)
