"""Eager ResNet-152 (zero-init residuals, batch 2): gradients with the model in channels-last vs
contiguous memory (other convolution kernels, other rounding), compared as mutwo's check does."""
import copy, sys, torch
sys.path.insert(0, '.')
from mutwo.tools.experiment import build_training
t = build_training('/tmp/w17c/resnet152_zir.yaml', 2)
a = t.model; b = copy.deepcopy(a).to(memory_format=torch.channels_last)
def grads(m, batch):
    m.zero_grad()
    loss = t.loss_fn(m(*batch), batch); loss.backward()
    return loss.item(), {n: p.grad.detach().clone() for n, p in m.named_parameters()}
la, ga = grads(a, t.batch)
images, labels = t.batch
lb, gb = grads(b, (images.contiguous(memory_format=torch.channels_last), labels))
print('loss', la, lb)
bad = []
for n in ga:
    if not torch.allclose(gb[n], ga[n], rtol=1e-3, atol=1e-5):
        bad.append((n, (gb[n] - ga[n]).abs().max().item(), ga[n].abs().max().item()))
print(len(bad), 'of', len(ga), 'gradients outside rtol 1e-3 atol 1e-5')
for x in bad[:12]: print(x)
