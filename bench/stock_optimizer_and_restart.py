"""Issue 40's GPU checks, each writing one JSON.

``stock``: a stock optimizer (the config's, e.g. ``AdamW(lr=1e-4)``, not capturable, its rate a
Python float) with a ``LambdaLR`` scheduler under a CUDA-graph backend, against the eager loop of
the same optimizer, from identical state: the largest difference of every
parameter and optimizer state tensor after the steps, against ``--rtol``/``--atol`` (1e-3 and
1e-5: Inductor's kernels sum in other orders than eager's, and Adam's update divides by the square
root of a second moment that is tiny at the first steps, so the differences grow over steps).
Also that the optimizer's ``state_dict`` loads into a fresh stock optimizer that then steps eagerly.

``start``: the time from a fresh process's first line to the end of its first training step,
with mutwo's plan cache in ``--cache-dir``; run twice in a row with the same folder, the second
process reuses the first's plan. Also the second step's time: under a CUDA-graph backend the
first call runs unrecorded and the second records the step. Records ``optimize()``'s per-stage
setup seconds and each step's loss, the seconds Python's garbage collector took in ``optimize()``
and the compile's record (whether torch's caches answered, and why AOTAutograd's skipped the step if
it did); with ``--measure-steps N``, also N steady steps' time and held memory, so that a restart is
seen to train as the first start did.

Run where mutwo is installed (``make`` sets up .venv; on the GPU machine, ``. bench/gpu_env.sh``):

    python3 bench/stock_optimizer_and_restart.py stock --config examples/bert.yaml --batch-size 8 --out s.json
    python3 bench/stock_optimizer_and_restart.py start --config examples/bert.yaml --batch-size 64 \\
        --budget 16GiB --cache-dir /tmp/mutwo-cache --out first.json
"""

from __future__ import annotations

import time

PROCESS_START = time.perf_counter()  # before torch is imported: a restart pays the import too

import argparse  # noqa: E402
import contextlib  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from collector_time import CollectorTime  # noqa: E402  # bench/ is on sys.path when this runs as a script
from stack_sampler import StackSampler  # noqa: E402

import mutwo  # noqa: E402
from mutwo.runtime.planning import plan_cache, step_planning  # noqa: E402
from mutwo.tools.experiment_measure import build_training, measure_step  # noqa: E402


def _schedule(step: int) -> float:
    """The learning rate's factor at each step: it changes every step, so a frozen rate shows."""
    return 1.0 / (1 + step)


def _state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in model.named_parameters()}
    tensors = {f"param:{n}": p.detach() for n, p in model.named_parameters()}
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state:{names[id(param)]}:{key}"] = value.detach()
    return tensors


def stock(args: argparse.Namespace) -> dict[str, Any]:
    row: dict[str, Any] = {"mode": "stock", "config": args.config, "batch_size": args.batch_size,
                           "backend": args.backend, "steps": args.steps, "gpu": torch.cuda.get_device_name(),
                           "torch": torch.__version__}  # fmt: skip
    eager = build_training(args.config, args.batch_size, device="cuda")
    mine = build_training(args.config, args.batch_size, device="cuda")
    mine.model.load_state_dict(eager.model.state_dict())  # identical state, whatever the seeds did
    row["optimizer"] = f"{type(mine.optimizer).__name__}({mine.optimizer.defaults.get('lr')!r})"
    row["capturable"] = [bool(g.get("capturable")) for g in mine.optimizer.param_groups]
    schedulers = [torch.optim.lr_scheduler.LambdaLR(t.optimizer, _schedule) for t in (eager, mine)]
    step = mutwo.optimize(mine.model, mine.optimizer, mine.batch, mine.loss_fn, backend=args.backend,
                          budget=args.budget, verbose=True)  # fmt: skip
    eager_step = eager.eager_step()
    row["losses_mutwo"] = []
    for index in range(args.steps):
        # Each step of both from the same seed: dropout draws from the global generator, and
        # interleaved steps would otherwise draw each other's masks.
        torch.manual_seed(1000 + index)
        eager_step()
        torch.manual_seed(1000 + index)
        row["losses_mutwo"].append(float(step(mine.batch)))
        for scheduler in schedulers:
            scheduler.step()
    torch.cuda.synchronize()
    row["lr_after"] = [g["lr"] if not isinstance(g["lr"], torch.Tensor) else g["lr"].item()
                       for g in mine.optimizer.param_groups]  # fmt: skip
    row["user_groups_unchanged"] = all(not g.get("capturable") and not isinstance(g["lr"], torch.Tensor)
                                       for g in mine.optimizer.param_groups)  # fmt: skip
    reference, candidate = _state_tensors(eager.model, eager.optimizer), _state_tensors(mine.model, mine.optimizer)
    rtol, atol = args.rtol, args.atol
    worst: dict[str, Any] = {"name": None, "excess": 0.0}
    mismatched = []
    for name, ref in reference.items():
        got = candidate.get(name)
        if got is None:
            mismatched.append(f"{name}: missing")
            continue
        ref64, got64 = ref.double().to(got.device), got.double()
        excess = ((got64 - ref64).abs() - (atol + rtol * ref64.abs())).max().item() if ref.numel() else 0.0
        if excess > worst["excess"] or worst["name"] is None:
            worst = {"name": name, "excess": excess, "max_abs_diff": (got64 - ref64).abs().max().item()}
        if excess > 0:
            mismatched.append(name)
    row.update(tensors_compared=len(reference), tensors_outside_tolerance=len(mismatched),
               outside_tolerance=mismatched[:10], worst=worst, rtol=rtol, atol=atol)  # fmt: skip
    # the state dict of the trained optimizer loads into a fresh stock optimizer, which steps eagerly
    fresh = copy.deepcopy(eager)
    fresh.optimizer.load_state_dict(mine.optimizer.state_dict())
    fresh.eager_step()()
    torch.cuda.synchronize()
    row["state_dict_loads_and_steps_eagerly"] = True
    return row


def start(args: argparse.Namespace) -> dict[str, Any]:
    on_gpu = args.device == "cuda"
    row: dict[str, Any] = {"mode": "start", "config": args.config, "batch_size": args.batch_size,
                           "budget": args.budget, "backend": args.backend, "cache_dir": args.cache_dir,
                           "memory_limit": args.memory_limit,
                           "gpu": torch.cuda.get_device_name() if on_gpu else None, "torch": torch.__version__,
                           "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
                           "collector_heap_frozen": not args.collector_as_before}  # fmt: skip
    training = build_training(args.config, args.batch_size, device=args.device)
    built = time.perf_counter()
    sampling = StackSampler() if args.sample_stacks else contextlib.nullcontext()
    if args.collector_as_before:  # the A/B of mutwo.runtime.planning.collector: setup without it, where it is used
        step_planning.older_heap_frozen = step_planning.collection_paused = contextlib.nullcontext
        plan_cache.collection_paused = contextlib.nullcontext
    keys: list[dict[str, Any]] = []
    if args.aot_key_lines:
        _record_aot_keys(keys)
    with sampling, CollectorTime() as collector:
        step = mutwo.optimize(training.model, training.optimizer, training.batch, training.loss_fn,
                              budget=args.budget, backend=args.backend, memory_limit=args.memory_limit,
                              cache=args.cache_dir, verbose=True)  # fmt: skip
    optimized = time.perf_counter()
    row["recorded_at_first_call"] = args.record_at_first_call
    compiled = getattr(step.last.step, "compiled", None) if step.last is not None else None
    if args.record_at_first_call and compiled is not None and hasattr(compiled.run, "defer_recording"):
        compiled.run.defer_recording = False
    if isinstance(sampling, StackSampler):
        sampling.write(args.sample_stacks)
    losses = [step(training.batch).item()]
    if on_gpu:
        torch.cuda.synchronize()
    done = time.perf_counter()
    row.update(import_and_build_seconds=built - PROCESS_START, optimize_seconds=optimized - built,
               first_step_seconds=done - optimized, start_to_first_step_seconds=done - PROCESS_START)  # fmt: skip
    # Under CUDA graphs a training loop's step records at its second call (its first runs unrecorded)
    losses.append(step(training.batch).item())
    if on_gpu:
        torch.cuda.synchronize()
    row["second_step_seconds"] = time.perf_counter() - done
    last = step.last
    row["setup_seconds"] = step.setup_seconds
    row["garbage_collector_in_optimize"] = collector.summary()
    if args.aot_key_lines:
        row["aot_keys_computed"] = keys
    row["cache_hit"] = last.cache_hit if last is not None else None
    row["compile"] = compiled.describe() if compiled is not None else None  # whether torch's caches answered
    if last is not None and last.calibration is not None:  # the rounds: what each plan held
        row["calibration"] = last.calibration.describe()
    if args.measure_steps:
        row.update(_train_on(step, training.batch, args.measure_steps, losses))
    row["losses"] = losses
    return row


def _record_aot_keys(keys: list[dict[str, Any]]) -> None:
    """Wrap AOTAutograd's key function so that each key it computes is kept in ``keys`` with its
    per-component lines (what to compare when two processes' keys differ)."""
    import torch._functorch._aot_autograd.autograd_cache as cache

    real = cache.autograd_cache_key

    def recorded(*args: Any, **kwargs: Any) -> tuple[str, list[str]]:
        logger = logging.getLogger(cache.__name__)  # at DEBUG later torches build the lines too
        level, propagate = logger.level, logger.propagate
        logger.setLevel(logging.DEBUG)
        logger.propagate = False
        try:
            key, lines = real(*args, **kwargs)
        finally:
            logger.setLevel(level)
            logger.propagate = propagate
        keys.append({"key": key, "lines": [line[:400] for line in lines[:3000]]})
        return key, lines

    cache.autograd_cache_key = recorded


class _LossKeepingStep:
    """A call of the optimized step on ``batch`` that keeps its loss, as ``measure_step`` calls a
    step. ``recorded_peak_bytes`` (read by ``measure_step``, as of the harness's
    ``PlannedStep``): the allocator's peak while the CUDA graph recorded the step, since replays
    allocate none of its transients (0 for other backends)."""

    def __init__(self, step: Any, batch: Any, losses: list[float]) -> None:
        self.step, self.batch, self.losses = step, batch, losses

    def __call__(self) -> None:
        self.losses.append(self.step(self.batch).item())

    @property
    def recorded_peak_bytes(self) -> int:
        graph_step = self.step.last.step if self.step.last is not None else None
        compiled = graph_step.compiled if graph_step is not None else None
        return getattr(compiled.run, "recorded_peak_absolute", 0) if compiled is not None else 0


def _train_on(step: Any, batch: Any, steps: int, losses: list[float]) -> dict[str, Any]:
    """Two more warm-up steps, then ``steps`` measured ones as the harness measures them
    (:func:`mutwo.tools.experiment_measure.measure_step`: the median time, max reserved over the
    measured steps, and the allocated peak with the recording's). Losses are appended to
    ``losses``: a restart that reuses the plan must train the numbers the first start trained."""
    stepping = _LossKeepingStep(step, batch, losses)
    return {"measured_steps": steps, **measure_step(stepping, torch.device("cuda"), warmup=2, iterations=steps)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("stock", "start"))
    parser.add_argument("--config", required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--backend", default="inductor-cudagraphs")
    parser.add_argument("--budget", default=None)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rtol", type=float, default=1e-3, help="stock: relative tolerance of the comparison")
    parser.add_argument("--atol", type=float, default=1e-5, help="stock: absolute tolerance of the comparison")
    parser.add_argument("--cache-dir", default=None, help="start: mutwo's plan cache folder")
    parser.add_argument("--memory-limit", default=None, help="start: the process's cap, as mutwo.optimize takes it")
    parser.add_argument("--measure-steps", type=int, default=0,
                        help="start: after the first step, 2 warm-up and this many measured steps (time, held memory)")
    parser.add_argument("--sample-stacks", default=None,
                        help="start: sample optimize()'s stacks into this folded file (bench/stack_sampler.py)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="start: where the model trains (cpu: a start's setup on a machine without a GPU)")
    parser.add_argument("--collector-as-before", action="store_true",
                        help="start: set up with Python's collector as it runs (mutwo.runtime.planning.collector)")
    parser.add_argument("--record-at-first-call", action="store_true",
                        help="start: record the CUDA graph at the first call, after a warm-up on the state kept in "
                             "host memory (as before the training loop's first call ran unrecorded): the A/B of it")
    parser.add_argument("--aot-key-lines", action="store_true",
                        help="start: record each cache key AOTAutograd computes with its per-component lines "
                             "(torch 2.11 returns them; later versions only with the logger at DEBUG)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    try:
        row = stock(args) if args.mode == "stock" else start(args)
    except Exception as error:  # the row records the failure: that is what this run is for
        row = {"mode": args.mode, "error": f"{type(error).__name__}: {str(error).splitlines()[0][:500]}"}
    Path(args.out).write_text(json.dumps(row, indent=2))
    print(json.dumps(row, indent=2))
    return 1 if "error" in row else 0


if __name__ == "__main__":
    raise SystemExit(main())
