"""Backends: what runs the final (planned) graph of an iteration.

* ``eager``: the fx GraphModule itself, one aten kernel per node (bitwise what the plan says);
* ``inductor``: the whole iteration (forward, backward, in-place optimizer update) compiled by
  torch's Inductor, as ``torch.compile`` compiles a graph AOTAutograd hands it: ``compile_fx``
  functionalizes the graph (in-place updates of parameters, buffers and optimizer state become
  functional ops plus a ``copy_`` back into the input, which Inductor writes in place inside the
  fused kernel), lowers it and generates fused kernels (C++ on CPU, Triton on CUDA);
* ``cudagraphs``: the eager graph recorded once as a CUDA graph and replayed
  (:mod:`mutwo.runtime.execution.cuda_graphs`);
* ``inductor-cudagraphs``: the Inductor-compiled step recorded and replayed the same way, as
  ``torch.compile(mode="reduce-overhead")`` does.

The plan's order survives compilation: the passes that would reorder the graph are off
(:data:`INDUCTOR_OPTIONS`), fusion stays within the plan's phases and the C++ backend generates one
kernel per fused node (:mod:`mutwo.runtime.execution.fusion`); docs/backends.md has the evidence. A
data-parallel step's collectives compile in their out-of-place form and keep the graph's order
(:mod:`mutwo.runtime.execution.compiled_collectives`). Fusion changes rounding, so an Inductor step
is checked within a stated tolerance; a CUDA graph of the eager graph runs the same kernels and is
checked bitwise.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

import mutwo.runtime.capture.host_call_ops  # noqa: F401  (defines the mutwo::host_call ops rewritten here)
from mutwo.ir.graph import Graph
from mutwo.ir.node import NodeKind
from mutwo.ir.replay import batch_norm_elemt_decomposition, rng_state
from mutwo.ir.swap import SWAP_OPS
from mutwo.ir.to_fx import to_fx
from mutwo.runtime.capture.tracing import debug_enabled, quiet_loggers, quiet_torch_errors
from mutwo.runtime.execution.aot_cache_bypass import noting_bypass
from mutwo.runtime.execution.compiled_collectives import functional_collectives, has_collectives, order_kept_options
from mutwo.runtime.execution.compiled_random import draw_as_eager
from mutwo.runtime.execution.cuda_graphs import CudaGraphRunner, refuse_uncapturable
from mutwo.runtime.execution.empty_concatenations import single_tensor_concatenations
from mutwo.runtime.execution.errors import BackendError, CompileError
from mutwo.runtime.execution.fusion import kernel_per_node, mark_phases, phase_bounded_fusion, phases_arrived
from mutwo.runtime.execution.replay_cache_keys import replay_cache_keys
from mutwo.runtime.execution.stored_across_phases import STORED_RULE_VERSION, kept_values_stored
from mutwo.runtime.execution.swap_graphs import insert_release_points
from mutwo.runtime.execution.swap_inductor import (
    SWAP_RULE_VERSION,
    compiled_swap_ops,
    offloaded_buffers_kept_from_reuse,
)
from mutwo.runtime.measurement.equivalence import Tolerance

#: Inputs the step updates in place and keeps at their address from call to call.
STATE_KINDS = frozenset({NodeKind.PARAMETER, NodeKind.BUFFER, NodeKind.OPTIMIZER_STATE})

BACKENDS = ("eager", "inductor", "cudagraphs", "inductor-cudagraphs")

#: Inductor settings for a planned graph, and why:
#: - ``reorder_for_locality``: the post-grad pass moves each producer right before its first
#:   consumer; a forward op read only in the backward would move into the backward and keep its
#:   inputs (activations the plan frees) alive until then.
#: - ``reorder_for_peak_memory``: the scheduler replaces the graph's order by the best of three
#:   topological sorts under its own estimate, which does not know the plan; the plan's order is
#:   the one whose peak mutwo simulated.
#: - ``fallback_random``: random ops run aten's kernels on the default generator, in the graph's
#:   order; with the layouts :func:`~mutwo.runtime.execution.compiled_random.draw_as_eager` pins,
#:   a compiled step draws the same numbers as the eager one.
#: On a GPU also (:data:`CUDA_INDUCTOR_OPTIONS`):
#: - ``layout_optimization``: Inductor would turn a convolutional network's tensors channels-last,
#:   and cuDNN then picks other algorithms, which with TF32 (on for convolutions by default)
#:   differ from eager's by about 1% (a test CNN's first-layer gradient on the H100: 3.75e-4 apart
#:   where its values reach 0.0286; within rtol 1e-3 with this off). On the CPU, where there is
#:   no TF32, it stays on: it lowered a planned CNN's peak by 9% there.
INDUCTOR_OPTIONS: dict[str, Any] = {
    "reorder_for_locality": False,
    "reorder_for_peak_memory": False,
    "fallback_random": True,
}
CUDA_INDUCTOR_OPTIONS: dict[str, Any] = {"layout_optimization": False}


@contextmanager
def batch_norm_elemt_decomposed() -> Iterator[None]:
    """Inductor decomposing ``aten.batch_norm_elemt`` (:func:`batch_norm_elemt_decomposition`) while
    compiling.

    Why: on CUDA a batch norm recomputed from its saved statistics replays as ``batch_norm_elemt``
    (:func:`~mutwo.ir.replay.batch_norm_from_stats`), for which Inductor has neither a lowering nor
    a decomposition. It ran as an extern fallback kernel, and the ReLU after it could not fuse with
    it; decomposed into pointwise ops, replay and ReLU become one kernel, as ``select`` prices them
    under this backend (:mod:`mutwo.ir.time_model`, fused pricing). The entry goes into Inductor's
    own table (what ``select_decomp_table`` returns under ``fallback_random``) for the length of the
    compile, not through ``compile_fx(decompositions=...)``: that wraps the table in an object the
    FX graph cache cannot pickle, and the cache is then bypassed (every compile from scratch: ~4
    minutes for ResNet-152 on the H100's host). That cache keys the decomposed graph, so code
    compiled without the entry is not served for a graph that needs it (AOTAutograd's cache, which
    keys the graph before decomposition, takes one that calls ``batch_norm_from_stats`` under the
    key :mod:`~mutwo.runtime.execution.replay_cache_keys` gives it, which covers this decomposition).
    """
    from torch._inductor.decomposition import decompositions

    op = torch.ops.aten.batch_norm_elemt.default
    if op in decompositions:  # a torch that decomposes it itself
        yield
        return
    decompositions[op] = batch_norm_elemt_decomposition
    try:
        yield
    finally:
        decompositions.pop(op, None)


def backend_services(backend: str) -> dict[str, bool]:
    """What the passes are told about ``backend`` (``PassContext.services``): ``replay_random``,
    whether it can replay a random op from a saved generator state (eager only: Inductor would bake
    the state in as a constant, a CUDA graph cannot read it on the host); ``fused_recompute``,
    whether it fuses recompute clones (Inductor: ``select`` prices them as fused)."""
    return {"replay_random": backend == "eager", "fused_recompute": backend.startswith("inductor")}


@dataclass
class CompiledStep:
    """A graph made runnable by a backend: call ``run(*flat_inputs)`` under ``torch.no_grad``."""

    backend: str
    run: Callable[..., Any]
    compile_seconds: float = 0.0
    #: whether torch's compile caches answered (None: no Inductor compile happened)
    cache_hit: bool | None = None
    #: why AOTAutograd's cache skipped the step, which every start then traces again (None: it did not)
    cache_bypass: str | None = None
    #: whether AOTAutograd's cache answered (None: no Inductor compile happened). Where only
    #: Inductor's FX graph cache did, AOTAutograd traced the whole step again: 13-26 s of a restart on
    #: an H200 (bench/results/session32_h200/README.md), where a hit of both takes 3 s
    aot_cache_hit: bool | None = None

    @property
    def checked_run(self) -> Callable[..., Any] | None:
        """What ``--check`` runs instead of the final graph's fx module: None for eager."""
        return None if self.backend == "eager" else self.run

    @property
    def tolerance(self) -> Tolerance | None:
        """How ``--check`` compares it: within :class:`Tolerance` when Inductor compiled it (fused
        kernels round differently), else like the eager graph (the same kernels run)."""
        return Tolerance() if self.backend.startswith("inductor") else None

    def cache_note(self) -> str:
        """What a compile's log line adds about torch's caches: that they answered, that only
        Inductor's did (the step was traced again), and why AOTAutograd's skipped the step if it
        did (a restart then traces it again)."""
        note = " (Inductor's cache)" if self.cache_hit else ""
        if self.cache_hit and not self.aot_cache_hit and not self.cache_bypass:
            note = " (Inductor's FX graph cache; AOTAutograd's missed, so the step was traced again)"
        if self.cache_bypass:
            note += f"; AOTAutograd's cache skipped it ({self.cache_bypass}), so every start traces the step again"
        return note

    def describe(self) -> dict[str, Any]:
        """What the run summary records about the backend."""
        return {"backend": self.backend, "compile_seconds": round(self.compile_seconds, 3),
                "compile_cache_hit": self.cache_hit, "compile_aot_cache_hit": self.aot_cache_hit,
                "compile_cache_bypass": self.cache_bypass}  # fmt: skip


def records_cuda_graphs(backend: str) -> bool:
    """Whether ``backend`` replays the step as a CUDA graph: the step is then captured for it
    (``capture(..., graphed=True)``: a stock optimizer's capturable form, its step counts and
    learning rate on the device; :mod:`mutwo.runtime.capture.optim`)."""
    return backend.endswith("cudagraphs")


def check_backend(name: str) -> str:
    """``name`` if it is a backend, else :class:`BackendError` naming the choices."""
    if name not in BACKENDS:
        raise BackendError(f"unknown backend '{name}'; choose one of {', '.join(BACKENDS)}")
    return name


#: Inductor's C++ builder imports torch.utils.cpp_extension, which warns once per process, on a
#: machine with a CUDA toolkit but no GPU, "No CUDA runtime is found, using CUDA_HOME=...": nothing a
#: user compiling for the CPU can act on, and the line that broke mutwo-opt's one-line errors.
CPP_EXTENSION_LOGGER = "torch.utils.cpp_extension"


def compile_step(module: fx.GraphModule, inputs: Sequence[torch.Tensor], backend: str, graph: Graph) -> CompiledStep:
    """Make ``module`` (``graph``, a whole iteration, lowered by ``to_fx``; inputs in slot order)
    runnable by ``backend``.

    ``inputs`` are example inputs: Inductor reads their shapes, strides and devices only, and a
    CUDA graph is recorded on the first call, not here. Parameters, buffers and optimizer state
    are updated in place at fixed addresses; the other inputs (batch, learning rates) are copied
    into a CUDA graph's static inputs every call.
    """
    check_backend(backend)
    slots = [(p.kind, p.label) for p in graph.placeholders]
    if backend == "eager":
        return CompiledStep(backend, module)
    replays = [node.name for node in module.graph.nodes if node.target is rng_state]
    if replays:
        raise BackendError(f"the {backend} backend cannot run a plan that replays random ops from a saved generator "
                           f"state ({len(replays)}, e.g. {replays[0]}): plan for it (optimize(..., backend=...) and "
                           "mutwo-opt --backend tell select so) or use --backend eager")  # fmt: skip
    swaps = any(node.target in SWAP_OPS for node in module.graph.nodes)
    communicates = has_collectives(graph)
    started = time.perf_counter()
    run: Callable[..., Any] = module
    cache_hit = aot_hit = bypass = None
    graphed = records_cuda_graphs(backend)
    if graphed:
        refuse_uncapturable(graph, inputs)
    with one_recompile(module):
        if backend.startswith("inductor"):
            draw_as_eager(module, graph, inputs, backend)
            functionalizable_host_calls(module)
            single_tensor_concatenations(module, graph)
            compiled_swap_ops(module)
            if communicates:
                functional_collectives(module, graph)
        if graphed and swaps:
            insert_release_points(module, graph)
    if backend.startswith("inductor"):
        mark_phases(module, graph)
        run, cache_hit, aot_hit, bypass = compile_inductor(module, inputs, swaps=swaps, communicates=communicates)
    if graphed:
        run = CudaGraphRunner(run, [kind in STATE_KINDS for kind, _ in slots], [label for _, label in slots])
    return CompiledStep(backend, run, time.perf_counter() - started, cache_hit, bypass, aot_hit)


@contextmanager
def one_recompile(module: fx.GraphModule) -> Iterator[None]:
    """Regenerate ``module``'s Python code once, after the rewrites in the body, however many of them
    ask for it. Each rewrite recompiles the module it changed, so that it runs as rewritten when
    called alone; in a row, all but the last regeneration are wasted, and each of a whole-iteration
    graph costs 0.15-0.2 s (BERT-base b64 on the H100's host, three of them in a restart's 11.2 s)."""
    asked = False

    def note_recompile() -> None:
        nonlocal asked
        asked = True

    module.recompile = note_recompile  # type: ignore[method-assign]  # an instance attribute, deleted below
    try:
        yield
    finally:
        del module.recompile
        if asked:
            module.recompile()


def functionalizable_host_calls(module: fx.GraphModule) -> None:
    """Rewrite each ``mutwo::host_call_one_(x, ...)`` of a traced torch.optim step in ``module``
    into ``mutwo::host_call_([x], ...)``, its uses reading ``x``: the same call, writing the same
    tensor. AOTAutograd functionalizes a custom op that writes its inputs and returns nothing
    (``auto_functionalized``), but refuses one whose output aliases an input (``-> Tensor(a!)``)."""
    rewritten = False
    for node in list(module.graph.nodes):
        if node.target is torch.ops.mutwo.host_call_one_.default:
            written, *rest = node.args
            with module.graph.inserting_before(node):
                call = module.graph.call_function(torch.ops.mutwo.host_call_.default, ([written], *rest))
            call.meta = dict(node.meta)
            node.replace_all_uses_with(written)
            module.graph.erase_node(node)
            rewritten = True
    if rewritten:
        module.recompile()


def compile_graph(graph: Graph, inputs: Sequence[torch.Tensor], backend: str) -> CompiledStep:
    """:func:`compile_step` for an IR graph."""
    return compile_step(to_fx(graph), inputs, backend, graph)


def compile_inductor(module: fx.GraphModule, inputs: Sequence[torch.Tensor], *, swaps: bool = False,
                     communicates: bool = False) -> tuple[Callable[..., Any], bool, bool, str | None]:  # fmt: skip
    """``module`` compiled by Inductor with :data:`INDUCTOR_OPTIONS` and :func:`batch_norm_elemt_decomposed`;
    whether torch's compile caches (AOTAutograd's and Inductor's FX graph cache, on disk under
    ``TORCHINDUCTOR_CACHE_DIR``) supplied the compiled code: a second compile of the same graph, in
    any process, hits them; whether AOTAutograd's did (where only Inductor's did, the step was
    traced again); and why AOTAutograd's cache skipped it, if it did.

    In a graph that ``swaps``, Inductor does not reuse the buffers offloads read
    (:func:`~mutwo.runtime.execution.swap_inductor.offloaded_buffers_kept_from_reuse`); in one that
    ``communicates`` (a data-parallel step), its collectives keep the plan's order
    (:func:`~mutwo.runtime.execution.compiled_collectives.order_kept_options`)."""
    from torch._dynamo.utils import counters
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    def cache_hits() -> tuple[int, int]:
        return counters["inductor"]["fxgraph_cache_hit"], counters["aot_autograd"]["autograd_cache_hit"]

    hits = cache_hits()
    # Fake inputs from a mode with a shape environment, as Dynamo hands them: without one the FX
    # graph cache is bypassed ("No shape env"). Static shapes: the step is captured for one shape.
    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    fakes = [fake_mode.from_tensor(t, static_shapes=True) for t in inputs]
    on_gpu = CUDA_INDUCTOR_OPTIONS if any(t.is_cuda for t in inputs) else {}
    in_order = order_kept_options() if communicates else {}
    swapping = offloaded_buffers_kept_from_reuse() if swaps else nullcontext()
    try:
        rules = phases_arrived(STORED_RULE_VERSION + (f"+{SWAP_RULE_VERSION}" if swaps else ""))
        # mutwo's replay functions into AOTAutograd's cache, which otherwise bypasses their graphs
        cacheable = {**config.unsafe_marked_cacheable_functions, **replay_cache_keys()}
        with config.patch({**INDUCTOR_OPTIONS, **on_gpu, **in_order, **pre_grad_passes_skipped(),
                           "post_grad_custom_post_pass": rules,
                           "unsafe_marked_cacheable_functions": cacheable}), swapping, \
                phase_bounded_fusion(), kernel_per_node(), kept_values_stored(), batch_norm_elemt_decomposed(), \
                torch.no_grad(), quiet_torch_errors(), quiet_loggers(CPP_EXTENSION_LOGGER), noting_bypass() as bypasses:
            compiled = compile_fx(module, fakes)
    except torch.OutOfMemoryError:  # autotuning ran out: not the compiler's failure (the caller notes its stage)
        raise
    except Exception as error:  # Inductor raises many types; the user gets one line, not its traceback
        inner = _out_of_memory_within(error)
        if inner is not None:  # wrapped by Inductor (InductorError): the out-of-memory error it is
            raise inner from None
        raise CompileError(f"Inductor could not compile the step ({compile_failure_summary(error)}); "
                           "run it with --backend eager") from (error if debug_enabled() else None)  # fmt: skip
    fx_hits, aot_hits = (after - before for after, before in zip(cache_hits(), hits, strict=True))
    return compiled, fx_hits + aot_hits > 0, aot_hits > 0, (bypasses[0] if bypasses else None)


def compile_failure_summary(error: BaseException) -> str:
    """One line on why Inductor failed: the error's type and first line, and for an error that
    says nothing (a bare ``assert`` inside torch) the type of the error Inductor wrapped and the
    file, line and function that raised it, so the report can name the failing check."""
    first = (str(error).strip().splitlines() or [""])[0]
    if first and not first.endswith(":"):  # it says something ("InductorError: AssertionError:" does not)
        return f"{type(error).__name__}: {first}"
    inner = getattr(error, "inner_exception", None) or error.__cause__ or error
    inner_first = (str(inner).strip().splitlines() or [""])[0]
    frames = traceback.extract_tb(inner.__traceback__)
    last = frames[-1] if frames else None
    where = f" raised at {_torch_relative(last.filename)}:{last.lineno} in {last.name}" if last else ""
    return f"{type(error).__name__}: {type(inner).__name__}{': ' + inner_first if inner_first else ''}{where}"


def _torch_relative(filename: str) -> str:
    """``filename`` from its ``torch/`` folder on (where the file is torch's), for a shorter line."""
    marker = f"{os.sep}torch{os.sep}"
    return filename[filename.rindex(marker) + 1:] if marker in filename else filename


def pre_grad_passes_skipped() -> dict[str, Any]:
    """Inductor's option that skips its pre-grad passes, where this torch has it and no pre-grad pass
    of the user's is registered (``pre_grad_custom_pass``, which runs among them).

    Why: those passes rewrite the Torch-IR graphs Dynamo makes (``torch.cat``, ``nn.functional``
    calls, eval-mode conv-bn); a step captured by mutwo is aten ops already, which they leave as
    they are (tests/test_backends.py checks it on captured steps) while regenerating the whole
    iteration's code three times: 0.8 s of a BERT-base b64 restart's 11.2 s on the H100's host,
    before AOTAutograd's cache is looked up."""
    from torch._inductor import config

    if not hasattr(config, "use_pre_grad_passes") or getattr(config, "pre_grad_custom_pass", None) is not None:
        return {}
    return {"use_pre_grad_passes": False}


def _out_of_memory_within(error: BaseException) -> torch.OutOfMemoryError | None:
    """The ``torch.OutOfMemoryError`` an exception wraps (Inductor's ``InductorError`` keeps it as
    ``inner_exception``; others as their cause or context), or None."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, torch.OutOfMemoryError):
            return current
        seen.add(id(current))
        current = getattr(current, "inner_exception", None) or current.__cause__ or current.__context__
    return None
