"""AOTAutograd's cache key handed over from an earlier compile (runtime/execution/aot_key_reuse.py):
a second process compiling the same step loads it from torch's caches without AOTAutograd computing
its key, and runs it bitwise as the first compiled it; anything torch's key reads changing changes
mutwo's key; where no key can be made nothing is reused; a reused key whose entry left torch's
cache compiles again and stores the entry under it.

Each compile of the tiny MLP's step by Inductor on the CPU takes 10-25 s on a 2-core machine."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch._inductor import config as inductor_config

from mutwo.ir.to_fx import to_fx
from mutwo.runtime.execution import aot_key_reuse
from mutwo.runtime.execution.aot_key_reuse import index_folder, mutwo_key
from mutwo.runtime.execution.backends import CompiledStep, compile_graph
from mutwo.runtime.planning.captured import CapturedGraph, capture_graph
from tests import models

REPO = Path(__file__).resolve().parent.parent

#: One process: capture the MLP's step, compile it with Inductor, run it once from seed 0 on the
#: captured inputs, and save the outputs with how the compile went.
COMPILE = textwrap.dedent("""
    import sys
    import torch
    from tests.test_aot_key_reuse import compiled_once
    outputs, compiled = compiled_once()
    torch.save({"outputs": outputs, "described": compiled.describe()}, sys.argv[1])
""")


def _captured() -> CapturedGraph:
    work = models.mlp(batch_size=8)
    return capture_graph(work.model, torch.optim.SGD(work.model.parameters(), lr=0.1, momentum=0.9), work.batch,
                         work.loss_fn)  # fmt: skip


def compiled_once() -> tuple[list[torch.Tensor], CompiledStep]:
    """The MLP's step compiled by Inductor and run once, from seed 0, on copies of its inputs."""
    lowered = _captured()
    compiled = compile_graph(lowered.graph, lowered.inputs, "inductor")
    inputs = [t.clone() for t in lowered.inputs]
    torch.manual_seed(0)
    with torch.no_grad():
        outputs = compiled.run(*inputs)
    return [t.detach().clone() for t in [*outputs, *inputs] if isinstance(t, torch.Tensor)], compiled


@pytest.fixture
def key_computations(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many times AOTAutograd computed a cache key since the test began."""
    import torch._functorch._aot_autograd.autograd_cache as cache

    calls: list[int] = []
    real = cache.autograd_cache_key

    def counted(*args: object, **kwargs: object) -> tuple[str, list[str]]:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(cache, "autograd_cache_key", counted)
    return calls


def test_a_second_process_is_handed_the_key_and_runs_bitwise_as_the_first(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, key_computations: list[int]) -> None:  # fmt: skip
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "torch"))
    first_outputs, first = compiled_once()
    assert key_computations == [1] and first.cache_key_reused is False and not first.cache_hit
    assert first.cache_key_unmade is None
    [recorded] = list(index_folder().iterdir())
    assert recorded.read_text().startswith("a")  # AOTAutograd's keys begin with its prefix

    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "torch")}
    done = subprocess.run([sys.executable, "-c", COMPILE, str(tmp_path / "second.pt")], cwd=REPO, env=env,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    second = torch.load(tmp_path / "second.pt")
    assert second["described"]["compile_cache_key_reused"] is True
    assert second["described"]["compile_cache_hit"] is True
    assert len(second["outputs"]) == len(first_outputs)
    assert all(torch.equal(a, b) for a, b in zip(first_outputs, second["outputs"], strict=True))

    # torch's cache emptied, the recorded key kept: handed over, a miss, compiled and stored under it
    for folder in ("aotautograd", "fxgraph"):
        for path in sorted((tmp_path / "torch" / folder).rglob("*"), reverse=True):
            path.unlink() if path.is_file() else path.rmdir()
    again_outputs, again = compiled_once()
    assert key_computations == [1] and again.cache_key_reused is True and not again.cache_hit
    assert all(torch.equal(a, b) for a, b in zip(first_outputs, again_outputs, strict=True))
    stored_outputs, stored = compiled_once()
    assert key_computations == [1] and stored.cache_key_reused is True and stored.cache_hit
    assert all(torch.equal(a, b) for a, b in zip(first_outputs, stored_outputs, strict=True))


def test_torchs_own_key_is_the_same_whether_or_not_mutwos_is_made(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Making mutwo's key leaves the module's attributes as they were, in their order: torch's key
    pickles them, and reading ``module.code`` (which regenerates a lazy module's code) earlier than
    torch does changed torch's key, so that a restart computing it missed the first start's entry."""
    import torch._functorch._aot_autograd.autograd_cache as cache

    from mutwo.runtime.execution import backends
    from mutwo.runtime.execution.aot_key_reuse import KeyReuse

    lowered = _captured()
    module = to_fx(lowered.graph)
    attributes = list(module.__dict__)
    assert mutwo_key(module, lowered.inputs)[0] is not None
    assert list(module.__dict__) == attributes

    computed: list[str] = []
    real = cache.autograd_cache_key
    monkeypatch.setattr(cache, "autograd_cache_key", lambda *a, **k: computed.append(real(*a, **k)[0]) or
                        (computed[-1], []))  # fmt: skip
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "made"))
    compile_graph(lowered.graph, lowered.inputs, "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "not-made"))
    monkeypatch.setattr(backends, "reused_key", lambda module, inputs: contextlib.nullcontext(KeyReuse(None, "off")))
    compile_graph(lowered.graph, lowered.inputs, "inductor")
    assert len(computed) == 2 and computed[0] == computed[1]


def _key_now(lowered: CapturedGraph) -> str:
    key, reason = mutwo_key(to_fx(lowered.graph), lowered.inputs)
    assert key is not None, reason
    return key


@pytest.mark.parametrize("change", ["inductor option", "custom pass", "matmul precision", "deterministic",
                                    "grad mode", "input layout", "graph"])  # fmt: skip
def test_what_torchs_key_reads_changes_mutwos_key(change: str) -> None:
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class Named(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            pass

        def uuid(self) -> str:
            return "named-pass-1"

    lowered = _captured()
    before = _key_now(lowered)
    assert _key_now(lowered) == before
    changes: dict[str, Callable[[], object]] = {
        "inductor option": lambda: inductor_config.patch(max_fusion_size=inductor_config.max_fusion_size + 1),
        "custom pass": lambda: inductor_config.patch(post_grad_custom_post_pass=Named()),
        "matmul precision": lambda: _set(torch.backends.cuda.matmul, "allow_fp16_reduced_precision_reduction",
                                         not torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction),
        "deterministic": lambda: _deterministic(),
        "grad mode": torch.no_grad,
    }  # fmt: skip
    if change == "input layout":
        kept = lowered.inputs[0]
        lowered.inputs[0] = kept.t().contiguous().t()
        assert _key_now(lowered) != before
        lowered.inputs[0] = kept
    elif change == "graph":
        module = to_fx(lowered.graph)
        module.graph.output_node().prepend(module.graph.call_function(torch.ops.aten.zeros.default, ([1],)))
        module.recompile()
        assert mutwo_key(module, lowered.inputs)[0] != before
    else:
        with changes[change]():  # type: ignore[attr-defined]
            assert _key_now(lowered) != before
    assert _key_now(lowered) == before  # and back


def test_no_key_where_torchs_key_would_read_what_mutwos_cannot(monkeypatch: pytest.MonkeyPatch) -> None:
    lowered = _captured()
    module = to_fx(lowered.graph)
    with inductor_config.patch(post_grad_custom_post_pass=lambda graph: None):
        assert mutwo_key(module, lowered.inputs) == (None, "Inductor's post_grad_custom_post_pass names a pass "
                                                            "without uuid()")  # fmt: skip
    with inductor_config.patch(fx_graph_cache=False):
        assert mutwo_key(module, lowered.inputs) == (None, "torch's compile caches are off")
    monkeypatch.setattr(aot_key_reuse, "_numeric_state", lambda: {"object": object()})
    key, reason = mutwo_key(module, lowered.inputs)
    assert key is None and reason is not None and reason.startswith("an option's text names an object's address")
    monkeypatch.undo()
    module.register_buffer("kept", torch.ones(2))
    module.graph.output_node().prepend(module.graph.get_attr("kept"))
    module.recompile()
    assert mutwo_key(module, lowered.inputs) == (None, "the graph holds a constant (kept), whose value torch's "
                                                        "key hashes")  # fmt: skip


class _set:
    """Set an attribute for the length of a ``with``."""

    def __init__(self, owner: object, name: str, value: object) -> None:
        self.owner, self.name, self.value = owner, name, value

    def __enter__(self) -> None:
        self.before = getattr(self.owner, self.name)
        setattr(self.owner, self.name, self.value)

    def __exit__(self, *exc: object) -> None:
        setattr(self.owner, self.name, self.before)


class _deterministic:
    def __enter__(self) -> None:
        self.before = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(not self.before)

    def __exit__(self, *exc: object) -> None:
        torch.use_deterministic_algorithms(self.before)
