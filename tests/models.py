"""Tiny models, batches and losses for the tests, and eager torch.optim training to compare with."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mutwo.tools import workloads

# The tests build the same kind of workloads as the CLI: one set of wrappers for both.
Workload = workloads.Workload
Classifier = workloads.ImageClassifier
cross_entropy = workloads.classification_loss


def mlp(seed: int = 0, batch_size: int = 4) -> Workload:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 5))
    batch = (torch.randn(batch_size, 16), torch.randint(0, 5, (batch_size,)))
    return Workload(Classifier(net), batch, cross_entropy)


def cnn(seed: int = 0, batch_size: int = 4) -> Workload:
    torch.manual_seed(seed)
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
    )  # fmt: skip
    batch = (torch.randn(batch_size, 3, 16, 16), torch.randint(0, 10, (batch_size,)))
    return Workload(Classifier(net), batch, cross_entropy)


def bert(seed: int = 0, batch_size: int = 2, seq_len: int = 16, attn: str = "sdpa", mask: bool = True) -> Workload:
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64, attn_implementation=attn)  # fmt: skip
    model = BertForMaskedLM(config)
    input_ids = torch.randint(0, 100, (batch_size, seq_len))
    batch: dict[str, torch.Tensor] = {"input_ids": input_ids, "labels": input_ids.clone()}
    if mask:
        attention_mask = torch.ones(batch_size, seq_len, dtype=torch.long)
        attention_mask[0, seq_len // 2:] = 0
        batch["attention_mask"] = attention_mask
    return Workload(model, batch, lambda output, _batch: output.loss)


def gpt2(seed: int = 0) -> Workload:
    """A tiny GPT-2 with a large vocabulary and a short sequence: its peak is at the end of the
    backward, summing the tied embedding's two gradients, with Adam's state and most gradients live."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=2048, n_positions=32, n_embd=64, n_layer=2, n_head=2))
    input_ids = torch.randint(0, 2048, (1, 8))
    return Workload(model, {"input_ids": input_ids, "labels": input_ids.clone()}, lambda output, _batch: output.loss)


OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": lambda params, **kw: torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3, nesterov=True, **kw),
    "adam": lambda params, **kw: torch.optim.Adam(params, lr=1e-2, weight_decay=1e-3, **kw),
    "adamw": lambda params, **kw: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.05, **kw),
}


def call_model(model: nn.Module, batch: Any) -> Any:
    if isinstance(batch, dict):
        return model(**batch)
    return model(*batch)


def eager_step(workload: Workload, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """One eager training iteration, as a user would write it."""
    optimizer.zero_grad(set_to_none=True)
    loss = workload.loss_fn(call_model(workload.model, workload.batch), workload.batch)
    loss.backward()
    optimizer.step()
    return loss.detach()
