"""How much copies slow a graph's compute: measured by the profile on CUDA, priced by select-swap,
agreed over data-parallel ranks (mutwo.runtime.measurement.copy_contention)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from mutwo.ir.pass_base import PassContext
from mutwo.ir.pass_manager import PassManager, PipelineFailure
from mutwo.ir.registry import PassRegistry
from mutwo.ir.timeline import TransferModel
from mutwo.ir.to_fx import to_fx
from mutwo.runtime.measurement.copy_contention import CopyContention, measure_copy_contention
from mutwo.runtime.measurement.profiler import profile_graph
from mutwo.runtime.parallel import distributed
from tests import models, swapping

MEASURED = {"plain_seconds": 1.0, "d2h_seconds": 1.02, "h2d_seconds": 1.04, "runs": 3, "slowdown": 0.03}


def test_the_slowdown_is_the_mean_loaded_iteration_over_the_plain_one_never_below_zero() -> None:
    assert CopyContention(1.0, 1.02, 1.04, 3).slowdown == pytest.approx(0.03)
    assert CopyContention(1.0, 0.98, 0.99, 3).slowdown == 0.0  # noise under the plain time is no speed-up
    assert CopyContention(0.5, 0.6, 0.5, 3).to_json() == {"plain_seconds": 0.5, "d2h_seconds": 0.6,
                                                          "h2d_seconds": 0.5, "runs": 3,
                                                          "slowdown": pytest.approx(0.1)}  # fmt: skip


def test_contention_is_measured_on_cuda_only() -> None:
    graph, inputs = swapping.lower(models.mlp())
    with pytest.raises(ValueError, match="CUDA device, not cpu"):
        measure_copy_contention(to_fx(graph), inputs)
    assert "copy_contention" not in profile_graph(graph, inputs, runs=1, warmup=0).meta


def test_copies_are_priced_at_the_contention_the_profile_measured() -> None:
    """Without the option, select-swap prices copies beside compute at the slowdown the profile
    measured on the graph; a profile without one keeps the transfer model's; the option wins."""
    transfer = TransferModel(1e10, 1e10, 0.0, overlap=True, device="cpu", compute_slowdown=0.1)
    # duplex: which swaps fit the forward pass would follow this machine's measured times.
    pipeline = "select-swap{allow=swap,keep_faster=false,refine=0,duplex=true%s},insert-swap"
    machine = swapping.rewrite(models.cnn(batch_size=32), "profile{runs=1,warmup=0}," + pipeline % "", "0.9",
                               transfer=transfer)  # fmt: skip
    profile = machine.ctx.artifacts["profile"]
    assert "copy_contention" not in profile.meta  # the CPU measures none
    measured = dataclasses.replace(profile, meta={**profile.meta, "copy_contention": MEASURED})
    by_profile = swapping.rewrite(models.cnn(batch_size=32), pipeline % "", "0.9", measured, transfer=transfer)
    by_option = swapping.rewrite(models.cnn(batch_size=32), pipeline % ",contention=0.2", "0.9", measured,
                                 transfer=transfer)  # fmt: skip
    plans = [r.ctx.artifacts["swap-plan"] for r in (machine, by_profile, by_option)]
    assert all(plan.of("swap") for plan in plans)
    assert [plan.transfer["compute_slowdown"] for plan in plans] == [0.1, 0.03, 0.2]


def _asked_for_contention(pipeline: str, service_takes_it: bool = True) -> object:
    """What the profile pass, first in ``pipeline``, asks its profiler service for under
    ``contention``; the service stops the pipeline there (no plan is made)."""
    asked: list[object] = []

    def service(g: object, runs: int, warmup: int, **options: object) -> object:
        asked.append(options.get("contention", "not asked"))
        raise RuntimeError("stop after asking")

    ctx = PassContext()
    ctx.services["profiler"] = service if service_takes_it else lambda g, runs, warmup: service(g, runs, warmup)
    graph, _ = swapping.lower(models.mlp())
    with pytest.raises(PipelineFailure, match="stop after asking"):
        PassManager(PassRegistry().build_pipeline(pipeline)).run(graph, ctx)
    assert ctx.profile_needs == ({"contention"} if "swap" in pipeline else set())  # the pipeline's needs
    return asked[0]


def test_the_profile_measures_contention_when_a_pass_of_the_pipeline_prices_copies() -> None:
    """The copies' contention costs a few whole iterations on CUDA: the profile measures it for a
    pipeline with select-swap, skips it for one without, and its option decides where set."""
    assert _asked_for_contention("profile,select,rewrite") is False
    assert _asked_for_contention("profile,select-swap,insert-swap") is True
    assert _asked_for_contention("profile,swap") is True  # the macro: select-swap,insert-swap,...
    assert _asked_for_contention("profile{contention=true},select,rewrite") is True
    assert _asked_for_contention("profile{contention=false},select-swap,insert-swap") is False
    # A service of (graph, runs, warmup) is not asked, and measures what it measures by default.
    assert _asked_for_contention("profile,select,rewrite", service_takes_it=False) == "not asked"


def test_data_parallel_ranks_agree_on_the_contention(one_rank: None) -> None:
    graph, inputs = swapping.lower(models.mlp())
    profile = profile_graph(graph, inputs, runs=1, warmup=0)
    dp = SimpleNamespace(device=torch.device("cpu"), group=None, world_size=1)
    assert "copy_contention" not in distributed.agreed_profile(profile, dp).meta  # type: ignore[arg-type]
    measured = dataclasses.replace(profile, meta={**profile.meta, "copy_contention": MEASURED})
    agreed = distributed.agreed_profile(measured, dp)  # type: ignore[arg-type]
    assert agreed.meta["copy_contention"] == MEASURED and agreed.meta["reduced_over_ranks"] == 1


@pytest.mark.cuda
def test_the_profile_measures_how_much_copies_slow_the_iteration_on_the_gpu() -> None:
    workload = models.cnn(batch_size=64)
    workload.model.cuda()
    workload.batch = torch.utils._pytree.tree_map(lambda t: t.cuda(), workload.batch)
    graph, inputs = swapping.lower(workload)
    profile = profile_graph(graph, inputs, runs=1, warmup=1, iteration_runs=2)
    measured = profile.meta["copy_contention"]
    assert measured["plain_seconds"] > 0 and measured["d2h_seconds"] > 0 and measured["h2d_seconds"] > 0
    assert 0 <= measured["slowdown"] < 1  # copies beside compute slow it by a fraction, not by multiples
    assert "copy_contention" not in profile_graph(graph, inputs, runs=1, warmup=0, iteration_runs=1,
                                                  contention=False).meta  # fmt: skip
