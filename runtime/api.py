"""mutwo from your own training loop: one call turns a model, its optimizer, an example batch and
a loss function into a training step that uses less memory and computes the same numbers.

    from mutwo.runtime.api import optimize

    step = optimize(model, optimizer, example_batch, loss_fn, budget=0.5)
    for batch in loader:
        loss = step(batch)          # forward, backward and optimizer.step(), in one graph
        scheduler.step()            # learning-rate schedulers work: the rate is read every call

The step updates the real model's parameters and buffers and the real optimizer's state in
place, so ``state_dict()``, checkpoints, schedulers and evaluation keep working. Every graph the
loop will run that is known in advance (gradient accumulation's micro-batches, the step after the
optimizer creates its state) is captured and planned by ``optimize``, which raises there, leaving
the model and optimizer as they were, when one cannot be planned. A batch of another shape (a
smaller last batch) is captured and optimized again, and the step says so. The loss a call
returns has a ``grad_fn``, as eager's has, whose ``backward()`` says that the step already ran it.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from mutwo.ir.budget import Budget, parse_budget, parse_bytes
from mutwo.runtime.capture.device_state import put_state_back, state_entries
from mutwo.runtime.capture.iteration import LossFn, StaleCaptureError, StepBinding
from mutwo.runtime.capture.optim import scheduled_kinds
from mutwo.runtime.capture.training import TrainingOptions
from mutwo.runtime.execution.auto_backend import AUTO
from mutwo.runtime.execution.backends import records_cuda_graphs
from mutwo.runtime.execution.cuda_graphs import CudaGraphRunner
from mutwo.runtime.execution.failure import Failure, InconsistentStateError
from mutwo.runtime.execution.step import GraphStep
from mutwo.runtime.measurement.device_memory import apply_memory_limit
from mutwo.runtime.measurement.expandable_segments import SWITCHED_ON, use_expandable_segments
from mutwo.runtime.measurement.iterations import device_of
from mutwo.runtime.measurement.out_of_memory import (
    MemorySettings,
    add_note,
    note_out_of_memory,
    training_step,
)
from mutwo.runtime.parallel import distributed
from mutwo.runtime.planning.captured import accumulated_stand_ins
from mutwo.runtime.planning.step_planning import DEFAULT_PASSES, Optimized, optimize_graph


class NotEquivalentError(RuntimeError):
    """``check=True`` found that the optimized step computes different numbers."""


@dataclass
class MutwoStep:
    """A training step made by :func:`optimize`; call it with a batch, it returns the loss.

    ``steps`` keeps the optimized graphs by what a graph is specific to (:func:`capture_key`): the
    batch's shapes and dtypes, every module's training flag, which parameters require grad, the
    optimizer's hyperparameters other than those it reads at every call. A graph is also dropped
    when a branch the optimizer took on its step count goes the other way (RAdam) or when the
    optimizer created its state in it (SGD's first momentum buffer). ``last`` is the graph used by
    the latest call. With ``keep_grads``, each parameter's ``.grad`` is set to the step's gradient,
    as ``loss.backward()`` would (this keeps the gradients alive until the next step, like eager
    training without ``zero_grad``).

    A call that fails (``torch.OutOfMemoryError``...) raises its own exception once what it wrote
    is put back (:mod:`mutwo.runtime.execution.failure`); a ``torch.OutOfMemoryError`` also gets a
    note saying where in the step it ran out and what the process held. When the parameters or
    optimizer state may be part updated, which ``on_failure="restore"`` rules out, the exception
    gets a note and every later call raises :class:`InconsistentStateError` (``refusal`` says why).
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: LossFn
    options: dict[str, Any]
    keep_grads: bool = False
    log: Callable[[str], None] = field(default=lambda message: None)
    #: what is said whether verbose or not: that a check asked for passed
    say: Callable[[str], None] = field(default=lambda message: None)
    steps: dict[tuple[Any, ...], list[tuple[Optimized, GraphStep]]] = field(default_factory=dict)
    last: Optimized | None = None
    micro_index: int = 0  #: with gradient accumulation: the micro-batch the next call runs
    #: with gradient accumulation: the gradients accumulated so far (shared with the graphs' bindings)
    accumulated: dict[str, torch.Tensor] = field(default_factory=dict)
    on_failure: str = "refuse"  #: "restore": copy the written state to host memory before each call
    refusal: str | None = None  #: why calls are refused, once a failed one may have left the state part written

    @property
    def setup_seconds(self) -> dict[str, float]:
        """Where setting up went, in seconds by stage, summed over every graph planned so far
        (each graph's own: ``Optimized.setup_seconds``)."""
        total: dict[str, float] = {}
        for optimized, _ in (entry for candidates in self.steps.values() for entry in candidates):
            for stage, seconds in optimized.setup_seconds.items():
                total[stage] = round(total.get(stage, 0.0) + seconds, 3)
        return total

    @property
    def micro(self) -> str:
        """Which graph the next call runs: "step" without accumulation, else "first", "middle" or "last"."""
        k = self.options["training"].accumulation_steps
        if k == 1:
            return "step"
        return "first" if self.micro_index == 0 else "last" if self.micro_index == k - 1 else "middle"

    def prepare(self, batch: Any) -> tuple[GraphStep, list[torch.Tensor]]:
        """The optimized step for ``batch`` and its inputs, captured and optimized when no graph fits."""
        key = self._key(batch)
        candidates = self.steps.setdefault(key, [])
        reasons: list[str] = []
        for optimized, step in list(candidates):
            try:
                flat = step.flat_inputs(batch)
            except StaleCaptureError as stale:
                reasons.append(str(stale).split(";")[0])
                if step.stale is not None:
                    candidates.remove((optimized, step))
                continue
            self.last = optimized
            return step, flat
        if reasons:
            self.log(f"mutwo: {reasons[0]}: capturing and optimizing the iteration again")
        elif len(self.steps) > 1:
            change = _describe_change(self.steps, key, batch)
            self.log(f"mutwo: {change}: capturing and optimizing the iteration again for it")
            if HYPERPARAMETERS_CHANGED in change:  # silent, a per-step schedule would cost a capture a step
                warnings.warn(f"mutwo: {change}, which the captured step reads as a constant: capturing and "
                              "optimizing the iteration again; changed at every step, each step pays for a capture "
                              "(only the learning rate, momentum and betas are read at every call)",
                              stacklevel=3)  # fmt: skip
        k = self.options["training"].accumulation_steps
        step = self._optimize(batch, key, _graph_name(self.micro, k) if k > 1 else "")
        return step, step.flat_inputs(batch)

    def plan_ahead(self, batch: Any) -> None:
        """Capture and plan now every graph that training on batches like ``batch`` runs and that
        is known in advance, so that planning fails here rather than in the training loop: with
        gradient accumulation the first, middle and last micro-batches' (the gradients accumulated
        before a middle or last one stood in by zeros, :func:`accumulated_stand_ins`), and where
        the optimizer creates state in its first step (SGD's momentum buffer with dampening), the
        step's graph for the steps after it. When one fails, its exception gets a note naming the
        graph, and the optimizer state planning created (as the first ``step()`` would) is taken
        back: the model and the optimizer are left as they were given."""
        k = self.options["training"].accumulation_steps
        several = k > 1
        first: Optimized | None = None
        try:
            with _optimizer_state_kept_on_failure(self.optimizer):
                for index in sorted({0, min(1, k - 1), k - 1}):
                    self.micro_index = index
                    graph = _graph_name(self.micro, k)
                    if index:
                        self.log(f"mutwo: planning {graph} too")
                    with _noted_on_failure(graph if several else None):
                        step = self._optimize(batch, self._key(batch), graph if several else "")
                    first = first or self.last
                    if index == 0 and several:
                        self.accumulated.update(accumulated_stand_ins(step.captured))
                    if step.binding.fresh:
                        graph = f"{graph} once the optimizer's state exists (it creates it in its first step)"
                        self.log(f"mutwo: planning {graph} too")
                        with _noted_on_failure(graph), _fresh_state_installed(step.binding):
                            self._optimize(batch, self._key(batch), graph)
        finally:
            self.micro_index = 0
            self.accumulated.clear()  # the stand-ins; in place: the bindings of the other graphs read this dict
        self.last = first  # the graph the first call runs

    def _key(self, batch: Any) -> tuple[Any, ...]:
        graphed = records_cuda_graphs(self.options["backend"])
        return capture_key(self.model, self.optimizer, batch, graphed=graphed) + ("micro", self.micro)

    def _optimize(self, batch: Any, key: tuple[Any, ...], graph: str = "") -> GraphStep:
        """Capture and optimize the iteration for ``batch`` as the next call runs it (the graph of
        ``self.micro``), check it when asked to, and keep it under ``key``; ``graph`` names it in
        the check's line where there are several."""
        optimized = optimize_graph(self.model, self.optimizer, batch, self.loss_fn, log=self.log, micro=self.micro,
                                   accumulated=self.accumulated, **self.options)  # fmt: skip
        assert optimized.step is not None
        if self.options["backend"] == AUTO:  # chosen once: every later graph of this step runs the same backend
            self.options["backend"] = optimized.step.backend
            key = self._key(batch)  # what the choice captured for (a CUDA graph's capturable form)
        report = optimized.report
        if report is not None:
            if not report.equivalent:
                raise NotEquivalentError(report.summary())
            self.say(f"mutwo: check passed{f' for {graph}' if graph else ''}: the optimized step is "
                     f"{report.summary()}")  # fmt: skip
        compiled = optimized.step.compiled
        if compiled is not None and isinstance(compiled.run, CudaGraphRunner):
            # A training loop's step: its first call runs unrecorded and the second records (the
            # runner's docs). Not with accumulation: a middle or last graph recorded before the first
            # graph has would read the first's unrecorded gradients, kept alive by that recording
            # and recorded again once the first's own buffers replace them.
            compiled.run.defer_recording = self.options["training"].accumulation_steps == 1
        self.steps.setdefault(key, []).append((optimized, optimized.step))
        self.last = optimized
        return optimized.step

    def __call__(self, batch: Any) -> torch.Tensor:
        if self.refusal is not None:
            raise InconsistentStateError(self.refusal)
        if self.options.get("data_parallel") is not None:
            self.options["data_parallel"].require_sync()
        step, flat = self.prepare(batch)
        micro = self.micro
        run = step.compiled.run if step.compiled is not None else None
        graphed = isinstance(run, CudaGraphRunner)
        # asked only where there is something to let go: the check walks every input, and the call does again
        if graphed and micro in ("step", "first") and (self.keep_grads or self.accumulated) and run.will_record(flat):
            self._drop_previous_gradients()
        try:
            output = step.run(flat, restore_all=self.on_failure == "restore")
        except BaseException as error:
            self._failed(step.failure_guard.failure, error)
            if isinstance(error, torch.OutOfMemoryError):
                # A recording that failed left none (it releases the last one first): asked afterwards,
                # the runner says it would record, as it was doing.
                recording = graphed and run.will_record(flat)
                where = "while recording it as a CUDA graph" if recording else step.failure_guard.where_failed()
                note_out_of_memory(error, training_step(where), MemorySettings(
                    device_of(flat), self.options["budget"], self.options["memory_limit"]))  # fmt: skip
            raise
        gradients = output.gradients
        if micro == "first":
            self.accumulated.clear()  # in place: the bindings of the other graphs read this dict
            self.accumulated.update(gradients)
        if micro in ("middle", "last"):
            gradients = self.accumulated
        if micro in ("step", "last"):
            # The graph did optimizer.step()'s work: tell learning-rate schedulers, which check for it.
            self.optimizer._opt_called = True  # type: ignore[attr-defined]
        if micro != "step":
            self.micro_index = (self.micro_index + 1) % self.options["training"].accumulation_steps
        if self.keep_grads:
            params = dict(self.model.named_parameters())
            dp = self.options.get("data_parallel")
            sharded = dp.sharded if dp is not None else None
            for name, grad in gradients.items():
                # fully_shard's gradients are DTensors of the local rows, as eager FSDP2 leaves them
                params[name].grad = grad if sharded is None else sharded.local_dtensor(name, grad, params[name])
        return MutwoLoss.returned(output.loss)

    def _drop_previous_gradients(self) -> None:
        """Let the last step's gradients go before a call that records its graph and does not read
        them: the recording makes the graph's own gradient buffers, and the old ones, kept in
        ``.grad`` or the accumulated gradients until the call returned, would be held beside them
        (cached by the allocator once freed, or keeping a released recording's pool alive). A
        recording that fails leaves ``.grad`` None, ``on_failure="restore"`` or not: the parameters
        and optimizer state are what it puts back."""
        self.accumulated.clear()  # in place: the bindings of the other graphs read this dict
        if self.keep_grads:
            for param in self.model.parameters():
                param.grad = None

    def _failed(self, failure: Failure | None, error: BaseException) -> None:
        """After a call raised ``error``: refuse later calls when the parameters or optimizer state
        may be part updated; start a new accumulation cycle when its gradients may be part added."""
        if failure is None:  # it failed before the graph ran
            return
        self.refusal = failure.refusal(error)
        dropped = self.micro_index if failure.accumulated is not None or self.refusal is not None else 0
        if dropped:
            self.micro_index = 0
            self.accumulated.clear()  # in place: the bindings of the other graphs read this dict
        note = failure.note(dropped)
        if note is not None:
            add_note(error, note)


#: What ``loss.backward()`` on the loss a step returned raises (:class:`MutwoLoss`).
BACKWARD_AFTER_STEP = ("mutwo: this loss comes from step(batch), which has already run the backward pass and the "
                       "optimizer step in its graph (with gradient accumulation: added this micro-batch's "
                       "gradients); drop loss.backward(), optimizer.step() and optimizer.zero_grad() from the loop "
                       "(optimize(..., keep_grads=True) sets each parameter's .grad)")  # fmt: skip


class MutwoLoss(torch.autograd.Function):
    """The loss a step returns, with a ``grad_fn`` as eager's has: its own value (an alias: nothing
    is computed, and the graph kept is this node), whose ``backward()`` says in one sentence that
    the step already ran it, where torch would say "element 0 of tensors does not require grad".
    An alias that is no view, so that ``loss += x`` works as on eager's loss."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor) -> torch.Tensor:
        return loss.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(BACKWARD_AFTER_STEP)

    @classmethod
    def returned(cls, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` with this node as its ``grad_fn``; as it is where no graph is recorded (no_grad, inference mode)."""
        if not torch.is_grad_enabled():
            return loss
        return cls.apply(loss.detach().requires_grad_())


def _graph_name(micro: str, k: int) -> str:
    """A graph of :attr:`MutwoStep.micro` in words, for messages."""
    if micro == "step":
        return "the training step's graph"
    return f"the {micro} micro-batch's graph of gradient accumulation (accumulation_steps={k})"


@contextlib.contextmanager
def _noted_on_failure(graph: str | None) -> Iterator[None]:
    """Planning ``graph`` (None: the only one): when it fails, a note on the exception names it."""
    try:
        yield
    except Exception as error:
        if graph is not None:
            add_note(error, f"mutwo: optimize() plans every graph training will run before it returns; this one is "
                            f"{graph}. Nothing was trained, and the optimizer is as it was given")  # fmt: skip
        raise


@contextlib.contextmanager
def _fresh_state_installed(binding: StepBinding) -> Iterator[None]:
    """The state the optimizer creates in its first step (``binding.fresh``) in ``optimizer.state``,
    as zeros in the tensors that step will write, for as long as the graph of the steps after it
    is captured and planned; then taken out again (the first step puts it in)."""
    state = binding.optimizer.state
    params = dict(binding.model.named_parameters())
    absent = [p for p in {params[name] for name, _ in binding.fresh} if p not in state]
    for (name, key), tensor in binding.fresh.items():
        state[params[name]][key] = tensor.zero_()
    try:
        yield
    finally:
        for name, key in binding.fresh:
            del state[params[name]][key]
        for param in absent:
            del state[param]


@contextlib.contextmanager
def _optimizer_state_kept_on_failure(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Capture creates the optimizer's missing state as its first ``step()`` would
    (:func:`mutwo.runtime.capture.optim.init_state`), and for a CUDA graph moves its step counts to
    the device (:func:`mutwo.runtime.capture.device_state.state_for_cuda_graphs`); when planning fails,
    that state is taken back and the moved tensors are put back."""
    before = state_entries(optimizer)
    try:
        yield
    except BaseException:
        put_state_back(optimizer, before)
        raise


def capture_key(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Any,
                graphed: bool = False) -> tuple[Any, ...]:  # fmt: skip
    """What a captured graph is specific to: the batch's structure, shapes, dtypes and devices,
    every module's ``training`` flag (train and eval iterations differ: batch norm statistics,
    dropout), which parameters require grad (the graph computes and applies the gradients of
    those only: freezing or unfreezing a layer changes the step), and each param group's
    hyperparameters except those the graph reads at every call (:func:`_hyperparameters`;
    ``graphed``: for a CUDA graph, whose capturable form of the step keeps momentum and betas as
    constants of the graph)."""
    modes = tuple(module.training for module in model.modules())
    trainable = tuple((name, p.requires_grad) for name, p in model.named_parameters())
    hyper = tuple(_hyperparameters(group, graphed) for group in optimizer.param_groups)
    return ("batch", _signature(batch), "modes", modes, "trainable", trainable, "hyperparameters", hyper)


def _hyperparameters(group: dict[str, Any], graphed: bool = False) -> tuple[tuple[str, Any], ...]:
    """What a graph is specific to in a param group: each hyperparameter's value, but only the
    type of those the graph takes as inputs (the learning rate, and momentum or betas, which
    schedulers change at every step: :data:`mutwo.runtime.capture.optim.SCHEDULED`; not momentum
    and betas in a capturable form, ``graphed``: a change captures again)."""
    inputs = scheduled_kinds(group, graphed)
    return tuple(sorted((key, ("graph input", inputs[key]) if key in inputs else _frozen(value))
                        for key, value in group.items() if key != "params"))  # fmt: skip


def _frozen(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return value if isinstance(value, (int, float, bool, str, type(None))) else repr(value)


HYPERPARAMETERS_CHANGED = "the optimizer's"
#: What :func:`optimize`'s ``on_failure`` may be.
ON_FAILURE = ("refuse", "restore")


def _fields(key: tuple[Any, ...]) -> dict[str, Any]:
    """A key of :meth:`MutwoStep.prepare` (:func:`capture_key`'s name, value, ... and the micro-batch's)
    as a dict by field name."""
    return dict(zip(key[::2], key[1::2], strict=True))


def _describe_change(steps: dict[tuple[Any, ...], Any], key: tuple[Any, ...], batch: Any) -> str:
    """What differs from the nearest graph captured before (the one that differs in fewest of
    :func:`capture_key`'s fields), in words."""
    fields = _fields(key)

    def differing(other: dict[str, Any]) -> list[str]:
        return [name for name, value in fields.items() if other.get(name) != value]

    previous = min((_fields(k) for k in steps if k != key), key=lambda other: len(differing(other)))
    changed = differing(previous)
    said = []
    if "batch" in changed:
        said.append(f"a batch of another shape ({_describe(batch)})")
    if "modes" in changed:
        said.append("the model is in another mode (model.train() / model.eval())")
    if "micro" in changed:
        said.append(f"the {fields['micro']} micro-batch of gradient accumulation")
    if "trainable" in changed:
        flipped = [name for (name, now), (_, then) in zip(fields["trainable"], previous["trainable"], strict=False)
                   if now != then]  # fmt: skip
        shown = ", ".join(flipped[:3]) + (f" and {len(flipped) - 3} more" if len(flipped) > 3 else "")
        said.append(f"requires_grad changed for {len(flipped) or 'some'} parameters ({shown or 'one was added'})")
    groups, groups_before = fields["hyperparameters"], previous["hyperparameters"]
    if len(groups) != len(groups_before):
        said.append(f"the optimizer has {len(groups)} param groups, not {len(groups_before)} (add_param_group)")
    elif "hyperparameters" in changed:
        names = sorted({name for before, now in zip(map(dict, groups_before), map(dict, groups), strict=True)
                        for name in before.keys() | now.keys() if before.get(name) != now.get(name)})  # fmt: skip
        said.append(f"{HYPERPARAMETERS_CHANGED} {', '.join(names)} changed")
    return "; ".join(said)


def optimize(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    example_batch: Any,
    loss_fn: LossFn,
    *,
    budget: float | str | Budget | None = None,
    passes: str | None = None,
    check: bool = False,
    keep_grads: bool = False,
    out_dir: str | Path | None = None,
    verbose: bool = False,
    max_grad_norm: float | None = None,
    norm_type: float = 2.0,
    precision: str = "fp32",
    accumulation_steps: int = 1,
    grad_scaler: torch.amp.GradScaler | None = None,
    data_parallel: bool | None = None,
    bucket_cap_mb: float | None = None,
    backend: str = "auto",
    calibrate_peak: int | None = None,
    measure_choice: bool = False,
    memory_limit: int | str | None = None,
    on_failure: str = "refuse",
    cache: bool | str | Path | None = None,
) -> MutwoStep:
    """An optimized training step for ``model`` and ``optimizer`` (see the module docstring).

    ``budget``: a fraction of the unoptimized peak (0.5), bytes ("6GiB") or "min"; default: the
    GPU's memory (on CPU nothing needs recomputing). ``passes``: the pipeline, as for mutwo-opt (None:
    the default, ``DEFAULT_PASSES``).
    ``check``: compare the optimized step with the captured one before first use and raise
    :class:`NotEquivalentError` on any difference, or say in one line on stderr that it passed
    (verbose or not). The model, optimizer state and batches must be on the device to train on.
    ``example_batch`` is captured right away, with every graph training on batches like it will
    run that is known in advance (:meth:`MutwoStep.plan_ahead`): a budget one of them cannot reach
    raises here, its note naming the graph, and leaves the model and optimizer as they were.
    ``max_grad_norm`` / ``norm_type``: clip the gradients as ``torch.nn.utils.clip_grad_norm_(
    model.parameters(), max_grad_norm, norm_type)`` before the optimizer step, inside the graph.
    ``precision``: ``"fp32"``, ``"bf16-autocast"`` or ``"fp16-autocast"`` (the model and the loss
    under ``torch.autocast``). ``accumulation_steps=k``: each call takes one micro-batch and
    returns its loss (before the division by k); every k-th call steps the optimizer, as an eager
    loop of ``(loss / k).backward()`` would; the first, middle and last micro-batches' graphs are
    all planned here. ``grad_scaler``: a ``torch.amp.GradScaler`` whose
    scale, unscale, inf check, skipped step and scale update run inside the graph, as
    ``scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()`` would; see
    :mod:`mutwo.runtime.capture.training`.

    Data parallel: a ``DistributedDataParallel`` model is unwrapped and its gradients are averaged
    as DDP would (its process group, buckets and buffer broadcast); a plain model is, when a
    process group of several ranks is initialised (``data_parallel=None``; ``True`` requires one,
    ``False`` turns it off), after rank 0's parameters and buffers are broadcast to every rank as
    DDP's constructor does. ``bucket_cap_mb`` is DDP's (default: a 1 MiB first bucket, then 25
    MiB). Every rank must call this, and every step, together, with batches (its shard) of the
    same shape; rank 0 alone writes to ``out_dir`` and logs. ``eager`` and ``inductor`` run such a
    step, and on CUDA with NCCL the CUDA-graph backends, which record its collectives; ``auto``
    records it on CUDA where NCCL allows, else compiles it with ``inductor`` (docs/data-parallel.md).
    ``calibrate_peak`` runs over the ranks' largest measurement, so each rank holds at most the
    budget and all keep one plan; ``measure_choice`` is refused for it: each rank would keep the
    plan it measured faster.

    ``backend``: what runs the optimized graph: ``eager`` (one aten kernel per node), ``inductor``
    (fused by torch's Inductor, compiled now), ``cudagraphs`` or ``inductor-cudagraphs`` (replayed
    as one CUDA graph); see docs/backends.md. ``auto`` (the default) chooses once, before compiling,
    and logs why: on the CPU ``eager``; on CUDA ``inductor-cudagraphs`` when the step can be
    recorded, else the fastest backend that runs it (:mod:`mutwo.runtime.execution.auto_backend`);
    a backend it chose fails as it would named. ``calibrate_peak``: with ``inductor``, plan again up
    to that many times (compiling each time) until the compiled step's measured peak is within 3%
    of the budget, since Inductor's fusion frees buffers the plan counts; more while every plan
    ran out of memory under ``memory_limit``, down to half the budget. ``measure_choice``: with
    a compiled backend and ``passes`` planning swaps (``"profile,swap"``), keep select-swap's plan
    only when it is measured faster than the recompute-only plan at the same budget
    (:mod:`mutwo.runtime.planning.plan_choice`).

    ``memory_limit``: the most the process may hold on the GPU ("16GiB" or bytes), as a card of
    that size would: the process is capped at it from here on
    (``torch.cuda.set_per_process_memory_fraction``), and planning stays within it, profiling the
    step out of core when it does not fit (docs/out-of-core.md). A budget in bytes bounds profiling
    the same way. On CUDA the process's caching allocator is switched to expandable segments,
    unless the allocator was configured (``PYTORCH_CUDA_ALLOC_CONF``, or settings given at run
    time): the step then holds little over what it allocates (docs/backends.md).

    ``on_failure``: what a step that raises (``torch.OutOfMemoryError``...) leaves. It raises its
    own exception, and the buffers and step counts it wrote are put back. ``"refuse"``: when it
    had not begun updating parameters and optimizer state (the eager backend knows; a compiled
    one does not) they are as before it and training goes on; otherwise the step refuses every
    later call (:class:`InconsistentStateError`). ``"restore"``: every failed step is undone, for
    a copy of the parameters and optimizer state in host memory made before each step. The
    README says more ("A step that fails").

    ``cache``: where the profile and the plan of each graph are kept, so that a second process
    with the same model, batch, device and settings skips profiling, selection and calibration
    (docs/plan-cache.md): None or True, ``$MUTWO_CACHE_DIR``, else ``$XDG_CACHE_HOME/mutwo``, else
    ``~/.cache/mutwo`` (None: unless ``MUTWO_CACHE=0``); a folder; False: none. Each stage of
    planning is said as it starts and ends, on stderr, when ``verbose`` or stderr is a terminal;
    ``step.setup_seconds`` says where the time went.
    """
    if on_failure not in ON_FAILURE:
        raise ValueError(f"on_failure must be one of {', '.join(ON_FAILURE)}, not {on_failure!r}")
    if budget is not None and not isinstance(budget, Budget):
        budget = parse_budget(budget)
    limit = parse_bytes(memory_limit) if isinstance(memory_limit, str) else memory_limit
    wrapped = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    model, dp = distributed.data_parallel_for(model, data_parallel, bucket_cap_mb)
    if dp is not None and not wrapped and dp.sharded is None:  # DDP broadcasts when it wraps; FSDP2 never does
        distributed.broadcast_model(model, dp)
    lead = dp is None or dp.rank == 0
    say = (lambda message: print(message, file=sys.stderr)) if lead else (lambda message: None)
    log = say if verbose else (lambda message: None)
    device = device_of([*model.parameters(), *model.buffers()])
    allocator = use_expandable_segments(device)
    if allocator is not None:  # a change to the whole process is said even when not verbose (once: then it is on)
        (say if allocator == SWITCHED_ON else log)(f"mutwo: {allocator}")
    if limit is not None:
        log(apply_memory_limit(device, limit))
    training = TrainingOptions(max_grad_norm, norm_type, precision, accumulation_steps, grad_scaler)
    options = {"passes": DEFAULT_PASSES if passes is None else passes, "budget": budget, "check": check,
               "keep_grads": keep_grads,
               "training": training, "data_parallel": dp, "backend": backend, "calibrate_peak": calibrate_peak,
               "measure_choice": measure_choice, "memory_limit": limit,
               "out_dir": Path(out_dir) if out_dir is not None and lead else None,
               # minutes on a large model: said where someone watches (verbose, or a terminal)
               "cache": cache, "progress": say if verbose or sys.stderr.isatty() else log}  # fmt: skip
    step = MutwoStep(model, optimizer, loss_fn, options, keep_grads, log, say, on_failure=on_failure)
    step.plan_ahead(example_batch)
    return step


def _signature(batch: Any) -> tuple[Any, ...]:
    leaves, spec = pytree.tree_flatten(batch)
    return (str(spec),) + tuple((tuple(t.shape), t.dtype, str(t.device)) if isinstance(t, torch.Tensor) else t
                                for t in leaves)  # fmt: skip


def _describe(batch: Any) -> str:
    shapes = [tuple(t.shape) for t in pytree.tree_leaves(batch) if isinstance(t, torch.Tensor)]
    return ", ".join(str(s) for s in shapes)
