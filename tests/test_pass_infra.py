"""The pass infrastructure: pipeline strings, the registry, typed options, the analysis cache,
the pass manager's instrumentation, and ``mutwo-opt`` end to end on examples/tiny_mlp.yaml."""

from __future__ import annotations

import importlib
import inspect
import json
import sys
import textwrap
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import mutwo.ir.registry as registry_module
from mutwo.ir import from_fx
from mutwo.ir.graph import Graph
from mutwo.ir.node import Node, Phase
from mutwo.ir.pass_base import Pass, PassContext, PassFailure, PassOptionError, option
from mutwo.ir.pass_manager import Instrumentation, PassManager, PipelineFailure
from mutwo.ir.pipeline import PipelineItem, PipelineSyntaxError, parse_pipeline
from mutwo.ir.printer import print_graph
from mutwo.ir.registry import BUILTIN_PASSES, ENTRY_POINT_GROUP, PassRegistry, RegistryError
from mutwo.ir.verifier import VerificationError, verify
from mutwo.runtime.capture.iteration import capture
from mutwo.tools.mutwo_opt import EXIT_FAILURE, EXIT_OK, main

REPO = Path(__file__).resolve().parent.parent
aten = torch.ops.aten


# == the pipeline parser ========================================================================
@pytest.mark.parametrize(("text", "expected"), [
    ("stats", [("stats", {})]),
    ("stats,dce", [("stats", {}), ("dce", {})]),
    (" stats , dce ", [("stats", {}), ("dce", {})]),
    ("stats{}", [("stats", {})]),
    ("select{budget=0.5},rewrite", [("select", {"budget": "0.5"}), ("rewrite", {})]),
    ("p{a=1, b = two },q", [("p", {"a": "1", "b": "two"}), ("q", {})]),
    ("p{path='a,b{c}'},q", [("p", {"path": "a,b{c}"}), ("q", {})]),
    ('p{x="1,2",y=\'it"s\'}', [("p", {"x": "1,2", "y": 'it"s'})]),
    ("p{x=}", [("p", {"x": ""})]),
    ("stats,stats", [("stats", {}), ("stats", {})]),
])  # fmt: skip
def test_parse_pipeline(text: str, expected: list[tuple[str, dict[str, str]]]) -> None:
    assert parse_pipeline(text) == [PipelineItem(name, options) for name, options in expected]


@pytest.mark.parametrize(("text", "words"), [
    ("", ["the pipeline is empty"]),
    ("stats,,dce", ["empty pass name at character 7"]),
    (",stats", ["empty pass name at character 1"]),
    ("{a=1}", ["empty pass name at character 1"]),
    ("stats,", ["ends with a comma"]),
    ("stats{", ["unclosed '{'", "'stats'"]),
    ("stats{a=1", ["unclosed '{'", "'stats'"]),
    ("stats{a=1,", ["unclosed '{'"]),
    ("stats{a='1", ["unclosed quote", "'stats'"]),
    ("stats{a=1,a=2}", ["option 'a'", "'stats'", "given twice"]),
    ("stats{a}", ["must look like {key=value,...}"]),
    ("stats{=1}", ["must look like {key=value,...}"]),
    ("stats{a=1,}", ["must look like {key=value,...}"]),
    ("stats}", ["unexpected '}' after pass 'stats'"]),
    ("stats{a=1}x", ["expected ',' after pass 'stats'"]),
])  # fmt: skip
def test_parse_pipeline_errors(text: str, words: list[str]) -> None:
    with pytest.raises(PipelineSyntaxError) as error:
        parse_pipeline(text)
    for word in words:
        assert word in str(error.value)


def test_text_after_a_quoted_value_is_an_error() -> None:
    with pytest.raises(PipelineSyntaxError):
        parse_pipeline("p{x='a'bc=1}")


# == the registry ===============================================================================
@pytest.mark.parametrize("name", sorted(BUILTIN_PASSES))
def test_builtin_keys_equal_class_names(name: str) -> None:
    module_name, _, class_name = BUILTIN_PASSES[name].partition(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    assert issubclass(cls, Pass)
    assert cls.name == name
    assert PassRegistry().get(name) is cls
    assert cls.summary()  # --list-passes shows it


def test_builtin_passes_are_imported_only_when_used(monkeypatch: pytest.MonkeyPatch) -> None:
    from mutwo import passes

    modules = {name: BUILTIN_PASSES[name].partition(":")[0] for name in ("stats", "dce")}
    for module in modules.values():
        monkeypatch.delitem(sys.modules, module, raising=False)
        monkeypatch.delattr(passes, module.rpartition(".")[2], raising=False)
    registry = PassRegistry()
    assert {"stats", "dce"} <= set(registry.names())
    assert modules["stats"] not in sys.modules and modules["dce"] not in sys.modules
    cls = registry.get("stats")
    assert modules["stats"] in sys.modules
    assert cls is sys.modules[modules["stats"]].StatsPass
    assert modules["dce"] not in sys.modules  # still not imported: nobody asked for it
    registry.get("dce")
    assert modules["dce"] in sys.modules


def test_aliases_expand(monkeypatch: pytest.MonkeyPatch) -> None:
    registry = PassRegistry()
    registry.aliases["tidy"] = ("stats", "dce", "stats")
    passes = registry.build_pipeline("tidy,dce")
    assert [p.name for p in passes] == ["stats", "dce", "stats", "dce"]
    with pytest.raises(RegistryError, match="'tidy' is an alias for stats,dce,stats and takes no options"):
        registry.build_pipeline("tidy{x=1}")
    with pytest.raises(RegistryError, match=r"did you mean 'tidy'\?.*valid passes: .*tidy"):
        registry.build_pipeline("tidu")
    assert "tidy" in registry.describe_all() and "[alias] stats,dce,stats" in registry.describe_all()
    assert "tidy" not in PassRegistry().aliases  # the alias belongs to that registry only


@dataclass(frozen=True)
class ProbePass(Pass):
    """A pass for the registry tests."""

    name = "probe-pass"

    def run(self, graph: Graph, ctx: PassContext) -> None:
        return None


@pytest.mark.parametrize("bad_name", ["", "Probe", "probe_pass", "probe pass", "-probe", "probe-", "1probe", "pro--be"])
def test_register_rejects_names_that_are_not_kebab_case(bad_name: str) -> None:
    cls = type("Bad", (ProbePass,), {"name": bad_name, "__doc__": "bad"})
    with pytest.raises(RegistryError, match="kebab-case"):
        PassRegistry(builtins=False).register(cls)


def test_register_rejects_non_passes() -> None:
    registry = PassRegistry(builtins=False)
    with pytest.raises(RegistryError, match="is not a subclass of mutwo.ir.pass_base.Pass"):
        registry.register(dict)  # type: ignore[arg-type]
    with pytest.raises(RegistryError):
        registry.register(ProbePass())  # type: ignore[arg-type]  # an instance, not a class


def test_register_rejects_duplicate_names() -> None:
    registry = PassRegistry(builtins=False)
    assert registry.register(ProbePass) is ProbePass
    assert registry.register(ProbePass) is ProbePass  # the same class again is fine
    twin = type("Twin", (ProbePass,), {"name": "probe-pass", "__doc__": "twin", "__module__": "elsewhere"})
    with pytest.raises(RegistryError, match="two passes are named 'probe-pass'"):
        registry.register(twin)
    assert registry.get("probe-pass") is ProbePass


def test_register_rejects_a_name_of_a_loaded_builtin() -> None:
    registry = PassRegistry()
    registry.get("dce")
    impostor = type("Impostor", (ProbePass,), {"name": "dce", "__doc__": "impostor"})
    with pytest.raises(RegistryError, match="two passes are named 'dce'"):
        registry.register(impostor)


def test_register_rejects_a_name_of_a_builtin_not_yet_loaded() -> None:
    registry = PassRegistry()
    impostor = type("Impostor", (ProbePass,), {"name": "dce", "__doc__": "impostor"})
    with pytest.raises(RegistryError, match="two passes are named 'dce'"):
        registry.register(impostor)


def test_register_pass_decorator_reaches_every_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    import mutwo

    monkeypatch.setattr(registry_module, "_DECORATED", {})
    decorated = type("Decorated", (ProbePass,), {"name": "decorated-probe", "__doc__": "decorated"})
    assert mutwo.register_pass(decorated) is decorated
    assert PassRegistry().get("decorated-probe") is decorated
    assert [p.name for p in PassRegistry().build_pipeline("stats,decorated-probe")] == ["stats", "decorated-probe"]
    assert "decorated-probe" not in PassRegistry(builtins=False).names()
    impostor = type("Impostor", (ProbePass,), {"name": "select", "__doc__": "impostor"})
    with pytest.raises(RegistryError, match="two passes are named 'select'"):
        mutwo.register_pass(impostor)
    with pytest.raises(RegistryError, match="kebab-case"):
        mutwo.register_pass(type("Bad", (ProbePass,), {"name": "Bad_Name", "__doc__": "bad"}))
    assert set(registry_module._DECORATED) == {"decorated-probe"}


def test_load_a_python_file_registers_its_passes(tmp_path: Path) -> None:
    path = tmp_path / "infra_load_ok.py"
    path.write_text(textwrap.dedent('''\
        from dataclasses import dataclass
        from mutwo.ir.pass_base import Pass
        from mutwo.passes.stats import StatsPass  # imported, not defined here: not registered again

        @dataclass(frozen=True)
        class First(Pass):
            """First pass of the file."""
            name = "first-from-file"
            def run(self, graph, ctx):
                return 1

        @dataclass(frozen=True)
        class Second(Pass):
            """Second pass of the file."""
            name = "second-from-file"
            def run(self, graph, ctx):
                return 2

        @dataclass(frozen=True)
        class Base(Pass):
            """No name: a base class, not a pass."""
        '''))
    registry = PassRegistry()
    assert registry.load(str(path)) == ["first-from-file", "second-from-file"]
    assert {"first-from-file", "second-from-file", "stats", "dce"} <= set(registry.names())
    assert registry.get("second-from-file").summary() == "Second pass of the file."
    assert [p.name for p in registry.build_pipeline("first-from-file,stats")] == ["first-from-file", "stats"]


def test_load_a_module_by_name() -> None:
    registry = PassRegistry(builtins=False)
    assert registry.load("mutwo.passes.dce") == ["dce"]
    assert registry.get("dce").__name__ == "DeadCodeEliminationPass"


def test_load_errors(tmp_path: Path) -> None:
    registry = PassRegistry()
    empty = tmp_path / "infra_no_passes.py"
    empty.write_text("X = 1\n")
    with pytest.raises(RegistryError, match="defines no Pass subclass with a name"):
        registry.load(str(empty))
    with pytest.raises(RegistryError, match="no such file"):
        registry.load(str(tmp_path / "infra_missing.py"))
    broken = tmp_path / "infra_broken.py"
    broken.write_text("def oops(:\n")
    with pytest.raises(RegistryError, match="importing it failed: SyntaxError"):
        registry.load(str(broken))
    with pytest.raises(RegistryError, match="importing it failed: ModuleNotFoundError"):
        registry.load("no_such_package_mutwo.passes")


class FakeEntryPoint:
    def __init__(self, name: str, cls: type[Pass]) -> None:
        self.name = name
        self.cls = cls
        self.loads = 0

    def load(self) -> type[Pass]:
        self.loads += 1
        return self.cls


def _install_entry_points(monkeypatch: pytest.MonkeyPatch, *entries: FakeEntryPoint) -> list[str]:
    groups: list[str] = []

    def fake_entry_points(*, group: str) -> list[FakeEntryPoint]:
        groups.append(group)
        return list(entries) if group == ENTRY_POINT_GROUP else []

    monkeypatch.setattr(registry_module, "entry_points", fake_entry_points)
    return groups


def test_entry_point_passes_are_found_lazily(monkeypatch: pytest.MonkeyPatch) -> None:
    entry = FakeEntryPoint("probe-pass", ProbePass)
    groups = _install_entry_points(monkeypatch, entry)
    registry = PassRegistry()
    assert groups == [ENTRY_POINT_GROUP]
    assert "probe-pass" in registry.names()
    assert entry.loads == 0  # not loaded until used
    assert [p.name for p in registry.build_pipeline("stats,probe-pass")] == ["stats", "probe-pass"]
    assert registry.get("probe-pass") is ProbePass
    assert entry.loads == 1
    assert PassRegistry(builtins=False).names() == []  # a bare registry has no entry points either


def test_entry_point_whose_class_has_another_name(monkeypatch: pytest.MonkeyPatch) -> None:
    _install_entry_points(monkeypatch, FakeEntryPoint("probe", ProbePass))
    with pytest.raises(RegistryError, match="pass registered as 'probe' calls itself 'probe-pass'"):
        PassRegistry().get("probe")


def test_entry_points_do_not_replace_builtins(monkeypatch: pytest.MonkeyPatch) -> None:
    impostor = type("Impostor", (ProbePass,), {"name": "dce", "__doc__": "impostor"})
    _install_entry_points(monkeypatch, FakeEntryPoint("dce", impostor))
    assert PassRegistry().get("dce").__name__ == "DeadCodeEliminationPass"


@dataclass(frozen=True)
class NeedsPlan(Pass):
    """Needs a plan (test pass)."""

    name = "needs-plan"
    requires = ("plan",)

    def run(self, graph: Graph, ctx: PassContext) -> None:
        return None


@dataclass(frozen=True)
class MakesPlan(Pass):
    """Makes a plan (test pass)."""

    name = "makes-plan"
    provides = ("plan",)

    def run(self, graph: Graph, ctx: PassContext) -> None:
        ctx.artifacts["plan"] = "a plan"


def test_requirements_are_checked_before_anything_runs() -> None:
    registry = PassRegistry()
    registry.register(NeedsPlan)
    message = "pass 'needs-plan' needs plan, which no earlier pass provides; run select before it$"
    with pytest.raises(RegistryError, match=message):
        registry.build_pipeline("stats,needs-plan")
    registry.register(MakesPlan)
    with pytest.raises(RegistryError, match="no earlier pass provides; run makes-plan or select before it"):
        registry.build_pipeline("needs-plan,makes-plan")
    assert [p.name for p in registry.build_pipeline("makes-plan,needs-plan")] == ["makes-plan", "needs-plan"]
    assert [p.name for p in registry.build_pipeline("needs-plan", available={"plan"})] == ["needs-plan"]


# == typed options ==============================================================================
@dataclass(frozen=True)
class TypedPass(Pass):
    """Has one option of each supported type (test pass)."""

    name = "typed"
    count: int = option(1, "an int")
    ratio: float = option(0.5, "a float")
    flag: bool = option(False, "a bool")
    label: str = option("x", "a str")
    limit: int | None = option(None, "an optional int")

    def __post_init__(self) -> None:
        if self.count < 0:
            raise ValueError("count must not be negative")

    def run(self, graph: Graph, ctx: PassContext) -> None:
        return None


@pytest.mark.parametrize(("raw", "field", "value"), [
    ({"count": "3"}, "count", 3),
    ({"count": " 12 "}, "count", 12),
    ({"ratio": "0.25"}, "ratio", 0.25),
    ({"ratio": "1e-3"}, "ratio", 1e-3),
    ({"ratio": "2"}, "ratio", 2.0),
    ({"flag": "true"}, "flag", True),
    ({"flag": "Yes"}, "flag", True),
    ({"flag": "1"}, "flag", True),
    ({"flag": "on"}, "flag", True),
    ({"flag": "FALSE"}, "flag", False),
    ({"flag": "0"}, "flag", False),
    ({"flag": "off"}, "flag", False),
    ({"label": "two words"}, "label", "two words"),
    ({"limit": "7"}, "limit", 7),
    ({"limit": "none"}, "limit", None),
    ({"limit": "null"}, "limit", None),
    ({"limit": ""}, "limit", None),
])  # fmt: skip
def test_typed_options(raw: dict[str, str], field: str, value: Any) -> None:
    instance = TypedPass.from_options(raw)
    got = getattr(instance, field)
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize(("raw", "words"), [
    ({"count": "1.5"}, ["option 'count' must be int", "'1.5'"]),
    ({"count": "many"}, ["option 'count' must be int", "'many'"]),
    ({"ratio": "fast"}, ["option 'ratio' must be float", "'fast'"]),
    ({"flag": "maybe"}, ["option 'flag' must be bool", "'maybe'"]),
    ({"limit": "lots"}, ["option 'limit' must be int | None", "'lots'"]),
    ({"count": "-1"}, ["pass 'typed'", "count must not be negative"]),
    ({"colour": "red"}, ["pass 'typed' has no option 'colour'", "count, flag, label, limit, ratio"]),
])  # fmt: skip
def test_bad_typed_options(raw: dict[str, str], words: list[str]) -> None:
    with pytest.raises(PassOptionError) as error:
        TypedPass.from_options(raw)
    for word in words:
        assert word in str(error.value)


def test_options_through_a_pipeline_and_describe() -> None:
    registry = PassRegistry(builtins=False)
    registry.register(TypedPass)
    (typed,) = registry.build_pipeline("typed{count=2,label='a,b',flag=yes}")
    assert (typed.count, typed.label, typed.flag, typed.ratio) == (2, "a,b", True, 0.5)
    assert typed.describe() == 'typed{count=2,flag=True,label="a,b"}'
    assert TypedPass().describe() == "typed"
    with pytest.raises(RegistryError, match="option 'count' must be int, got 'x'"):
        registry.build_pipeline("typed{count=x}")
    infos = {o.name: (o.type_name, o.default, o.help) for o in TypedPass.options()}
    assert infos.pop("limit")[1:] == (None, "an optional int")  # its type name: see the next test
    assert infos == {"count": ("int", 1, "an int"), "ratio": ("float", 0.5, "a float"),
                     "flag": ("bool", False, "a bool"), "label": ("str", "x", "a str")}  # fmt: skip


def test_optional_option_type_name() -> None:
    assert {o.name: o.type_name for o in TypedPass.options()}["limit"] == "int | None"


# == a small captured graph =====================================================================
class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@pytest.fixture(scope="module")
def captured_graph() -> Graph:
    torch.manual_seed(0)
    model = _Tiny()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = (torch.randn(2, 4), torch.randint(0, 3, (2,)))
    captured, _ = capture(model, optimizer, batch, lambda output, b: F.cross_entropy(output, b[1]))
    graph = from_fx(captured.graph_module, [(s.kind, s.label) for s in captured.slots], captured.gradient_labels)
    verify(graph)
    return graph


@pytest.fixture
def graph(captured_graph: Graph) -> Graph:
    return captured_graph.copy()


def add_dead_node(graph: Graph) -> Node:
    """An unused ``neg`` of the first placeholder, just before the output: valid IR, removable by dce."""
    return graph.create_node("call_function", aten.neg.default, (graph.placeholders[0],), name="dead_neg",
                             phase=Phase.OPTIMIZER, before=graph.output)  # fmt: skip


CALLS: Counter[str] = Counter()


@pytest.fixture(autouse=True)
def _reset_calls() -> None:
    CALLS.clear()


@dataclass(frozen=True)
class NodeCount(Pass):
    """Count the nodes, counting its own runs (test analysis)."""

    name = "node-count"
    only: str = option("", "count only nodes whose op is this")

    def run(self, graph: Graph, ctx: PassContext) -> int:
        CALLS[self.describe()] += 1
        return sum(1 for n in graph if not self.only or n.op == self.only)


@dataclass(frozen=True)
class AskCount(Pass):
    """Ask the cache for node-count and node-count{only=placeholder} (test analysis)."""

    name = "ask-count"

    def run(self, graph: Graph, ctx: PassContext) -> tuple[int, int]:
        answer = (ctx.analysis(graph, NodeCount()), ctx.analysis(graph, NodeCount(only="placeholder")))
        ctx.artifacts.setdefault("answers", []).append(answer)
        return answer


@dataclass(frozen=True)
class AddDeadNode(Pass):
    """Insert an unused node (test transform that preserves nothing)."""

    name = "add-dead-node"
    is_transform = True

    def run(self, graph: Graph, ctx: PassContext) -> int:
        return add_dead_node(graph).id


@dataclass(frozen=True)
class AddDeadNodePreservingCount(AddDeadNode):
    """Insert an unused node, declaring node-count preserved (test transform)."""

    name = "add-dead-node-preserving"
    preserves = ("node-count",)


@dataclass(frozen=True)
class NoopTransform(Pass):
    """A transform that changes nothing (test transform)."""

    name = "noop-transform"
    is_transform = True

    def run(self, graph: Graph, ctx: PassContext) -> None:
        return None


@dataclass(frozen=True)
class Corrupt(Pass):
    """Insert a node before the value it reads (test transform that breaks the IR)."""

    name = "corrupt"
    is_transform = True

    def run(self, graph: Graph, ctx: PassContext) -> None:
        late = [n for n in graph if n.op == "call_function"][-1]
        graph.create_node("call_function", aten.neg.default, (late,), name="too_early", before=graph.nodes[0])


@dataclass(frozen=True)
class SneakyAnalysis(Pass):
    """An analysis that changes the graph (test pass that breaks the contract)."""

    name = "sneaky"

    def run(self, graph: Graph, ctx: PassContext) -> None:
        add_dead_node(graph)


@dataclass(frozen=True)
class Crashes(Pass):
    """Crashes with a plain exception (test pass)."""

    name = "crashes"

    def run(self, graph: Graph, ctx: PassContext) -> None:
        raise KeyError("missing-thing")


def run_pipeline(graph: Graph, *passes: Pass, ctx: PassContext | None = None,
                 **instrumentation: Any) -> tuple[PassContext, Any]:  # fmt: skip
    ctx = ctx or PassContext()
    result = PassManager(list(passes), Instrumentation(**instrumentation)).run(graph, ctx)
    return ctx, result


# == the analysis cache =========================================================================
def test_analysis_is_reused_while_the_graph_is_unchanged(graph: Graph) -> None:
    ctx = PassContext()
    assert ctx.analysis(graph, NodeCount()) == len(graph)
    assert ctx.analysis(graph, NodeCount()) == len(graph)
    assert CALLS == {"node-count": 1}
    assert ctx.analyses.cached("node-count", graph)
    # options are part of the key: a differently configured analysis is computed separately
    assert ctx.analysis(graph, NodeCount(only="placeholder")) == len(graph.placeholders)
    assert CALLS == {"node-count": 1, "node-count{only=placeholder}": 1}


def test_analysis_is_recomputed_after_a_mutation(graph: Graph) -> None:
    ctx = PassContext()
    before = ctx.analysis(graph, NodeCount())
    add_dead_node(graph)
    assert not ctx.analyses.cached("node-count", graph)
    assert ctx.analysis(graph, NodeCount()) == before + 1
    assert CALLS == {"node-count": 2}


def test_pass_manager_reuses_analyses_between_analysis_passes(graph: Graph) -> None:
    ctx, _ = run_pipeline(graph, AskCount(), AskCount(), AskCount())
    n, p = len(graph), len(graph.placeholders)
    assert ctx.artifacts["answers"] == [(n, p)] * 3
    assert CALLS == {"node-count": 1, "node-count{only=placeholder}": 1}


def test_a_transform_drops_what_it_does_not_preserve(graph: Graph) -> None:
    n, p = len(graph), len(graph.placeholders)
    ctx, _ = run_pipeline(graph, AskCount(), AddDeadNode(), AskCount())
    assert ctx.artifacts["answers"] == [(n, p), (n + 1, p)]
    assert CALLS == {"node-count": 2, "node-count{only=placeholder}": 2}


def test_a_transform_keeps_what_it_preserves(graph: Graph) -> None:
    n, p = len(graph), len(graph.placeholders)
    ctx, _ = run_pipeline(graph, AskCount(), AddDeadNodePreservingCount(), AskCount())
    # Both node-count entries are preserved (the key's options do not matter): no recomputation,
    # even though the transform made the first one stale; that is what declaring it preserved means.
    assert ctx.artifacts["answers"] == [(n, p), (n, p)]
    assert CALLS == {"node-count": 1, "node-count{only=placeholder}": 1}
    assert ctx.analyses.cached("node-count", graph)


def test_preserves_keeps_only_the_listed_analyses(graph: Graph) -> None:
    @dataclass(frozen=True)
    class OtherCount(NodeCount):
        """Another analysis (test)."""

        name = "other-count"

    ctx = PassContext()
    ctx.analysis(graph, NodeCount())
    ctx.analysis(graph, OtherCount())
    run_pipeline(graph, AddDeadNodePreservingCount(), ctx=ctx)
    assert ctx.analyses.cached("node-count", graph)
    assert not ctx.analyses.cached("other-count", graph)
    assert ctx.analysis(graph, OtherCount()) == len(graph)
    assert CALLS == {"node-count": 1, "other-count": 2}


def test_a_transform_that_changes_nothing_keeps_every_analysis(graph: Graph) -> None:
    ctx, result = run_pipeline(graph, AskCount(), NoopTransform(), AskCount())
    assert CALLS == {"node-count": 1, "node-count{only=placeholder}": 1}
    assert [r.changed for r in result.records] == [False, False, False]


def test_the_cache_does_not_mix_up_two_graphs(graph: Graph) -> None:
    bigger = graph.copy()
    add_dead_node(bigger)
    first, second = graph.copy(), bigger.copy()
    assert first.version == second.version == 0
    ctx = PassContext()
    assert ctx.analysis(first, NodeCount()) == len(first)
    assert ctx.analysis(second, NodeCount()) == len(second)


# == the pass manager ===========================================================================
def test_verification_after_a_corrupting_pass(graph: Graph) -> None:
    registry = PassRegistry()
    passes = registry.build_pipeline("stats,dce") + [Corrupt()]
    with pytest.raises(PipelineFailure) as error:
        run_pipeline(graph, *passes)
    failure = error.value
    assert failure.pass_name == "corrupt"
    assert failure.pipeline_so_far == ["stats", "dce"]
    assert isinstance(failure.cause, VerificationError)
    assert failure.cause.invariant == "topological-order"
    message = str(failure)
    assert message.startswith("pass 'corrupt' failed after [stats,dce]: invariant 'topological-order' violated")
    assert "\n" not in message  # one line: the CLI prints it as is


def test_without_verification_the_corruption_goes_unnoticed(graph: Graph) -> None:
    _, result = run_pipeline(graph, Corrupt(), verify=False)
    assert [r.name for r in result.records] == ["corrupt"]
    with pytest.raises(VerificationError, match="topological-order"):
        verify(graph)


def _counting_verifies(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The graph versions the pass manager verifies, in order."""
    import mutwo.ir.pass_manager as pass_manager

    versions: list[int] = []
    monkeypatch.setattr(pass_manager, "verify", lambda graph: versions.append(graph.version) or verify(graph))
    return versions


def test_an_analysis_of_a_verified_graph_is_not_verified_again(graph: Graph, monkeypatch: pytest.MonkeyPatch) -> None:
    """Verified after the first pass and after each transform (one that changes nothing too: it may
    change nodes' kinds, which leave the version as it was), not after an analysis of a graph
    verified since its last change."""
    versions = _counting_verifies(monkeypatch)
    stats = PassRegistry().get("stats")
    run_pipeline(graph, stats(), stats(), AddDeadNode(), stats(), NoopTransform(), stats())
    assert len(versions) == 3  # after the first stats, add-dead-node and noop-transform


@dataclass(frozen=True)
class PhaseScribbler(Pass):
    """An analysis of one's own that changes a node's phase, which leaves the version as it was
    (test pass that breaks the contract)."""

    name = "phase-scribbler"

    def run(self, graph: Graph, ctx: PassContext) -> None:
        graph.placeholders[0].phase = Phase.BACKWARD


def test_an_analysis_of_one_s_own_is_verified_after(graph: Graph) -> None:
    """Only mutwo's own analyses are trusted to leave a verified graph as it was."""
    with pytest.raises(PipelineFailure) as error:
        run_pipeline(graph, PassRegistry().get("stats")(), PhaseScribbler())
    assert error.value.pass_name == "phase-scribbler" and isinstance(error.value.cause, VerificationError)


def test_verify_once_verifies_after_the_last_pass_only(graph: Graph, monkeypatch: pytest.MonkeyPatch) -> None:
    """As a plan-cache hit replays a pipeline verified pass by pass before; a corruption is still
    caught at the end, named by the last pass."""
    versions = _counting_verifies(monkeypatch)
    stats = PassRegistry().get("stats")
    run_pipeline(graph.copy(), AddDeadNode(), stats(), AddDeadNode(), NoopTransform(), verify_once=True)
    assert len(versions) == 1
    with pytest.raises(PipelineFailure) as error:
        run_pipeline(graph, Corrupt(), stats(), verify_once=True)
    assert error.value.pass_name == "stats" and isinstance(error.value.cause, VerificationError)


def test_an_analysis_that_changes_the_graph_is_reported(graph: Graph) -> None:
    for verify_ in (True, False):
        with pytest.raises(PipelineFailure) as error:
            run_pipeline(graph.copy(), PassRegistry().get("stats")(), SneakyAnalysis(), verify=verify_)
        assert error.value.pass_name == "sneaky"
        assert str(error.value) == ("pass 'sneaky' failed after [stats]: an analysis pass changed the graph; "
                                    "declare is_transform = True on a pass that changes it")


def test_a_crashing_pass_is_reported_with_its_cause(graph: Graph) -> None:
    with pytest.raises(PipelineFailure) as error:
        run_pipeline(graph, Crashes())
    assert isinstance(error.value.cause, KeyError) and error.value.crashed
    # The exception's type and the line that raised it (this file's, the innermost outside torch and Python).
    lineno = inspect.getsourcelines(Crashes.run)[1] + 1  # the line under ``def run``
    assert str(error.value) == ("pass 'crashes' failed as the first pass: KeyError: 'missing-thing' (raised at "
                                f"{__file__}:{lineno} in run: raise KeyError(\"missing-thing\"))")


def test_a_pass_failure_is_reported_without_a_location(graph: Graph) -> None:
    @dataclass(frozen=True)
    class Refuses(Pass):
        """Refuses (test pass)."""

        name = "refuses"

        def run(self, graph: Graph, ctx: PassContext) -> None:
            raise PassFailure("no plan fits")

    with pytest.raises(PipelineFailure) as error:
        run_pipeline(graph, Refuses())
    assert not error.value.crashed
    assert str(error.value) == "pass 'refuses' failed as the first pass: no plan fits"


def test_a_pass_failure_keeps_its_advice_apart_from_its_reason(graph: Graph) -> None:
    """The message reads as one line, reason then advice; a caller that acts on the failure itself
    reads the reason alone, from the failure or from the pipeline's."""
    failure = PassFailure("no plan fits", advice="ask for more")
    assert (str(failure), failure.reason, failure.advice) == ("no plan fits; ask for more", "no plan fits",
                                                              "ask for more")  # fmt: skip
    assert str(PassFailure("no plan fits")) == "no plan fits" and PassFailure("no plan fits").advice is None

    @dataclass(frozen=True)
    class Advises(Pass):
        """Refuses with advice (test pass)."""

        name = "advises"

        def run(self, graph: Graph, ctx: PassContext) -> None:
            raise failure

    with pytest.raises(PipelineFailure) as error:
        run_pipeline(graph, Advises())
    assert str(error.value) == "pass 'advises' failed as the first pass: no plan fits; ask for more"
    assert error.value.reason == "pass 'advises' failed as the first pass: no plan fits"


def test_print_ir_after_all(graph: Graph, tmp_path: Path) -> None:
    printed: list[str] = []
    passes = [AddDeadNode(), PassRegistry().get("dce")()]
    _, result = run_pipeline(graph, *passes, ctx=PassContext(out_dir=tmp_path), print_ir_after_all=True,
                             printer=printed.append)  # fmt: skip
    dead = result.records[0].result
    # with an output folder the text goes to the files, and each pass prints one line naming its file
    after_add = (tmp_path / "01-add-dead-node-after.ir.txt").read_text()
    assert printed == [f"// ----- IR after add-dead-node: {tmp_path / '01-add-dead-node-after.ir.txt'} "
                       f"({len(graph) + 1} nodes) -----",
                       f"// ----- IR after dce: {tmp_path / '02-dce-after.ir.txt'} ({len(graph)} nodes) -----"]
    assert any(line.startswith(f"%{dead} ") and "aten.neg.default" in line for line in after_add.splitlines())
    assert (tmp_path / "02-dce-after.ir.txt").read_text() == print_graph(graph)
    assert f"%{dead} " not in print_graph(graph)  # dce erased it


def test_print_ir_after_all_without_a_folder_prints_the_text(graph: Graph) -> None:
    printed: list[str] = []
    run_pipeline(graph, AddDeadNode(), PassRegistry().get("dce")(), print_ir_after_all=True,
                 printer=printed.append)  # fmt: skip
    assert len(printed) == 2
    assert printed[0].startswith("// ----- IR after add-dead-node -----\n%")
    assert printed[1] == "// ----- IR after dce -----\n" + print_graph(graph)


def test_print_ir_after_selected_passes(graph: Graph) -> None:
    printed: list[str] = []
    run_pipeline(graph, AddDeadNode(), PassRegistry().get("dce")(), print_ir_after=frozenset({"dce"}),
                 printer=printed.append)  # fmt: skip
    assert printed == ["// ----- IR after dce -----\n" + print_graph(graph)]


def test_nothing_is_printed_by_default(graph: Graph, tmp_path: Path) -> None:
    printed: list[str] = []
    run_pipeline(graph, AddDeadNode(), ctx=PassContext(out_dir=tmp_path), printer=printed.append)
    assert printed == []
    assert [p.name for p in tmp_path.iterdir()] == []


def test_dump_dot(graph: Graph, tmp_path: Path) -> None:
    passes = PassRegistry().build_pipeline("stats,dce")
    run_pipeline(graph, *passes, ctx=PassContext(out_dir=tmp_path), dump_dot=True)
    expected = {f"{stem}-{when}.dot" for stem in ("01-stats", "02-dce") for when in ("before", "after")}
    assert expected <= {p.name for p in tmp_path.iterdir()}
    for name in expected:
        text = (tmp_path / name).read_text()
        assert text.startswith("digraph mutwo")
        when, label = name[:-4].split("-")[2], name[3:].split("-")[0]
        assert f"{when} {label}" in text  # the title
        assert text.count("->") >= len(graph) - len(graph.placeholders)  # every computed node has an edge in


def test_time_passes(graph: Graph) -> None:
    printed: list[str] = []
    _, result = run_pipeline(graph, *PassRegistry().build_pipeline("stats,dce"), time_passes=True,
                             printer=printed.append)  # fmt: skip
    assert len(printed) == 1
    lines = printed[0].splitlines()
    assert lines[0] == "===== pass execution timing ====="
    assert [line.split()[-1] for line in lines[2:]] == ["stats", "dce", "total"]
    assert float(lines[-1].split()[0]) == pytest.approx(sum(r.seconds for r in result.records), abs=1e-3)
    assert list(result.timings()) == ["01-stats", "02-dce"]


# == mutwo-opt end to end =======================================================================
SUMMARY_KEYS = {
    "model", "batch_size", "device", "torch_version", "nodes_before", "nodes_after", "pass_seconds",
    "peak_bytes_before", "peak_bytes_after", "measured_peak_bytes_before", "measured_peak_bytes_after",
    "recomputed", "plan_fingerprint", "equivalent",
}  # fmt: skip


def _expected_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def test_cli_time_passes_times_the_whole_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """--time-passes also times what the pass timing leaves out: the capture, the compile and the
    check; the phases and the rest add up to the total, and summary.json keeps them."""
    monkeypatch.chdir(REPO)
    out = tmp_path / "out"
    code = main(["-q", "--check", "--time-passes", "-p", "stats", "--batch-size", "8", "-o", str(out),
                 "examples/tiny_mlp.yaml"])  # fmt: skip
    stdout = capsys.readouterr().out
    assert code == EXIT_OK
    table = stdout[stdout.index("===== mutwo-opt run timing ====="):].splitlines()
    rows = {line.split(None, 2)[2]: float(line.split()[0]) for line in table[2:]}
    assert {"capture", "passes", "compile", "check", "total"} <= set(rows)
    assert rows["check"] > 0 and rows["capture"] > 0
    assert sum(v for k, v in rows.items() if k != "total") == pytest.approx(rows["total"], abs=1e-3)
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["phase_seconds"]) == {"capture", "plan cache", "passes", "compile", "check", "measure"}
    assert summary["budget"] == "0.9"  # no plan made: the config's


def test_cli_check_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                              capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    monkeypatch.chdir(REPO)
    out = tmp_path / "out"
    code = main(["--check", "-p", "stats,dce", "--batch-size", "8", "-o", str(out), "examples/tiny_mlp.yaml"])
    err = capsys.readouterr().err
    assert code == EXIT_OK, err
    assert "Traceback" not in err
    assert {"summary.json", "input.ir.txt", "final.ir.txt", "final_graph.py", "stats.json"} <= {
        p.name for p in out.iterdir()}  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    # The last line counts what was written and names the main files; summary.json lists them all.
    files = summary["files"]
    assert files == sorted(p.name for p in out.iterdir())
    assert err.splitlines()[-1] == (f"mutwo-opt: wrote {out}/: {len(files)} files: summary.json, final.ir.txt, "
                                    f"final_graph.py and {len(files) - 3} more (listed in summary.json)")
    assert SUMMARY_KEYS <= set(summary)
    assert summary["model"] == "models/tiny.py:mlp"
    assert summary["config"] == "examples/tiny_mlp.yaml"
    assert summary["batch_size"] == 8
    assert summary["device"] == _expected_device()
    assert summary["torch_version"] == torch.__version__
    assert (summary["seed"], summary["precision"], summary["memory_format"]) == (0, "fp32", "contiguous")
    assert summary["budget"] == "0.9"  # the config's
    assert summary["pipeline"] == ["stats", "dce"]
    assert list(summary["pass_seconds"]) == ["01-stats", "02-dce"]
    assert all(s >= 0 for s in summary["pass_seconds"].values())
    for key in ("nodes_before", "nodes_after"):
        by_phase = summary[key]["by_phase"]
        assert set(by_phase) == {"forward", "backward", "optimizer"}
        assert sum(by_phase.values()) == summary[key]["total"] > 0
    assert summary["recomputed"] == 0
    assert summary["equivalent"] is True
    assert summary["error"] is None
    input_ir = (out / "input.ir.txt").read_text()
    assert len(input_ir.splitlines()) == summary["nodes_before"]["total"]
    assert len((out / "final.ir.txt").read_text().splitlines()) == summary["nodes_after"]["total"]
    code_text = (out / "final_graph.py").read_text()
    assert "def forward" in code_text
    compile(code_text, "final_graph.py", "exec")


def test_cli_paths_from_another_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    monkeypatch.chdir(tmp_path)
    config = REPO / "examples" / "tiny_mlp.yaml"
    # the model file is found beside the config, the default output folder is under the cwd
    assert main(["-q", "-p", "stats", str(config)]) == EXIT_OK, capsys.readouterr().err
    assert (tmp_path / "mutwo-out" / "tiny_mlp" / "summary.json").is_file()
    assert main(["-q", "-p", "stats", "-o", "relative/out", str(config)]) == EXIT_OK
    summary = json.loads((tmp_path / "relative" / "out" / "summary.json").read_text())
    assert summary["config"] == str(config) and summary["pipeline"] == ["stats"]


def test_cli_dump_dot_and_print_ir_after(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    monkeypatch.chdir(REPO)
    out = tmp_path / "out"
    code = main(["-q", "-p", "stats,dce", "--dump-dot", "--print-ir-after", "dce", "-o", str(out),
                 "examples/tiny_mlp.yaml"])  # fmt: skip
    captured = capsys.readouterr()
    assert code == EXIT_OK, captured.err
    assert captured.err == ""
    assert captured.out.count("// ----- IR after") == 1
    assert captured.out == "// ----- IR after dce -----\n" + (out / "final.ir.txt").read_text() + "\n"
    names = {p.name for p in out.iterdir()}
    assert {"01-stats-before.dot", "01-stats-after.dot", "02-dce-before.dot", "02-dce-after.dot"} <= names
    assert "02-dce-after.ir.txt" in names and "01-stats-after.ir.txt" not in names
    assert (out / "02-dce-after.dot").read_text().startswith("digraph mutwo")


SKEW_PASS = '''\
from dataclasses import dataclass

from mutwo.ir.pass_base import Pass, PassFailure


@dataclass(frozen=True)
class SkewConstant(Pass):
    """Change the first constant the optimizer step computes with, 1e-08 to 1.0 (Adam's eps: a wrong
    transform, on purpose; its learning rate, betas and step sizes are graph inputs, not constants)."""

    name = "skew-constant"
    is_transform = True

    def run(self, graph, ctx):
        for node in graph:
            if node.phase == "optimizer" and node.users and len(node.args) == 2 and isinstance(node.args[1], float):
                node.set_operands((node.args[0], node.args[1] * 2 + 1), dict(node.kwargs))
                return node.id
        raise PassFailure("no constant in the optimizer step")
'''


def test_cli_check_finds_a_difference(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    monkeypatch.chdir(REPO)
    passes_file = tmp_path / "infra_skew_passes.py"
    passes_file.write_text(SKEW_PASS)
    out = tmp_path / "out"
    code = main(["-q", "--check", "--load-passes", str(passes_file), "-p", "stats,skew-constant", "-o", str(out),
                 "examples/tiny_mlp.yaml"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == EXIT_FAILURE
    lines = err.splitlines()
    assert len(lines) == 1 and "Traceback" not in err
    assert lines[0].startswith("mutwo-opt: failed: NOT equivalent")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["equivalent"] is False
    assert summary["error"] is None
    assert summary["pipeline"] == ["stats", "skew-constant"]
    before, after = (out / "input.ir.txt").read_text().splitlines(), (out / "final.ir.txt").read_text().splitlines()
    changed = [(b, a) for b, a in zip(before, after, strict=True) if b != a]
    assert len(changed) == 1 and changed[0][1] == changed[0][0].replace(", 1e-08)", ", 1.00000002)"), changed
