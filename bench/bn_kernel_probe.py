"""Which kernels Inductor generates for a conv-BN-ReLU net's whole iteration compiled through mutwo's
``inductor`` backend, and what the batch-norm backward kernels read (issue 17, docs/benchmarks.md,
eighth session: on the H100 mutwo's largest backward kernels carry the batch norm's forward,
``_native_batch_norm_legit_functional``, in their names; does the name mean recomputed work?).

Prints every fused kernel's name, then the body of each backward kernel whose name also names the
forward batch norm. On the CPU (2026-11-25) such a kernel loaded the ReLU output (for its mask),
the gradient, the saved input and the saved mean, and reduced ``masked gradient * (input - mean)``:
the batch-norm backward's own reduction, no recompute of the forward's output.

    python bench/bn_kernel_probe.py > bn_kernel_probe.log
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch
from torch import nn
from torch._inductor.utils import run_and_get_code

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mutwo  # noqa: E402

#: Where a kernel's source ends in Inductor's output code (the close of its raw string).
KERNEL_END = "''')"


class ConvBnRelu(nn.Module):
    """Two conv-BN-ReLU blocks and a linear head, as a ResNet stage in miniature."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(8, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)
        self.c2, self.b2 = nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)
        self.fc = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.b1(self.c1(x)))
        x = torch.relu(self.b2(self.c2(x)))
        return self.fc(x.mean((2, 3)))


def main() -> None:
    torch.manual_seed(0)
    model = ConvBnRelu().to(memory_format=torch.channels_last)
    optimizer = torch.optim.Adam(model.parameters())
    batch = torch.randn(4, 8, 16, 16).to(memory_format=torch.channels_last)
    _, code = run_and_get_code(mutwo.optimize, model, optimizer, batch, lambda out, b: out.square().mean(),
                               passes="profile", backend="inductor")  # fmt: skip
    source = "\n".join(code)
    names = sorted(set(re.findall(r"^(\w*fused\w*) = async_compile", source, flags=re.MULTILINE)))
    print("\n".join(names))
    for name in names:
        if "native_batch_norm_legit_functional" in name and "backward" in name:
            start = source.index(f"{name} = async_compile")
            end = source.find(KERNEL_END, start)
            print(f"\n== {name}\n{source[start:end]}")


if __name__ == "__main__":
    main()
