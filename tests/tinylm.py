"""A transformer written by hand as issue 40's user wrote theirs, for the python model source
(``name: tests/tinylm.py:tinylm``): embedding plus a learned positional embedding ``pos``,
``nn.MultiheadAttention`` with attention dropout (SDPA's, on the CPU its math kernel's
``bernoulli_``), ``nn.Dropout`` on its output (a transposed tensor: MultiheadAttention computes
sequence-first inside), ``F.dropout``, layer norms, and a label-smoothed cross-entropy that ignores
masked positions. One block of width 16: Inductor compiles its whole step in tens of seconds on 2
CPU cores."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

VOCAB = 32
IGNORED = -100


class Block(nn.Module):
    def __init__(self, width: int, heads: int, p: float) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(width, heads, dropout=p, batch_first=True)
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.feed = nn.Linear(width, width)
        self.dropout = nn.Dropout(p)
        self.p = p

    def forward(self, x: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        attended, _ = self.attention(h, h, h, attn_mask=causal, need_weights=False)
        x = x + self.dropout(attended)
        return x + F.dropout(F.gelu(self.feed(self.norm2(x))), self.p, self.training)


class TinyLM(nn.Module):
    def __init__(self, width: int = 16, heads: int = 2, seq: int = 8, layers: int = 1, p: float = 0.1) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.pos = nn.Parameter(torch.randn(seq, width) * 0.02)
        self.blocks = nn.ModuleList(Block(width, heads, p) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB)
        self.dropout = nn.Dropout(p)
        self.register_buffer("causal", torch.triu(torch.full((seq, seq), float("-inf")), 1))

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.dropout(self.embed(tokens) + self.pos)
        for block in self.blocks:
            x = block(x, self.causal)
        return self.head(self.norm(x))


def smoothed_loss(logits: torch.Tensor, batch: Any) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), batch[1].flatten(), ignore_index=IGNORED, label_smoothing=0.1)


def tinylm(batch_size: int, seed: int = 0, **config: Any) -> tuple[nn.Module, Any, Any]:
    """(model, batch, loss_fn): token batches whose first two targets of each row are masked."""
    torch.manual_seed(seed)
    model = TinyLM(**config)
    seq = model.pos.shape[0]
    tokens, targets = torch.randint(0, VOCAB, (2, batch_size, seq))
    targets[:, :2] = IGNORED
    return model, (tokens, targets), smoothed_loss
