"""Checking that two graphs of the same iteration compute the same numbers.

Both graphs run from identical copies of the whole state (parameters, buffers, optimizer state,
learning rates, batch) and the same random seed, for several consecutive iterations, with the
learning rate changed between iterations as a scheduler would. After each iteration the loss,
every gradient both graphs return, and every parameter, buffer and optimizer state tensor (all updated in place by
the graph) are compared: bitwise on CPU, within stated tolerances on CUDA. A compiled step is
compared within :class:`Tolerance`, or where it misses that, against an fp64 run of the original
(:mod:`mutwo.runtime.measurement.fp64_reference`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from mutwo.ir.graph import Graph
from mutwo.ir.node import NodeKind
from mutwo.ir.replay import batch_norm_from_stats, exact_on
from mutwo.ir.row_region import SLICED_META
from mutwo.ir.to_fx import to_fx
from mutwo.runtime.measurement import fp64_reference
from mutwo.runtime.measurement.iterations import device_of

#: Tolerances on CUDA, where kernels (cuDNN convolution algorithms, atomics in reductions) may
#: differ from run to run unless deterministic algorithms are on.
CUDA_RTOL = 1e-4
CUDA_ATOL = 1e-5
#: A graph computing in reduced precision (autocast, bf16/fp16 parameters) is compared, when not
#: bitwise, with torch.testing.assert_close's tolerances for its lowest-precision dtype.
REDUCED_PRECISION_TOLERANCES = {torch.bfloat16: (1.6e-2, 1e-5), torch.float16: (1e-3, 1e-5)}

#: A rewrite that runs a region in slices of rows (the ``chunk`` pass, :mod:`mutwo.ir.row_slicing`)
#: adds up the loss and the weight gradient slice by slice, in another order than the whole ops:
#: those values, and the parameters and optimizer state updated from them, are compared within
#: SLICED_RTOL of each element plus SLICED_SCALE of the tensor's largest magnitude (fp32 rounding
#: of a reordered sum is a few ulps of the partial sums: 1e-5 is about 80 ulps, and an element
#: that nearly cancels is judged against the tensor's scale), or pass by the fp64 rule.
SLICED_RTOL = 1e-5
SLICED_SCALE = 1e-6
#: Adam-updated parameters of those values may differ by this many times the learning rate more
#: (a near-zero gradient's sign can flip, and Adam moves it by about the learning rate either way).
SLICED_LR_FACTOR = 2.0

#: When the reference varies between two runs from the same state (a kernel that is not
#: deterministic even in deterministic mode), a tensor may differ from it by up to this many times
#: the reference's own difference between its two runs.
REFERENCE_SPREAD = 4.0

@dataclass(frozen=True)
class Tolerance:
    """How close a compiled step (fused kernels round differently) must come to the eager one, and
    a rewrite to an original that itself varies from run to run (a GPU kernel that is not
    deterministic even in deterministic mode): both differences are rounding noise.

    Each iteration starts both steps from the reference's state, so a rounding difference is not
    compounded over iterations. Everything (loss, gradients, parameters, buffers and optimizer
    state written by the step) must agree within ``rtol``/``atol``, except that a parameter
    updated by an adaptive optimizer (Adam, AdamW: it has ``exp_avg_sq`` state) may differ by
    ``lr_factor`` times the largest learning rate more: Adam divides a gradient by its own
    magnitude, so a parameter whose gradient is rounding noise (a bias before a batch norm) moves
    by up to the learning rate whatever the noise is, in either direction. A graph computing in
    reduced precision widens ``rtol``/``atol`` to its :data:`REDUCED_PRECISION_TOLERANCES`.

    With ``fp64``, a tensor that misses this direct tolerance still passes when its error from an
    fp64 run of the original is within torch's accuracy runs' multiple of eager fp32's error from
    it (:mod:`mutwo.runtime.measurement.fp64_reference`): on an ill-conditioned model eager fp32 is itself far
    from the exact result, and a compiled step no further from it is as right as eager.
    """

    rtol: float = 1e-3
    atol: float = 1e-5
    lr_factor: float = 2.0
    fp64: bool = True

    def __str__(self) -> str:
        fp64 = f"; or {fp64_reference.criterion(self.atol)}" if self.fp64 else ""
        return (f"rtol={self.rtol}, atol={self.atol} (Adam-updated parameters: atol + {self.lr_factor} x lr), "
                f"each iteration from the same state{fp64}")


#: Learning-rate factor per iteration: the second iteration halves it, like a step scheduler.
LR_SCHEDULE = (1.0, 0.5, 0.5, 0.25)


@dataclass
class Mismatch:
    iteration: int
    what: str  #: 'loss', 'gradient', or the kind of a state slot
    label: str
    max_abs_diff: float
    max_abs_value: float | None = None  #: the reference's largest magnitude in the tensor, for scale
    fp64: str | None = None  #: the fp64 rule's numbers (or why it had none), for a compiled step

    def __str__(self) -> str:
        scale = f", |values| up to {self.max_abs_value:.3g}" if self.max_abs_value is not None else ""
        fp64 = f"; {self.fp64}" if self.fp64 is not None else ""
        return (f"iteration {self.iteration}: {self.what} {self.label} differs (max |diff| {self.max_abs_diff:.3g}"
                f"{scale}{fp64})")


@dataclass
class EquivalenceReport:
    iterations: int
    bitwise: bool
    #: set when compared within a Tolerance: a compiled step, or an original that varies by itself
    tolerance: Tolerance | None = None
    mismatches: list[Mismatch] = field(default_factory=list)
    compared: int = 0  #: number of tensors compared over all iterations
    #: gradients the candidate no longer returns: they are checked through what their updates wrote
    gradients_not_returned: int = 0
    #: what differed between two runs of the reference itself, when it did (then not bitwise)
    reference_varies: str | None = None
    rtol: float = CUDA_RTOL  #: tolerances when not bitwise
    atol: float = CUDA_ATOL
    #: with a Tolerance's fp64 rule: the tensors that missed the direct tolerance and passed by it
    passed_by_fp64: int = 0
    #: why the fp64 run of the original stopped (then the direct tolerance alone decided)
    fp64_failure: str | None = None
    #: the random ops the candidate runs, by op, in graph order (:func:`random_ops`)
    random_ops: dict[str, int] = field(default_factory=dict)
    #: what the candidate sums over slices of rows ("loss", parameter labels): compared within the
    #: sliced tolerance (:data:`SLICED_RTOL`), the rest as ``bitwise`` says
    sliced: list[str] = field(default_factory=list)
    #: of a sliced candidate compared bitwise (on the CPU): the other tensors that differed in their
    #: last bits and passed by the sliced rule (MKL picks a matmul's kernel by its shape, so a
    #: slice's rows of the hidden state's gradient may round otherwise than the whole matmul's)
    rounded_by_slices: int = 0

    @property
    def equivalent(self) -> bool:
        return not self.mismatches

    def summary(self) -> str:
        if self.bitwise:
            mode = "bitwise"
        elif self.reference_varies is not None:
            mode = (f"not bitwise because the original itself varies from run to run ({self.reference_varies}): each "
                    f"tensor within {self.tolerance or f'rtol={self.rtol:g}, atol={self.atol:g}'}, or within "
                    f"{REFERENCE_SPREAD:g}x the original's own variation")
        elif self.tolerance is not None:
            mode = f"compiled-step tolerance: {self.tolerance}{self._fp64_outcome()}"
        else:
            mode = f"rtol={self.rtol:g}, atol={self.atol:g}"
        if self.sliced:
            mode += f"; {sliced_rule(self.sliced)}"
        if self.rounded_by_slices:
            mode += (f"; {self.rounded_by_slices} other tensors differed in their last bits (a sliced matmul's "
                     "kernel rounds otherwise than the whole one's) and passed by the same rule")
        if self.equivalent:
            dropped = (f"; {self.gradients_not_returned} gradients are not returned and were compared through the "
                       "parameters and state their updates wrote") if self.gradients_not_returned else ""
            return f"equivalent over {self.iterations} iterations ({self.compared} tensors compared, {mode}{dropped})"
        head = f"NOT equivalent ({len(self.mismatches)} mismatches, {mode}); first: {self.mismatches[0]}"
        return head + self._random_cause()

    def _random_cause(self) -> str:
        """Whether random numbers may explain the mismatches: a mask drawn in other places changes
        every number after it, and the first tensor named is then wherever that shows first."""
        if not self.random_ops:
            return ""
        ops = ", ".join(f"{count} {op}" for op, count in list(self.random_ops.items())[:3])
        drew = next((m for m in self.mismatches if m.what == "random generator"), None)
        if drew is not None:
            return (f"; random numbers differ: the steps drew different counts of them (the generator states differ "
                    f"after iteration {drew.iteration}; random ops: {ops})")  # fmt: skip
        return (f"; the step draws random numbers ({ops}), which may be the cause: a draw in another place changes "
                "every number computed from it; the same check with every dropout probability at 0 tells")

    def _fp64_outcome(self) -> str:
        """Which rule passed how many tensors, or why the fp64 rule was not applied."""
        assert self.tolerance is not None
        if not self.tolerance.fp64:
            return ""
        if self.fp64_failure is not None:
            before = f" from then on ({self.passed_by_fp64} tensors had passed by the fp64 rule)" \
                if self.passed_by_fp64 else ""  # fmt: skip
            return f"; the fp64 run of the original {self.fp64_failure}, so the direct tolerance alone decided{before}"
        return (f"; {self.compared - len(self.mismatches) - self.passed_by_fp64} tensors passed by the direct rule, "
                f"{self.passed_by_fp64} by the fp64 rule")


@contextlib.contextmanager
def deterministic_algorithms() -> Iterator[None]:
    """Deterministic kernels (cuDNN, cuBLAS, scatter-adds) for the duration of a check.

    Without them, CUDA reductions and convolution algorithms may differ in the last bit from run
    to run, and Adam turns last-bit differences of near-zero gradients into differences of the
    learning rate's size. ``CUBLAS_WORKSPACE_CONFIG`` must be set before cuBLAS starts: the CLI
    sets it at startup.
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    previous = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
                torch.backends.cudnn.benchmark)  # fmt: skip
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous[0])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = previous[1], previous[2]


def generator_states(device: torch.device) -> list[torch.Tensor]:
    """The default generators' states: the CPU's, and the GPU's when ``device`` is one."""
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


@contextlib.contextmanager
def random_stream_kept(model: torch.nn.Module) -> Iterator[None]:
    """Leave torch's default generators (the CPU's and those of the GPUs ``model`` is on) where
    they were: planning runs the graph (profiling, checks, calibration) and reseeds for its
    checks, and the caller's training must draw the random numbers eager training would."""
    gpus = {t.device.index if t.device.index is not None else torch.cuda.current_device()
            for t in (*model.parameters(), *model.buffers()) if t.is_cuda}  # fmt: skip
    with torch.random.fork_rng(devices=sorted(gpus)):
        yield


def sliced_values(graph: Graph) -> list[str]:
    """What ``graph`` sums over slices of rows: "loss" and the labels of parameters whose gradients
    are such sums (what :mod:`mutwo.ir.row_slicing` recorded)."""
    labels = {label for record in graph.meta.get(SLICED_META, ()) for label in record["summed"]}
    return sorted(labels, key=lambda label: (label != "loss", label))


def sliced_rule(sliced: list[str]) -> str:
    """How the values summed over slices are compared, in words."""
    named = ", ".join(f"{label} (gradient, parameter, optimizer state)" if label != "loss" else "the loss"
                      for label in sliced)  # fmt: skip
    return (f"{named} summed over slices of rows are compared within rtol={SLICED_RTOL:g} + {SLICED_SCALE:g} x "
            f"the tensor's largest magnitude (Adam-updated parameters: + {SLICED_LR_FACTOR:g} x lr), or the fp64 "
            "rule; each iteration from the same state")  # fmt: skip


def _summed_slice_by_slice(what: str, label: str, sliced: list[str]) -> bool:
    """Whether the compared tensor is computed from sums over slices (its label is the
    parameter's, or the parameter's with ``:state`` for optimizer state)."""
    return ("loss" if what == "loss" else label.split(":", 1)[0]) in sliced and what != "random generator"


def _close_to_sliced(a: torch.Tensor, b: torch.Tensor, slack: float) -> bool:
    """Within the sliced tolerance (:data:`SLICED_RTOL`, :data:`SLICED_SCALE`), plus ``slack``."""
    if a.shape != b.shape or a.dtype != b.dtype or not a.is_floating_point():
        return _same(a, b, None)
    scale = float(a.abs().max()) if a.numel() else 0.0
    return torch.allclose(a, b, rtol=SLICED_RTOL, atol=SLICED_SCALE * scale + slack, equal_nan=True)


def random_ops(graph: Graph) -> dict[str, int]:
    """How many nodes of ``graph`` draw random numbers, by op, in graph order."""
    counts: dict[str, int] = {}
    for node in graph:
        if node.op == "call_function" and node.is_random:
            counts[str(node.target)] = counts.get(str(node.target), 0) + 1
    return counts


def replays_exact(graph: Graph, device: str) -> bool:
    """Whether every replay in ``graph`` reproduces its original bit for bit on ``device``."""
    return exact_on(device) or not any(n.target is batch_norm_from_stats for n in graph)


def _varies_between_runs(module: Callable[..., Any], inputs: list[torch.Tensor], seed: int, output_names: list[str],
                         input_names: list[str]) -> str | None:  # fmt: skip
    """Run ``module`` twice from clones of ``inputs``; name the first output or updated input that
    differs (a kernel not deterministic on the device even in deterministic mode), or None."""
    runs = []
    for _ in range(2):
        state = [t.clone() for t in inputs]
        torch.manual_seed(seed)
        with torch.no_grad():
            outputs = module(*state)
        runs.append((list(outputs), state))
    (outputs_a, state_a), (outputs_b, state_b) = runs
    for index, (a, b) in enumerate(zip(outputs_a, outputs_b, strict=True)):
        if isinstance(a, torch.Tensor) and not _same(a, b, None):
            return f"{output_names[index]} (max |diff| {_max_diff(a, b):.3g})"
    for index, (a, b) in enumerate(zip(state_a, state_b, strict=True)):
        if not _same(a, b, None):
            return f"{input_names[index]} after the step (max |diff| {_max_diff(a, b):.3g})"
    return None


def tolerances(graph: Graph) -> tuple[float, float]:
    """(rtol, atol) for comparing ``graph``'s results when not bitwise: see :data:`REDUCED_PRECISION_TOLERANCES`."""
    dtypes = {t.dtype for node in graph for t in node.tensors if t is not None}
    for dtype, tolerance in REDUCED_PRECISION_TOLERANCES.items():
        if dtype in dtypes:
            return tolerance
    return CUDA_RTOL, CUDA_ATOL


def _same(a: torch.Tensor, b: torch.Tensor, within: tuple[float, float] | None) -> bool:
    """Equal bit for bit (``within`` None), or within ``(rtol, atol)``."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if within is None or not a.is_floating_point():
        return bool(((a == b) | (a.isnan() & b.isnan())).all()) if a.is_floating_point() else torch.equal(a, b)
    return torch.allclose(a, b, rtol=within[0], atol=within[1], equal_nan=True)


def _within(what: str, bitwise: bool, rtol: float, atol: float, slack: float) -> tuple[float, float] | None:
    """The ``(rtol, atol)`` a compared tensor must meet, or None for bit for bit; ``slack`` is
    added to the tolerance of a parameter (a compiled step's Adam-updated parameters)."""
    if what == "random generator" or bitwise:
        return None
    return rtol, atol + (slack if what == NodeKind.PARAMETER.value else 0.0)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def _no_fp64_verdict(fp64: fp64_reference.Fp64Run | None, what: str, tensor: torch.Tensor,
                     exact: torch.Tensor | None) -> str | None:  # fmt: skip
    """Why a compiled step's floating tensor has no fp64 verdict (None: no fp64 run was asked for,
    or the fp64 rule does not apply: integers and generator states are compared exactly)."""
    if fp64 is None or what == "random generator" or not tensor.is_floating_point():
        return None
    if exact is None:
        return f"no fp64 reference: {fp64.failure}" if fp64.failure is not None else "no fp64 reference"
    return f"no fp64 reference (the fp64 run computed it in {exact.dtype})"


def compare_graphs(
    reference: Graph,
    candidate: Graph,
    inputs: list[torch.Tensor],
    *,
    iterations: int = 3,
    seed: int = 0,
    bitwise: bool | None = None,
    progress: Callable[[int], None] | None = None,
    candidate_run: Callable[..., Any] | None = None,
    tolerance: Tolerance | None = None,
) -> EquivalenceReport:
    """Run both graphs from clones of ``inputs`` (in slot order) and compare everything: loss,
    gradients, every state slot, and the random generators' state after each iteration (the next
    iteration's random numbers).

    The graphs must have the same placeholders (labels and kinds) and output structure.
    ``bitwise`` defaults to True on CPU, and elsewhere to whether deterministic algorithms are on
    and every replay in ``candidate`` is exact on that device (batch norms replayed from their
    statistics are not on CUDA: :func:`mutwo.ir.replay.exact_on`).

    ``candidate_run`` runs the candidate instead of its fx module (a compiled step); with
    ``tolerance`` everything is compared within it, each iteration from the reference's state,
    and (``tolerance.fp64``) a tensor outside it is judged against an fp64 run of ``reference``
    (:mod:`mutwo.runtime.measurement.fp64_reference`).

    A candidate that sums a region over slices of rows (:func:`sliced_values`) is compared from
    the reference's state each iteration too: the values made of those sums (the loss, a weight
    gradient, that weight and its optimizer state) within the sliced tolerance or the fp64 rule,
    everything else as above (bitwise on CPU: the same ops on the same rows; where MKL's kernel for
    a slice's shape rounds otherwise, within the sliced rule too, counted in the report's
    ``rounded_by_slices``). Elsewhere than on
    the CPU, where a matmul's kernel depends on its shape (cuBLAS), every value may round
    differently: it is compared as a compiled step is (:class:`Tolerance`).
    """
    ref_slots = [(p.kind, p.label) for p in reference.placeholders]
    if ref_slots != [(p.kind, p.label) for p in candidate.placeholders]:
        raise ValueError("the two graphs do not take the same inputs; they are not versions of one iteration")
    device = device_of(inputs)
    sliced = sliced_values(candidate)
    if sliced and device.type != "cpu" and tolerance is None:
        tolerance = Tolerance()
    if bitwise is None:
        bitwise = device.type == "cpu" or (torch.are_deterministic_algorithms_enabled()
                                           and replays_exact(candidate, str(device)))  # fmt: skip
    # The comparison mode is decided here, once: bitwise, or within the graph's precision's
    # tolerances (widened for a compiled step), or within them or the reference's own variation.
    if tolerance is not None:  # a compiled step rounds differently: never bitwise
        bitwise = False
        rtol, atol = tolerances(reference)
        tolerance = replace(tolerance, rtol=max(tolerance.rtol, rtol), atol=max(tolerance.atol, atol))
    modules: list[Callable[..., Any]] = [to_fx(reference), candidate_run or to_fx(candidate)]
    varies = None
    if bitwise and device.type != "cpu":
        output_names = ["loss", *(f"gradient {n.label}" for n in reference.output.args[0][1:])]
        varies = _varies_between_runs(modules[0], inputs, seed, output_names, [label for _, label in ref_slots])
    bitwise = bitwise and varies is None
    if varies is not None and tolerance is None:
        # The original's own variation is rounding noise, as a compiled step's is, and Adam answers
        # noise in a near-zero gradient with a learning-rate-sized step either way (and clipping
        # spreads one gradient's noise to all): compare the way a compiled step is compared.
        tolerance = Tolerance(*tolerances(reference), fp64=False)
    report = EquivalenceReport(iterations, bitwise, tolerance, reference_varies=varies,
                               random_ops=random_ops(candidate), sliced=sliced)  # fmt: skip
    report.rtol, report.atol = (tolerance.rtol, tolerance.atol) if tolerance is not None else tolerances(reference)
    if varies is not None:  # a second run of the reference measures how much it varies by itself
        modules.append(modules[0])
    wants_fp64 = (tolerance is not None and tolerance.fp64) or bool(sliced)
    fp64 = fp64_reference.Fp64Run(modules[0], inputs, device) if wants_fp64 else None
    states = [[t.clone() for t in inputs] for _ in modules]
    lr_slots = [i for i, (kind, label) in enumerate(ref_slots) if kind is NodeKind.OTHER and label.startswith("lr:")]
    adaptive = {label.rsplit(":", 1)[0] for kind, label in ref_slots
                if kind is NodeKind.OPTIMIZER_STATE and label.endswith(":exp_avg_sq")}  # fmt: skip
    base_lrs = {i: inputs[i].clone() for i in lr_slots}
    # A pass may stop returning gradients (optimizer-in-backward frees each after its update):
    # compare those both return; the parameters and optimizer state carry the others' effect.
    graphs = (reference, candidate, reference)[:len(modules)]  # the graph each module runs
    grad_labels = [[n.label for n in graph.output.args[0][1:]] for graph in graphs]
    compared_grads = [label for label in grad_labels[0] if label in set(grad_labels[1])]
    report.gradients_not_returned = len(grad_labels[0]) - len(compared_grads)
    for iteration in range(iterations):
        for state in states:
            for i in lr_slots:
                state[i] = base_lrs[i] * LR_SCHEDULE[iteration % len(LR_SCHEDULE)]
        if tolerance is not None or sliced:  # rounding must not compound: restart from the reference's state
            for state in states[1:]:
                for mine, theirs in zip(state, states[0], strict=True):
                    mine.copy_(theirs)
        fp64_outputs = fp64.step(states[0], iteration, seed + iteration) if fp64 is not None else None
        outputs = []
        generators: list[list[torch.Tensor]] = []
        for module, state in zip(modules, states, strict=True):
            torch.manual_seed(seed + iteration)
            with torch.no_grad():
                outputs.append(module(*state))
            generators.append(generator_states(device))
        returned = [dict(zip(labels, output[1:], strict=True)) for labels, output in zip(grad_labels, outputs,
                                                                                           strict=True)]  # fmt: skip
        # (what, label, the tensor in each run: reference, candidate[, reference again])
        compared = [("loss", "loss", [output[0] for output in outputs])]
        compared += [("gradient", label, [r[label] for r in returned]) for label in compared_grads]
        compared += [(kind.value, label, [state[i] for state in states]) for i, (kind, label) in enumerate(ref_slots)
                     if kind is not NodeKind.OTHER]  # fmt: skip
        names = ["cpu", str(device)][:len(generators[0])]
        compared += [("random generator", name, [g[j] for g in generators]) for j, name in enumerate(names)]
        # The fp64 run's counterparts, by (what, label): a gradient and its parameter share a label.
        exact: dict[tuple[str, str], torch.Tensor] = {}
        if fp64 is not None and fp64_outputs is not None:
            exact[("loss", "loss")] = fp64_outputs[0]
            exact.update((("gradient", label), t) for label, t in zip(grad_labels[0], fp64_outputs[1:], strict=True))
            exact.update(((kind.value, label), fp64.state[i]) for i, (kind, label) in enumerate(ref_slots))
        largest_lr = max((float(states[0][i].max()) for i in lr_slots), default=0.0)
        slack = tolerance.lr_factor * largest_lr if tolerance is not None else 0.0
        for what, label, runs in compared:
            report.compared += 1
            a, b = runs[0], runs[1]
            if _same(a, b, _within(what, bitwise, report.rtol, report.atol, slack if label in adaptive else 0.0)):
                continue
            summed = _summed_slice_by_slice(what, label, sliced)
            # Compared bitwise (the CPU), what the slices do not sum runs the same ops on the same
            # rows, but MKL may pick another kernel for a slice's shape: a last-bit difference there
            # is judged as the sums are, and counted.
            rounded = bool(sliced) and tolerance is None and not summed and what != "random generator"
            # the Adam slack is for the updated parameter only: its gradient and state get none
            adam_slack = SLICED_LR_FACTOR * largest_lr if label in adaptive and what == NodeKind.PARAMETER.value \
                else 0.0
            if (summed or rounded) and _close_to_sliced(a, b, adam_slack):
                report.rounded_by_slices += rounded
                continue
            # The rewrite may differ from the original as much as the original differs from itself.
            if len(runs) == 3 and _max_diff(a, b) <= REFERENCE_SPREAD * _max_diff(a, runs[2]):
                continue
            # Without a tolerance, only values summed over slices may pass by the fp64 rule, its
            # floor then a share of the tensor's scale, as in their direct rule.
            counterpart = exact.get((what, label)) if tolerance is not None or summed or rounded else None
            rtol, atol = (report.rtol, report.atol) if tolerance is not None else \
                (SLICED_RTOL, SLICED_SCALE * (float(a.abs().max()) if a.is_floating_point() and a.numel() else 0.0))
            judged = fp64_reference.verdict(a, b, counterpart, rtol, atol) if counterpart is not None else None
            if judged is not None and judged.passed:
                report.passed_by_fp64 += 1
                continue
            scale = float(a.detach().abs().max()) if a.is_floating_point() and a.numel() else None
            why = str(judged) if judged is not None else _no_fp64_verdict(fp64, what, a, counterpart)
            report.mismatches.append(Mismatch(iteration, what, label, _max_diff(a, b), scale, why))
        if fp64 is not None:
            report.fp64_failure = fp64.failure
        if progress is not None:
            progress(iteration)
    return report


def check_graphs(reference: Graph, candidate: Graph, inputs: list[torch.Tensor], iterations: int = 3,
                 candidate_run: Callable[..., Any] | None = None,
                 tolerance: Tolerance | None = None) -> EquivalenceReport:  # fmt: skip
    """:func:`compare_graphs` with deterministic kernels: what ``--check`` and ``optimize(check=True)``
    run (with a compiled step's ``run`` and ``tolerance``, :class:`mutwo.runtime.execution.backends.CompiledStep`)."""
    with deterministic_algorithms():
        return compare_graphs(reference, candidate, inputs, iterations=iterations, candidate_run=candidate_run,
                              tolerance=tolerance)  # fmt: skip
