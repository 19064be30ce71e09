"""Training options on the GPU (skipped on CPU): bf16 autocast, fp16 autocast with a GradScaler,
clipping and accumulation with torch.optim's CUDA default (foreach) form, bitwise equal to the
eager loop with deterministic kernels."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mutwo.runtime.api import MutwoStep, optimize
from mutwo.runtime.execution.backends import records_cuda_graphs
from mutwo.runtime.execution.cuda_graphs import CudaGraphRunner, graphable_optimizer
from mutwo.runtime.measurement.equivalence import deterministic_algorithms
from tests import models

pytestmark = pytest.mark.cuda


def _on_cuda(workload: models.Workload) -> models.Workload:
    workload.model.cuda()
    workload.batch = torch.utils._pytree.tree_map(lambda t: t.cuda(), workload.batch)
    return workload


def _train_side_by_side(make: Any, steps: int, options: dict[str, Any], k: int = 1,
                        scaler: bool = False, dtype: torch.dtype | None = None) -> MutwoStep:  # fmt: skip
    """Train ``make()``'s model through mutwo and eagerly side by side, bitwise equal step by step.
    Under a CUDA-graph backend the eager reference is the same AdamW made capturable, whose form
    mutwo traces for a stock one."""
    mine, eager = _on_cuda(make()), _on_cuda(make())
    my_opt = torch.optim.AdamW(mine.model.parameters(), lr=1e-3)
    eager_opt = torch.optim.AdamW(eager.model.parameters(), lr=1e-3)
    if records_cuda_graphs(options.get("backend", "eager")):
        graphable_optimizer(eager_opt, torch.device("cuda"))
    my_scaler = torch.amp.GradScaler("cuda", growth_interval=1) if scaler else None
    eager_scaler = torch.amp.GradScaler("cuda", growth_interval=1) if scaler else None
    with deterministic_algorithms():
        step = optimize(mine.model, my_opt, mine.batch, mine.loss_fn, passes="stats", accumulation_steps=k,
                        grad_scaler=my_scaler, **{"backend": "eager", **options})  # fmt: skip
        for index in range(steps * k):
            torch.manual_seed(index)
            loss = step(mine.batch)
            torch.manual_seed(index)
            with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
                expected = eager.loss_fn(models.call_model(eager.model, eager.batch), eager.batch)
            objective = expected / k if k > 1 else expected
            (eager_scaler.scale(objective) if eager_scaler else objective).backward()
            if (index + 1) % k == 0:
                if eager_scaler:
                    eager_scaler.unscale_(eager_opt)
                if options.get("max_grad_norm"):
                    torch.nn.utils.clip_grad_norm_(eager.model.parameters(), options["max_grad_norm"])
                if eager_scaler:
                    eager_scaler.step(eager_opt)
                    eager_scaler.update()
                else:
                    eager_opt.step()
                eager_opt.zero_grad(set_to_none=True)
            torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=0)
    for (name, p), q in zip(mine.model.named_parameters(), eager.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
        for key, value in eager_opt.state[q].items():
            torch.testing.assert_close(my_opt.state[p][key], value, rtol=0, atol=0, msg=f"{name}: {key}")
    if scaler:
        assert my_scaler.get_scale() == eager_scaler.get_scale()  # type: ignore[union-attr]
    return step


@pytest.mark.parametrize("make", [models.cnn, models.bert], ids=["cnn", "bert"])
def test_cuda_bf16_autocast_trains_like_eager(make: Any) -> None:
    _train_side_by_side(make, 3, {"precision": "bf16-autocast"}, dtype=torch.bfloat16)


def test_cuda_fp16_autocast_with_grad_scaler_and_clipping_trains_like_eager() -> None:
    _train_side_by_side(models.cnn, 4, {"precision": "fp16-autocast", "max_grad_norm": 1.0}, scaler=True,
                        dtype=torch.float16)  # fmt: skip


def test_cuda_accumulation_with_clipping_trains_like_eager() -> None:
    _train_side_by_side(models.bert, 2, {"max_grad_norm": 0.5}, k=3)


def test_cuda_accumulation_under_cuda_graphs_trains_like_eager() -> None:
    """Accumulation's first, middle and last graphs under cudagraphs, with ``keep_grads``, two
    middle micro-batches a step: each graph records at its first call (a warm-up first), reading
    the gradient buffers of the graph before it; bitwise equal to the eager loop, each recorded once."""
    step = _train_side_by_side(models.bert, 3, {"backend": "cudagraphs", "keep_grads": True}, k=4)
    runners = [graph.compiled.run for candidates in step.steps.values() for _, graph in candidates
               if graph.compiled is not None]  # fmt: skip
    assert len(runners) == 3 and all(isinstance(r, CudaGraphRunner) for r in runners)
    assert [r.recordings for r in runners] == [1, 1, 1]
