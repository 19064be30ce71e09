"""A tiny language model whose head the ``chunk`` pass slices (tests/test_chunk.py): an embedding,
one tanh layer and a head of VOCAB logits, wider than its WIDTH-wide input, with the loss forms
the pass handles (mean with ignored targets, sum, label smoothing, a scaled loss) and two it
refuses (a z-loss on the logits' log-sum-exp, class weights). Also a python model source for
mutwo-opt: ``name: tests/tinyhead.py:tinyhead``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

VOCAB = 1000
WIDTH = 32
IGNORED = -100


class TinyHead(nn.Module):
    def __init__(self, bias: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.hidden = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=bias)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.hidden(self.embed(tokens))))


def _cross_entropy(logits: torch.Tensor, batch: Any, **options: Any) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), batch[1].flatten(), ignore_index=IGNORED, **options)


def _z_loss(logits: torch.Tensor, batch: Any) -> torch.Tensor:
    # PaLM's auxiliary loss: its gradient needs the log-sum-exp of every row before the slices run.
    return _cross_entropy(logits, batch) + 1e-4 * logits.logsumexp(-1).pow(2).mean()


LOSSES: dict[str, Callable[[torch.Tensor, Any], torch.Tensor]] = {
    "mean": _cross_entropy,
    "sum": lambda logits, batch: _cross_entropy(logits, batch, reduction="sum"),
    "smoothed": lambda logits, batch: _cross_entropy(logits, batch, label_smoothing=0.1),
    "scaled": lambda logits, batch: _cross_entropy(logits, batch) / 3,  # as gradient accumulation scales it
    "z-loss": _z_loss,
    "weighted": lambda logits, batch: _cross_entropy(logits, batch, weight=torch.linspace(0.5, 1.5, VOCAB)),
}


def tinyhead(batch_size: int = 4, seq: int = 16, loss: str = "mean", bias: bool = True,
             seed: int = 0) -> tuple[nn.Module, Any, Callable[[torch.Tensor, Any], torch.Tensor]]:  # fmt: skip
    """(model, batch, loss_fn): token batches whose first target of each row is ignored."""
    torch.manual_seed(seed)
    tokens, targets = torch.randint(0, VOCAB, (2, batch_size, seq))
    targets[:, 0] = IGNORED
    return TinyHead(bias), (tokens, targets), LOSSES[loss]
