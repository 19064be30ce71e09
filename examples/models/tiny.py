"""Small models for the python model source: each factory returns (model, batch, loss_fn)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


class MLP(nn.Module):
    def __init__(self, features: int, hidden: int, classes: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Dropout(0.1),
                                    nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, classes))  # fmt: skip

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def cross_entropy(logits: torch.Tensor, batch: Any) -> torch.Tensor:
    return F.cross_entropy(logits, batch[1])


def mlp(batch_size: int, features: int = 16, hidden: int = 64, classes: int = 10) -> tuple[nn.Module, Any, Any]:
    """A three-layer MLP classifier with dropout."""
    batch = (torch.randn(batch_size, features), torch.randint(0, classes, (batch_size,)))
    return MLP(features, hidden, classes), batch, cross_entropy
