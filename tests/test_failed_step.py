"""A step that fails leaves nothing half done (runtime/execution/failure.py).

A failure is injected into the running graph: a node that raises ``torch.OutOfMemoryError`` once,
placed right after a chosen node of the eager backend's module, at points through every phase —
the forward (batch-norm statistics already written), the backward, the optimizer step (step
counts written first, then parameters), inside the backward where optimizer-in-backward scheduled
the updates, and the middle micro-batch of gradient accumulation. Each time the step keeps its
promise: either the parameters, buffers and optimizer state are bitwise what they were before the
call and training goes on as if the batch had been skipped, or every later call refuses in one
sentence. The caller gets the exception that was raised, with its type.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from mutwo.ir.graph import Graph
from mutwo.ir.node import Node, NodeKind, Phase
from mutwo.ir.to_fx import NODE_ID_META
from mutwo.runtime.api import InconsistentStateError, MutwoStep, optimize
from mutwo.runtime.execution import failure
from mutwo.runtime.execution import step as step_module
from mutwo.runtime.execution.backends import CompiledStep
from mutwo.runtime.execution.step import GraphStep
from mutwo.runtime.measurement.out_of_memory import NOTE_PREFIX
from tests import models
from tests.test_optim import bitwise_equal

OPTIMIZER_IN_BACKWARD = "optimizer-in-backward{when=always,group_bytes=1KiB}"


def _adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2, weight_decay=1e-3)


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _step(make_optimizer: Callable[[Any], torch.optim.Optimizer] = _adam, passes: str = "stats",
          **options: Any) -> tuple[models.Workload, torch.optim.Optimizer, MutwoStep]:  # fmt: skip
    """The test CNN (two batch norms) with its optimizer and training step."""
    workload = models.cnn(batch_size=4)
    optimizer = make_optimizer(workload.model.parameters())
    return workload, optimizer, optimize(workload.model, optimizer, workload.batch, workload.loss_fn, passes=passes,
                                         **options)  # fmt: skip


def _batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    return [(torch.randn(4, 3, 16, 16, generator=generator), torch.randint(0, 10, (4,), generator=generator))
            for _ in range(count)]  # fmt: skip


def _trained(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[Any]:
    """Copies of every parameter and optimizer state value, in a fixed order."""
    values: list[Any] = list(model.parameters())
    for param in model.parameters():
        values += [value for _, value in sorted(optimizer.state[param].items())]
    return [value.detach().clone() if isinstance(value, torch.Tensor) else value for value in values]


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[Any]:
    """Copies of every buffer, parameter and optimizer state value, in a fixed order."""
    return [buffer.clone() for buffer in model.buffers()] + _trained(model, optimizer)


def _same(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(bitwise_equal(x, y) if isinstance(x, torch.Tensor) else x == y
                                    for x, y in zip(a, b, strict=True))  # fmt: skip


def _graph_step(step: MutwoStep, batch: Any) -> GraphStep:
    graph_step, _ = step.prepare(batch)
    return graph_step


def _computed(graph: Graph, phase: Phase) -> list[Node]:
    return [node for node in graph if node.op == "call_function" and node.phase is phase]


def _inject_after(graph_step: GraphStep, node: Node) -> None:
    """Make the eager step raise ``torch.OutOfMemoryError`` once, right after ``node`` ran."""
    fired: list[bool] = []

    def injected_failure() -> None:
        if not fired:
            fired.append(True)
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    module = graph_step.graph_module
    target = next(n for n in module.graph.nodes if n.meta.get(NODE_ID_META) == node.id)
    with module.graph.inserting_after(target):
        module.graph.call_function(injected_failure)
    module.recompile()


def _fail(step: MutwoStep, batch: Any) -> torch.OutOfMemoryError:
    """Call the step, which must raise ``torch.OutOfMemoryError`` itself (not a subclass or a wrapper)."""
    with pytest.raises(torch.OutOfMemoryError) as raised:
        step(batch)
    assert type(raised.value) is torch.OutOfMemoryError
    assert str(raised.value) == "CUDA out of memory (injected)"
    return raised.value


def _state_notes(error: BaseException) -> list[str]:
    """The notes on ``error`` about the state it left, besides the one every out-of-memory error
    gets (the stage it happened in, what was held: :mod:`mutwo.runtime.measurement.out_of_memory`)."""
    notes = getattr(error, "__notes__", [])
    assert sum(note.startswith(NOTE_PREFIX) for note in notes) == isinstance(error, torch.OutOfMemoryError), notes
    return [note for note in notes if not note.startswith(NOTE_PREFIX)]


#: Where the out-of-memory note of an eager step says it failed, by the phase of the node it failed after.
PHASE_WORDS = {Phase.FORWARD: "in the forward", Phase.BACKWARD: "in the backward",
               Phase.OPTIMIZER: "in the optimizer step"}  # fmt: skip


def _refuses(step: MutwoStep, batch: Any, failed: str = "OutOfMemoryError: CUDA out of memory (injected)") -> str:
    """The one sentence every later call raises, naming what ``failed``."""
    for _ in range(2):
        with pytest.raises(InconsistentStateError) as raised:
            step(batch)
    message = str(raised.value)
    assert "\n" not in message and "load the model's and optimizer's state_dict" in message, message
    assert failed in message and "mutwo.optimize again" in message
    return message


#: Where the sweep injects: a phase and a fraction of the way through its nodes.
POINTS = [(phase, fraction) for phase in Phase for fraction in (0.0, 0.34, 0.67, 1.0)]


def test_a_failure_anywhere_is_undone_or_refused() -> None:
    """Through every phase of an Adam step on a CNN with batch norms: a failure in the forward or
    the backward leaves the state bitwise as before (the batch norms' statistics put back) and
    training goes on; one after the optimizer began updating parameters refuses every later call;
    in between, step counts written and no parameter yet, is undone too."""
    batches = _batches(2)
    workload, optimizer, step = _step()
    refused: dict[tuple[Phase, float], bool] = {}
    for phase, fraction in POINTS:
        nodes = _computed(_graph_step(step, batches[0]).graph, phase)
        _inject_after(_graph_step(step, batches[0]), nodes[round(fraction * (len(nodes) - 1))])
        before = _state(workload.model, optimizer)
        error = _fail(step, batches[0])
        assert f"{NOTE_PREFIX} in a training step, {PHASE_WORDS[phase]}," in error.__notes__[-1], error.__notes__
        refused[phase, fraction] = step.refusal is not None
        if step.refusal is None:
            assert _same(_state(workload.model, optimizer), before), f"changed by a failure in {phase} at {fraction}"
            assert not _state_notes(error), "an undone failure says nothing of the state"
            assert step.micro_index == 0
            step(batches[1])  # training goes on
        else:
            assert not _same(_state(workload.model, optimizer), before), "refused, yet nothing was written"
            assert "in the optimizer step" in error.__notes__[0] and "refuse to run again" in error.__notes__[0]
            _refuses(step, batches[1])
            workload, optimizer, step = _step()
    assert not any(refused[point] for point in POINTS if point[0] is not Phase.OPTIMIZER), refused
    assert refused[Phase.OPTIMIZER, 1.0], "the last optimizer node runs after every update"
    assert not refused[Phase.OPTIMIZER, 0.0], "the first optimizer node writes a step count, no parameter"


def test_a_skipped_batch_leaves_training_as_if_it_had_never_been_seen() -> None:
    """SGD with momentum: the first call fails at the end of the backward; the steps after it
    train bitwise like a twin that never saw it."""
    batches = _batches(3)
    (mine, my_opt, my_step), (twin, twin_opt, twin_step) = _step(_sgd), _step(_sgd)
    graph_step = _graph_step(my_step, batches[0])
    _inject_after(graph_step, _computed(graph_step.graph, Phase.BACKWARD)[-1])
    before = _state(mine.model, my_opt)
    _fail(my_step, batches[0])
    assert my_step.refusal is None and _same(_state(mine.model, my_opt), before)
    for batch in batches[1:]:
        assert bitwise_equal(my_step(batch), twin_step(batch))
    assert _same(_state(mine.model, my_opt), _state(twin.model, twin_opt))


def _first_parameter_update(graph: Graph) -> Node:
    """The first node that writes a parameter in place (lowering gives it the parameter's kind)."""
    return next(node for node in graph if node.op == "call_function" and node.kind is NodeKind.PARAMETER)


def test_a_failure_after_updates_inside_the_backward_is_refused() -> None:
    """Optimizer-in-backward moves the updates into the backward: a failure in the forward is
    undone; one right after the first parameter's update refuses every later call, saying why."""
    batches = _batches(2)
    workload, optimizer, step = _step(passes=OPTIMIZER_IN_BACKWARD)
    graph_step = _graph_step(step, batches[0])
    update = _first_parameter_update(graph_step.graph)
    after = graph_step.graph.nodes[graph_step.graph.position(update):]
    assert any(node.phase is Phase.BACKWARD for node in after), "no update in the backward: nothing to test"
    _inject_after(graph_step, _computed(graph_step.graph, Phase.FORWARD)[-1])
    before = _state(workload.model, optimizer)
    _fail(step, batches[0])
    assert step.refusal is None and _same(_state(workload.model, optimizer), before)
    _inject_after(graph_step, update)
    error = _fail(step, batches[0])
    assert "in the backward, where optimizer-in-backward scheduled them" in error.__notes__[0]
    assert not _same(_state(workload.model, optimizer), before)
    _refuses(step, batches[1])


def test_restore_undoes_a_failure_after_updates_inside_the_backward() -> None:
    """on_failure="restore": the same failure after the first update inside the backward is undone
    bitwise, and training goes on like a twin that never saw the batch."""
    batches = _batches(3)
    mine, my_opt, my_step = _step(passes=OPTIMIZER_IN_BACKWARD, on_failure="restore")
    twin, twin_opt, twin_step = _step(passes=OPTIMIZER_IN_BACKWARD)
    my_step(batches[0]), twin_step(batches[0])  # Adam's state is not all zeros
    graph_step = _graph_step(my_step, batches[1])
    _inject_after(graph_step, _computed(graph_step.graph, Phase.BACKWARD)[-1])
    before = _state(mine.model, my_opt)
    error = _fail(my_step, batches[1])
    assert my_step.refusal is None and not _state_notes(error)
    assert _same(_state(mine.model, my_opt), before)
    assert bitwise_equal(my_step(batches[2]), twin_step(batches[2]))
    assert _same(_state(mine.model, my_opt), _state(twin.model, twin_opt))


def test_accumulation_keeps_its_cycle_when_a_micro_batch_fails_before_adding_its_gradients() -> None:
    """Three micro-batches per step: the second fails in its forward; the accumulated gradients
    are untouched, the same micro-batch runs again and the step ends like the twin's."""
    batches = _batches(3)
    (mine, my_opt, my_step), (twin, twin_opt, twin_step) = (_step(accumulation_steps=3) for _ in range(2))
    my_step(batches[0]), twin_step(batches[0])
    graph_step = _graph_step(my_step, batches[1])
    assert my_step.micro == "middle"
    _inject_after(graph_step, _computed(graph_step.graph, Phase.FORWARD)[-1])
    before, accumulated = _state(mine.model, my_opt), [t.clone() for t in my_step.accumulated.values()]
    _fail(my_step, batches[1])
    assert my_step.micro_index == 1 and _same(list(my_step.accumulated.values()), accumulated)
    assert _same(_state(mine.model, my_opt), before)
    for batch in batches[1:]:
        assert bitwise_equal(my_step(batch), twin_step(batch))
    assert _same(_state(mine.model, my_opt), _state(twin.model, twin_opt))


def test_accumulation_starts_a_new_cycle_when_a_micro_batch_fails_after_adding_its_gradients() -> None:
    """The second micro-batch fails after it added its gradients to the accumulated ones: those are
    dropped, the error says so, the next call starts a new cycle; parameters and optimizer state
    are as before, and the next full cycle trains them like the twin's."""
    batches = _batches(4)
    (mine, my_opt, my_step), (twin, twin_opt, twin_step) = (_step(accumulation_steps=3) for _ in range(2))
    my_step(batches[0])
    graph_step = _graph_step(my_step, batches[1])
    _inject_after(graph_step, list(graph_step.graph)[-2])  # the last node before the output
    before = _state(mine.model, my_opt)
    error = _fail(my_step, batches[1])
    assert my_step.refusal is None and my_step.micro_index == 0 and not my_step.accumulated
    assert "new accumulation cycle" in error.__notes__[0] and "the 1 micro-batch before it" in error.__notes__[0]
    assert _same(_state(mine.model, my_opt), before)
    for batch in batches[1:]:
        assert bitwise_equal(my_step(batch), twin_step(batch))
    # The batch norms' statistics saw the first micro-batch here and not in the twin; the rest agree.
    assert my_opt.state[next(mine.model.parameters())]["step"] == 1
    assert _same(_trained(mine.model, my_opt), _trained(twin.model, twin_opt))


def test_a_failure_whose_state_cannot_be_put_back_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """When putting the saved state back fails too (a device that broke), the step cannot say the
    state is as before: later calls are refused, naming the error the caller got."""
    batches = _batches(2)
    _, _, step = _step()
    graph_step = _graph_step(step, batches[0])
    _inject_after(graph_step, _computed(graph_step.graph, Phase.FORWARD)[-1])

    def broken(copies: Any, flat: Any) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(failure._Copies, "restore", broken)
    with pytest.raises(RuntimeError, match="illegal memory access") as raised:
        step(batches[0])
    assert isinstance(raised.value.__context__, torch.OutOfMemoryError)
    monkeypatch.undo()
    assert "putting back what it had written failed too" in _refuses(step, batches[1], "RuntimeError: CUDA error")


@pytest.fixture
def uncompiled_inductor(monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend that compiles (it does not say how far a failed step ran), without Inductor's
    minutes on the CPU: its "compiled" step is the graph's fx module, run unmarked."""
    monkeypatch.setattr(step_module, "compile_step",
                        lambda module, flat, backend, graph: CompiledStep(backend, step_module.to_fx(graph)))


def _fail_after_running(graph_step: GraphStep) -> None:
    """Make the compiled step run the whole iteration, then raise ``torch.OutOfMemoryError`` once."""
    assert graph_step.compiled is not None
    run, fired = graph_step.compiled.run, []

    def failing(*flat: torch.Tensor) -> Any:
        result = run(*flat)
        if not fired:
            fired.append(True)
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return result

    graph_step.compiled.run = failing


@pytest.mark.usefixtures("uncompiled_inductor")
def test_a_compiled_step_that_fails_is_refused() -> None:
    """A compiled step does not tell how far it ran: a failure in a graph that updates parameters
    is refused, and the note says why."""
    batches = _batches(2)
    _, _, step = _step(backend="inductor")
    _fail_after_running(_graph_step(step, batches[0]))
    error = _fail(step, batches[0])
    assert "inside the inductor backend's compiled iteration, which does not tell how far it ran" in error.__notes__[0]
    _refuses(step, batches[1])


@pytest.mark.usefixtures("uncompiled_inductor")
def test_restore_undoes_a_compiled_step_that_failed_after_it_ran_whole() -> None:
    batches = _batches(2)
    workload, optimizer, step = _step(backend="inductor", on_failure="restore")
    step(batches[0])
    _fail_after_running(_graph_step(step, batches[1]))
    before = _state(workload.model, optimizer)
    _fail(step, batches[1])
    assert step.refusal is None and _same(_state(workload.model, optimizer), before)
    step(batches[1])


def test_the_guard_knows_every_state_input_a_step_writes() -> None:
    """What the graph analysis says a step writes covers what it does write, for optimizers that
    create state in the step (SGD's momentum), write step counts (Adam), keep a grad scaler's
    state and clip, and add to accumulated gradients: every guarded input whose bits changed over
    a run is one the guard saves or knows it writes."""
    setups: list[tuple[Callable[[Any], torch.optim.Optimizer], dict[str, Any]]] = [
        (_sgd, {}),
        (_adam, {"passes": OPTIMIZER_IN_BACKWARD}),
        (lambda p: torch.optim.AdamW(p, foreach=True),
         {"grad_scaler": torch.amp.GradScaler("cpu"), "max_grad_norm": 1.0}),
        (lambda p: torch.optim.RMSprop(p, momentum=0.9, centered=True), {"accumulation_steps": 3}),
        (lambda p: torch.optim.Adagrad(p, lr_decay=1e-2), {}),
    ]  # fmt: skip
    for make, options in setups:
        workload, _, step = _step(make, **options)
        for batch in _batches(4):
            graph_step, flat = step.prepare(batch)
            guard = graph_step.failure_guard
            known = {slot for slots in guard.slots.values() for slot in slots}
            unguarded = graph_step.binding.fresh_labels()
            before = [t.clone() for t in flat]
            step(batch)
            for slot, (node, old, new) in enumerate(zip(graph_step.graph.placeholders, before, flat, strict=True)):
                if node.kind in (NodeKind.PARAMETER, NodeKind.BUFFER, NodeKind.OPTIMIZER_STATE) \
                        and not bitwise_equal(old, new):  # fmt: skip
                    assert slot in known or node.label in unguarded, f"{make}, {options}: {node.label} written unseen"


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["eager", "cudagraphs"])
def test_a_failed_step_on_the_gpu_is_undone_or_refused(backend: str) -> None:
    """On CUDA, where the copies are queued on the step's stream: an eager step that fails at the
    end of its backward is undone (its batch norms' statistics copied back on the device); a CUDA
    graph's replay that ran whole and then failed is refused, and undone from page-locked host
    copies with on_failure="restore"; training goes on after each undone failure."""
    from mutwo.runtime.execution.cuda_graphs import graphable_optimizer

    batches = [tuple(t.cuda() for t in batch) for batch in _batches(3)]
    for on_failure in ("refuse", "restore"):
        workload = models.cnn(batch_size=4)
        workload.model.cuda()
        workload.batch = tuple(t.cuda() for t in workload.batch)
        optimizer = torch.optim.Adam(workload.model.parameters(), lr=1e-2, capturable=True)
        graphable_optimizer(optimizer, torch.device("cuda"))
        step = optimize(workload.model, optimizer, workload.batch, workload.loss_fn, passes="stats",
                        backend=backend, on_failure=on_failure)  # fmt: skip
        step(batches[0])
        graph_step = _graph_step(step, batches[1])
        if backend == "eager":
            phase = Phase.BACKWARD if on_failure == "refuse" else Phase.OPTIMIZER
            _inject_after(graph_step, _computed(graph_step.graph, phase)[-1])
        else:
            _fail_after_running(graph_step)
        before = _state(workload.model, optimizer)
        _fail(step, batches[1])
        torch.cuda.synchronize()
        if backend == "cudagraphs" and on_failure == "refuse":
            _refuses(step, batches[2])
            continue
        assert step.refusal is None and _same(_state(workload.model, optimizer), before), on_failure
        step(batches[2])


@pytest.mark.cuda
def test_a_real_out_of_memory_error_is_undone() -> None:
    """A batch too large for the memory the process may hold (capped with
    ``torch.cuda.set_per_process_memory_fraction`` above the step's inputs and below its peak)
    runs out of memory for real in the eager step's forward or backward: the caller catches
    ``torch.OutOfMemoryError`` itself, the state is bitwise as before, and training goes on."""
    workload = models.cnn(batch_size=4)
    workload.model.cuda()
    workload.batch = tuple(t.cuda() for t in workload.batch)
    optimizer = torch.optim.Adam(workload.model.parameters(), lr=1e-2, capturable=True)
    step = optimize(workload.model, optimizer, workload.batch, workload.loss_fn, passes="stats", backend="eager")
    step(workload.batch)
    large = (torch.randn(256, 3, 128, 128, device="cuda"), torch.randint(0, 10, (256,), device="cuda"))
    first_activation = 256 * 8 * 128 * 128 * 4  # the first convolution's output, 128 MiB
    before = _state(workload.model, optimizer)
    torch.cuda.empty_cache()
    cap = torch.cuda.memory_allocated() + 2 * first_activation
    torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.get_device_properties(0).total_memory)
    try:
        with pytest.raises(torch.OutOfMemoryError) as raised:
            step(large)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert type(raised.value) is torch.OutOfMemoryError and not _state_notes(raised.value)
    assert "reserved on cuda:0, capped at" in raised.value.__notes__[-1], raised.value.__notes__
    assert step.last is not None and step.last.step is not None
    assert step.last.step.failure_guard.failure is not None, "it ran out of memory before the step ran"
    assert step.refusal is None and _same(_state(workload.model, optimizer), before)
    step(workload.batch)


def test_on_failure_names_its_choices() -> None:
    workload = models.cnn()
    with pytest.raises(ValueError, match="on_failure must be one of refuse, restore, not 'retry'"):
        optimize(workload.model, _adam(workload.model.parameters()), workload.batch, workload.loss_fn,
                 on_failure="retry")  # fmt: skip
