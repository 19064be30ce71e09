"""Data parallel on several GPUs: eager DistributedDataParallel against mutwo averaging the same
gradients inside its graph, per-GPU peak memory and step time (the data-parallel issue). Run it
under torchrun, one process per GPU (NCCL; on CPU it runs with gloo, as the smoke test does):

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 bench/data_parallel.py --out DIR/data_parallel.json

For every ``model:batch:fraction`` of ``--models``, each rank builds the config's model from its
seed and trains on its shard of a global batch of ``batch × world size`` samples, with:

- *eager DDP*: ``DistributedDataParallel(model)`` (DDP's default buckets), ``loss.backward()``,
  ``optimizer.step()``;
- *mutwo, budget*: ``mutwo.optimize(model, ..., budget=B, data_parallel=True, backend=...)``, the
  whole iteration with its bucketed all-reduces (DDP's default buckets) in one graph, recomputing
  to fit ``B`` = ``fraction`` × what eager DDP held (max reserved, the largest over the ranks; on
  CPU, where nothing is held, ``fraction`` of mutwo's own simulated peak), calibrated on CUDA so
  that every rank holds at most ``B``. ``--backend`` (default: ``inductor-cudagraphs`` on CUDA,
  ``eager`` on CPU) runs it. The model is not wrapped in DDP here: a DDP wrapper allocates its own
  gradient buckets when it is built and keeps them while it lives, memory mutwo's graph does not use;
- *mutwo, no recompute*: the graph that ``optimize`` captured, before its passes (no second
  capture or profile).

With ``--sharding fsdp2`` (issue 42), each rank instead holds a shard of every parameter: the
model's repeated blocks (ResNet bottlenecks, BERT, GPT-2 and Llama layers) are each
``fully_shard``-ed, then the model itself, as FSDP2's users do, and the variants are:

- *eager FSDP2*, and *eager FSDP2 + per-layer checkpointing* (each block under non-reentrant
  ``torch.utils.checkpoint``, then sharded);
- *mutwo FSDP2 at checkpointing's held memory*: ``mutwo.optimize`` of the sharded model (its
  all-gathers and reduce-scatters in the graph, :mod:`mutwo.runtime.capture.fully_sharded`) at
  a budget of what the checkpointing row held (max reserved, the largest over the ranks; on
  CPU, ``fraction`` of mutwo's own simulated peak);
- *mutwo FSDP2 no recompute*: the graph ``optimize`` captured, before its passes.

Every variant, eager ones too, runs with the same CUDA allocator settings (``--allocator``, as
``bench/compare.py``: expandable segments by default, as mutwo turns them on).
Each variant: 3 warm-up iterations, then 10 measured
(``mutwo.tools.experiment_measure.measure_step``); per rank, peak = ``torch.cuda.max_memory_allocated``
over the measured iterations (everything: parameters, gradients, DDP's or mutwo's buckets,
optimizer state, activations), held = ``torch.cuda.max_memory_reserved`` (what the process
holds) and time = their median CUDA-event time; a row keeps every rank's numbers and their
maximum. Rank 0 rewrites ``--out`` after every variant, so a run cut short keeps
what it measured.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import gc
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.compare import checkpoint_blocks, equal_allocators  # noqa: E402
from mutwo.ir.budget import Budget, parse_budget  # noqa: E402
from mutwo.ir.pass_manager import PipelineFailure  # noqa: E402
from mutwo.runtime.api import optimize  # noqa: E402
from mutwo.runtime.execution.backends import BACKENDS  # noqa: E402
from mutwo.runtime.execution.cuda_graphs import release_all  # noqa: E402
from mutwo.runtime.execution.step import GraphStep  # noqa: E402
from mutwo.runtime.measurement.expandable_segments import ALLOCATORS  # noqa: E402
from mutwo.runtime.parallel import distributed  # noqa: E402
from mutwo.runtime.parallel.sharding import shard_blocks  # noqa: E402
from mutwo.runtime.planning.step_planning import Optimized  # noqa: E402
from mutwo.tools.config import Config, apply_overrides, load_config  # noqa: E402
from mutwo.tools.experiment_measure import Training, measure_after_planning  # noqa: E402
from mutwo.tools.workloads import Workload, build_optimizer, build_workload, to_device  # noqa: E402

CONFIGS = {"resnet152": "examples/resnet152.yaml", "resnet152-cl": "examples/resnet152_channels_last.yaml",
           "bert": "examples/bert.yaml", "tiny": "examples/tiny_mlp.yaml", "llama": "examples/llama_0_5b.yaml",
           "llama32k": "examples/llama_32k.yaml"}  # fmt: skip
#: Issue 42's DDP rows: ResNet-152-cl at 64 images and BERT-base at 16 sequences per GPU, each at
#: half of what eager DDP holds.
MODELS = "resnet152-cl:64:0.5,bert:16:0.5"
#: The default of ``--sharding fsdp2``: issue 42's Llama-shaped model of about 0.5B parameters, s1024.
FSDP2_MODELS = "llama:8:0.5"
WARMUP, MEASURED = 3, 10
#: What every rank measures of a variant; a row keeps each rank's and their maximum.
MEASURES = ("peak_bytes", "held_bytes", "iteration_ms")


@dataclasses.dataclass
class Bench:
    """One rank's view of the run: its device, the rows so far, where rank 0 writes them."""

    device: torch.device
    out: Path | None
    backend: str = "eager"  #: what runs mutwo's planned steps
    calibrate_peak: int | None = None  #: re-plans of peak calibration (None: mutwo's default)
    allocator: str | None = None  #: the allocator settings every variant runs with (``--allocator``)
    rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def measure(self, step: Any, base: dict[str, Any], planned: bool = True) -> dict[str, Any]:
        """Measure ``step`` on every rank (``planned=False``: an eager variant, started from an empty
        cache as in a fresh process, whose cache is then not emptied after its first steps, as a
        user's loop's is not); the row holds each rank's numbers and their maximum."""
        if not planned and self.device.type == "cuda":
            # As in a fresh process: what an earlier variant of this one left cached is not held.
            # (Eager FSDP2 with checkpointing, measured after eager FSDP2 without, held 42.6 GB of
            # which 11.9 GB allocated on two H100s, 2026-11-27.)
            gc.collect()
            torch.cuda.empty_cache()
        mine = measure_after_planning(step, self.device, None, warmup=WARMUP, iterations=MEASURED, planned=planned)
        return self.record({**base, **mine})

    def record(self, row: dict[str, Any]) -> dict[str, Any]:
        ranks: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, {k: row.get(k) for k in (*MEASURES, "error")})
        row = {k: v for k, v in row.items() if k not in ("iteration_ms_all", *MEASURES)}
        row["ranks"] = ranks
        for key in MEASURES:
            values = [r[key] for r in ranks if r.get(key) is not None]
            row[key] = max(values) if values else None
        self.rows.append(row)
        if dist.get_rank() == 0:
            print(json.dumps({k: v for k, v in row.items() if k != "ranks"}), flush=True)
            if self.out is not None:
                self.out.parent.mkdir(parents=True, exist_ok=True)
                self.out.write_text(json.dumps(self.describe(), indent=2) + "\n")
        return row

    def describe(self) -> dict[str, Any]:
        return {"device": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
                "world_size": dist.get_world_size(), "backend": dist.get_backend(), "torch": torch.__version__,
                "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"), "date": time.strftime("%Y-%m-%d"),
                "allocator": self.allocator,
                "warmup": WARMUP, "measured": MEASURED, "runs": self.rows}  # fmt: skip


def training(config: Config, workload: Workload, batch: Any, device: torch.device, *, ddp: bool) -> Training:
    """A fresh copy of the workload's model on ``device``, wrapped in DDP if asked, with a fresh optimizer."""
    copied = copy.deepcopy(workload.model).to(device)
    model = DistributedDataParallel(copied, device_ids=[device] if device.type == "cuda" else None) if ddp else copied
    return Training(model, build_optimizer(config, copied), batch, workload.loss_fn, device)


def this_rank(bench: Bench, name: str, batch_size: int) -> tuple[Config, Workload, Any, dict[str, Any]]:
    """The config of ``name`` at a global batch of ``batch_size`` per rank, its workload, this
    rank's shard of the batch on its device, and the keys every row of the model shares."""
    world, rank = dist.get_world_size(), dist.get_rank()
    config = apply_overrides(load_config(ROOT / CONFIGS[name]), batch_size=batch_size * world)
    workload = build_workload(config)
    batch = to_device(distributed.shard_batch(workload.batch, rank, world), bench.device)
    return config, workload, batch, {"model": name, "batch_per_gpu": batch_size, "global_batch": batch_size * world}


def bench_mutwo(bench: Bench, mutwo: Training, budget: Budget, row: dict[str, Any], unplanned: dict[str, Any],
                details: Callable[[Optimized], dict[str, Any]], **options: Any) -> None:  # fmt: skip
    """Plan ``mutwo`` at ``budget`` and measure it as ``row``, then the graph it captured, before
    its passes, as ``unplanned``; ``details`` adds what the row says of the optimized iteration."""
    started = time.perf_counter()
    row["backend"] = bench.backend
    try:
        step = optimize(mutwo.model, mutwo.optimizer, mutwo.batch, mutwo.loss_fn, budget=budget, backend=bench.backend,
                        calibrate_peak=bench.calibrate_peak, **options)  # fmt: skip
    except PipelineFailure as failure:
        bench.record({**row, "error": str(failure).splitlines()[0]})
        return
    row["planning_seconds"] = round(time.perf_counter() - started, 2)
    optimized = step.last
    assert optimized is not None
    plan = optimized.plan
    original, capture, binding = optimized.original, optimized.captured, optimized.binding
    if row.get("budget_bytes") is None:  # a fraction (on CPU): the bytes it came to
        row["budget_bytes"] = plan.budget_bytes
    row.update(planned_budget_bytes=plan.budget_bytes, nodes=len(optimized.graph),
               unoptimized_simulated_peak=plan.unoptimized_peak, predicted_peak=plan.predicted_peak,
               recomputed_tensors=len(plan.entries), predicted_added_ms=round(plan.added_seconds * 1e3, 3),
               calibration=optimized.calibration.describe() if optimized.calibration is not None else None,
               **details(optimized))  # fmt: skip
    bench.measure(functools.partial(step, mutwo.batch), row)
    # The planned step's CUDA graph (and its pool) goes before the unplanned step is measured.
    del step, optimized
    gc.collect()  # a step kept alive by a reference cycle would keep its recording
    release_all()
    captured = GraphStep(original, capture, binding)
    bench.measure(lambda: captured(mutwo.batch), {**unplanned, "nodes": len(original), "backend": "eager"})


def bench_model(bench: Bench, name: str, batch_size: int, fraction: float) -> None:
    config, workload, batch, base = this_rank(bench, name, batch_size)

    eager = training(config, workload, batch, bench.device, ddp=True)
    measured = bench.measure(eager.eager_step(), {**base, "variant": "eager DDP"}, planned=False)
    del eager
    if measured["held_bytes"] is not None:
        budget: Budget = Budget(bytes=int(fraction * measured["held_bytes"]))
        spec = f"{fraction} x eager DDP's held memory"
    else:
        budget, spec = parse_budget(str(fraction)), f"{fraction} x mutwo's simulated peak"

    mutwo = training(config, workload, batch, bench.device, ddp=False)
    bench_mutwo(bench, mutwo, budget, {**base, "variant": f"mutwo {spec}", "budget_bytes": budget.bytes},
                {**base, "variant": "mutwo no recompute"},
                lambda optimized: {"buckets": len(optimized.binding.gradient_buckets),
                                   "collectives": sum(1 for n in optimized.graph if n.is_collective),
                                   "recomputed_ops": dict(Counter(e["op"] for e in optimized.plan.entries)
                                                          .most_common(8))},
                data_parallel=True)  # fmt: skip


def fully_sharded(model: torch.nn.Module, checkpointed: bool, device: torch.device) -> int:
    """``fully_shard`` each repeated block (checkpointed first if asked), then the model, as
    ``mutwo-opt --sharding fsdp2`` does (:func:`~mutwo.runtime.parallel.sharding.shard_blocks`);
    return how many blocks were sharded."""
    if checkpointed:
        checkpoint_blocks(model)
    return len(shard_blocks(model, device))


def fsdp2_training(config: Config, workload: Workload, batch: Any, device: torch.device,
                   checkpointed: bool = False) -> tuple[Training, int]:  # fmt: skip
    """A fresh copy of the workload's model on ``device``, sharded with FSDP2, with a fresh optimizer."""
    model = copy.deepcopy(workload.model).to(device)
    blocks = fully_sharded(model, checkpointed, device)
    return Training(model, build_optimizer(config, model), batch, workload.loss_fn, device), blocks


def bench_fsdp2(bench: Bench, name: str, batch_size: int, fraction: float) -> None:
    config, workload, batch, base = this_rank(bench, name, batch_size)
    base["sharding"] = "fsdp2"
    for checkpointed in (False, True):
        eager, blocks = fsdp2_training(config, workload, batch, bench.device, checkpointed)
        variant = "eager FSDP2" + (" + per-layer checkpointing" if checkpointed else "")
        reference = bench.measure(eager.eager_step(), {**base, "variant": variant, "blocks": blocks}, planned=False)
        del eager
    if reference["held_bytes"] is not None:
        budget: Budget = Budget(bytes=reference["held_bytes"])
        spec = "at checkpointing's held memory"
    else:
        budget, spec = parse_budget(str(fraction)), f"{fraction} x mutwo's simulated peak"
    mutwo, blocks = fsdp2_training(config, workload, batch, bench.device)
    gathers = "_c10d_functional.all_gather_into_tensor"
    bench_mutwo(bench, mutwo, budget,
                {**base, "variant": f"mutwo FSDP2 {spec}", "blocks": blocks, "budget_bytes": budget.bytes},
                {**base, "variant": "mutwo FSDP2 no recompute"},
                lambda optimized: {"all_gathers": sum(1 for n in optimized.graph if n.op_name.startswith(gathers))})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="JSON file rank 0 writes (rewritten after every variant)")
    parser.add_argument("--models", help=f"model:batch per GPU:budget fraction,... (DDP: {MODELS}; FSDP2: "
                                          f"{FSDP2_MODELS}; models: {', '.join(CONFIGS)})")
    parser.add_argument("--sharding", choices=("ddp", "fsdp2"), default="ddp",
                        help="ddp: every rank holds the model (eager DDP against mutwo); fsdp2: fully_shard")
    parser.add_argument("--backend", choices=BACKENDS,
                        help="what runs mutwo's planned steps (default: inductor-cudagraphs on CUDA, eager on CPU)")
    parser.add_argument("--calibrate-peak", type=int, metavar="N",
                        help="re-plans of peak calibration (default: mutwo's, 2 on CUDA; each compiles the step again)")
    parser.add_argument("--allocator", choices=tuple(ALLOCATORS),
                        help="the CUDA allocator of every variant, eager ones too: expandable (the default, as "
                             "mutwo turns it on) or default (torch's); PYTORCH_CUDA_ALLOC_CONF, when set, instead")
    args = parser.parse_args()
    if not distributed.launched_by_torchrun():
        parser.error("launch it with torchrun --nproc-per-node N bench/data_parallel.py ...")
    try:  # before anything is allocated on the device: eager and mutwo rows compare at equal allocators
        allocator = equal_allocators(args.allocator)
    except ValueError as error:
        parser.error(str(error))
    device = distributed.join_from_environment(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    bench = Bench(device, args.out, args.backend or ("inductor-cudagraphs" if device.type == "cuda" else "eager"),
                  args.calibrate_peak, allocator)  # fmt: skip
    try:
        run = bench_fsdp2 if args.sharding == "fsdp2" else bench_model
        for item in (args.models or (FSDP2_MODELS if args.sharding == "fsdp2" else MODELS)).split(","):
            name, batch, fraction = item.split(":")
            run(bench, name, int(batch), float(fraction))
        # Every rank done before any tears the group down: a rank that leaves while another's
        # gloo work is in flight aborts ("terminate called without an active exception").
        dist.barrier()
    finally:
        release_all()  # torch hangs destroying a group while a CUDA graph that recorded NCCL lives
        dist.destroy_process_group()
    # Leave without the interpreter's teardown: with everything measured and written, a gloo
    # rank still aborted there once in ~35 CPU runs (rank 1, "terminate called without an active
    # exception", the CI run of 2026-11-24), when C++ objects that own threads are destroyed
    # during finalization (pytorch/pytorch#179291 describes the same abort). The results are
    # complete at this point; the abort would only turn a finished run into a failed one.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
