"""On CUDA: the optimizer passes train like eager (deterministic kernels), lower the measured peak,
and ``fit_batch`` confirms its batch with a measured run under the cap."""

from __future__ import annotations

import pytest
import torch

import mutwo
from mutwo.ir.to_fx import to_fx
from mutwo.runtime.api import optimize_graph
from mutwo.runtime.execution.step import GraphStep
from mutwo.runtime.measurement.equivalence import deterministic_algorithms
from mutwo.runtime.measurement.iterations import measure_iterations
from tests import models

pytestmark = pytest.mark.cuda


def _on_cuda(workload: models.Workload) -> models.Workload:
    workload.model.cuda()
    workload.batch = torch.utils._pytree.tree_map(lambda t: t.cuda(), workload.batch)
    return workload


@pytest.mark.parametrize("optimizer", sorted(models.OPTIMIZERS))
def test_cuda_optimizer_passes_train_like_eager_and_lower_the_measured_peak(optimizer: str) -> None:
    mine, eager = _on_cuda(models.gpt2()), _on_cuda(models.gpt2())  # its peak is in the optimizer step
    my_opt = models.OPTIMIZERS[optimizer](mine.model.parameters())  # CUDA default: the foreach form
    eager_opt = models.OPTIMIZERS[optimizer](eager.model.parameters())
    passes = "optimizer-in-backward{group_bytes=64KiB}"
    optimized = optimize_graph(mine.model, my_opt, mine.batch, mine.loss_fn, passes=passes)
    assert optimized.context.artifacts["optimizer-in-backward"].applied
    before = measure_iterations(to_fx(optimized.original), optimized.inputs, runs=2, warmup=1).peak_bytes
    after = measure_iterations(to_fx(optimized.graph), optimized.inputs, runs=2, warmup=1).peak_bytes
    assert before is not None and after is not None and after < before
    step = GraphStep(optimized.graph, optimized.captured, optimized.binding)
    with deterministic_algorithms():
        for iteration in range(3):
            torch.manual_seed(iteration)
            loss = step(mine.batch).loss
            torch.manual_seed(iteration)
            torch.testing.assert_close(loss, models.eager_step(eager, eager_opt), rtol=0, atol=0)
    for (name, p), (_, q) in zip(mine.model.named_parameters(), eager.model.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
        for key, value in eager_opt.state[q].items():
            torch.testing.assert_close(my_opt.state[p][key], value, rtol=0, atol=0, msg=f"{name}: {key}")


def test_cuda_fit_batch_measures_the_batch_it_found_within_the_limit() -> None:
    workload = _on_cuda(models.mlp())
    optimizer = models.OPTIMIZERS["adam"](workload.model.parameters())

    def make_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 16, device="cuda"), torch.randint(0, 5, (n,), device="cuda")

    # The cap covers everything the process allocates while measuring, cuBLAS's workspace included
    # (tens of MiB on an H100): a limit of a few MiB cannot hold it, 256 MiB can.
    result = mutwo.fit_batch(workload.model, optimizer, make_batch, workload.loss_fn, "256MiB", start=1024)
    assert result.best is not None and result.best.batch_size > 1024
    assert result.measured_peak is not None and result.measured_peak <= 256 * 2**20
    assert result.attempts and result.attempts[-1].fits and len(result.attempts) <= 4
    assert result.best.batch_size == max(a.batch_size for a in result.attempts if a.fits)
