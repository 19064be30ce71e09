"""The pass base class, typed options, and the context passes run in.

A pass is a frozen dataclass: its fields are its options (parsed from ``select{budget=0.5}``),
its docstring is its help, and class attributes say what it needs and gives:

* ``name``: kebab-case, unique in the registry;
* ``requires``: artifacts that must exist in the context before it runs (``"profile"``...);
* ``provides``: artifacts it adds to the context;
* ``is_transform``: whether it may change the graph; a transform lists in ``preserves`` the
  analyses that stay valid after it (everything else is dropped), an analysis changes nothing.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
import types
import typing
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from mutwo.ir.graph import Graph
from mutwo.ir.node import Node

KEBAB = re.compile(r"^[a-z][a-z0-9]*(-[a-z0-9]+)*$")


class PassOptionError(ValueError):
    """An option name or value a pass does not accept."""


class PassFailure(RuntimeError):
    """A pass could not do its work: ``reason`` says why, ``node`` is the node involved, when
    there is one, and ``advice`` what to do instead, when the pass knows. The message reads
    ``"{reason}; {advice}"``; a caller that acts on the failure itself (``--fit``, which sets the
    budget that select's advice would change) reads ``reason`` alone."""

    def __init__(self, reason: str, node: Node | None = None, advice: str | None = None) -> None:
        super().__init__(f"{reason}; {advice}" if advice else reason)
        self.reason = reason
        self.node = node
        self.advice = advice


@dataclass(frozen=True)
class OptionInfo:
    name: str
    type_name: str
    default: Any
    help: str


@dataclass(frozen=True)
class Pass:
    """Base class of every pass (see the module docstring)."""

    name: ClassVar[str] = ""
    requires: ClassVar[tuple[str, ...]] = ()
    provides: ClassVar[tuple[str, ...]] = ()
    is_transform: ClassVar[bool] = False
    preserves: ClassVar[tuple[str, ...]] = ()
    #: What the pass reads from the profile beyond per-node times and memory (``"contention"``:
    #: how much copies slow compute); the profile measures it when a pass of the pipeline needs it.
    profile_needs: ClassVar[tuple[str, ...]] = ()

    def run(self, graph: Graph, ctx: PassContext) -> Any:
        """Do the pass's work on ``graph``; the return value is kept as the pass's result."""
        raise NotImplementedError

    # -- description -----------------------------------------------------------------------
    @classmethod
    def summary(cls) -> str:
        """First line of the docstring: the one-line help."""
        return (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""

    @classmethod
    def options(cls) -> list[OptionInfo]:
        hints = typing.get_type_hints(cls)
        infos = []
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else None
            infos.append(OptionInfo(f.name, _type_name(hints[f.name]), default, f.metadata.get("help", "")))
        return infos

    @classmethod
    def from_options(cls, raw: dict[str, str]) -> Pass:
        """Build the pass from ``key=value`` strings, converting each to its field's type."""
        hints = typing.get_type_hints(cls)
        known = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for key, text in raw.items():
            if key not in known:
                valid = ", ".join(sorted(known)) or "none"
                close = difflib.get_close_matches(key, list(known), n=1)
                hint = f"did you mean '{close[0]}'? " if close else ""
                raise PassOptionError(f"pass '{cls.name}' has no option '{key}'; {hint}its options: {valid}")
            values[key] = _convert(cls.name, key, text, hints[key])
        try:
            instance = cls(**values)
        except (TypeError, ValueError) as error:
            raise PassOptionError(f"pass '{cls.name}': {error}") from None
        return instance

    def describe(self) -> str:
        """``name{opt=value,...}`` with the options that differ from their defaults."""
        changed = [f"{f.name}={_quote(getattr(self, f.name))}" for f in dataclasses.fields(self)
                   if f.default is dataclasses.MISSING or getattr(self, f.name) != f.default]  # fmt: skip
        return self.name + ("{" + ",".join(changed) + "}" if changed else "")


def _quote(value: Any) -> str:
    text = str(value)
    return f'"{text}"' if any(c in text for c in ",{}=") else text


def option(default: Any, help: str) -> Any:
    """A pass option with its default and a help line."""
    return field(default=default, metadata={"help": help})


def _type_name(hint: Any) -> str:
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if hint is type(None):
        return "None"
    return getattr(hint, "__name__", str(hint))


def _convert(pass_name: str, key: str, text: str, hint: Any) -> Any:
    candidates = list(typing.get_args(hint)) if typing.get_origin(hint) in (typing.Union, types.UnionType) else [hint]
    if type(None) in candidates and text.lower() in ("none", "null", ""):
        return None
    for candidate in candidates:
        try:
            if candidate is bool:
                if text.lower() in ("true", "1", "yes", "on"):
                    return True
                if text.lower() in ("false", "0", "no", "off"):
                    return False
                continue
            if candidate in (int, float, str):
                return candidate(text)
        except ValueError:
            continue
    raise PassOptionError(f"pass '{pass_name}': option '{key}' must be {_type_name(hint)}, got {text!r}")


class AnalysisCache:
    """Results of analyses, valid for one graph at one version.

    A result is returned again while the same graph's ``version`` is unchanged; a transform
    keeps the results it declares in ``preserves`` (they are re-stamped with the new version)
    and everything else is dropped. Results are kept per graph object, so a copy of a graph
    (which restarts its version) never sees the original's results.
    """

    def __init__(self) -> None:
        self._results: weakref.WeakKeyDictionary[Graph, dict[str, tuple[int, Any]]] = weakref.WeakKeyDictionary()

    def _entries(self, graph: Graph) -> dict[str, tuple[int, Any]]:
        entries = self._results.get(graph)
        if entries is None:
            entries = self._results[graph] = {}
        return entries

    def get(self, graph: Graph, analysis: Pass, ctx: PassContext) -> Any:
        """The result of the analysis pass ``analysis`` on the current graph, computing it if needed."""
        return self.compute(graph, analysis.describe(), lambda g: analysis.run(g, ctx))

    def compute(self, graph: Graph, key: str, function: Callable[[Graph], Any]) -> Any:
        """``function(graph)``, cached under ``key`` for the current version of the graph."""
        entries = self._entries(graph)
        cached = entries.get(key)
        if cached is not None and cached[0] == graph.version:
            return cached[1]
        result = function(graph)
        entries[key] = (graph.version, result)
        return result

    def cached(self, key: str, graph: Graph) -> bool:
        entry = self._entries(graph).get(key)
        return entry is not None and entry[0] == graph.version

    def after_transform(self, graph: Graph, version_before: int, preserves: tuple[str, ...]) -> None:
        if graph.version == version_before:
            return
        entries = self._entries(graph)
        kept = {key: (graph.version, result) for key, (version, result) in entries.items()
                if version == version_before and key.split("{")[0] in preserves}  # fmt: skip
        self._results[graph] = kept


@dataclass
class PassContext:
    """What passes share: artifacts (profiles, plans...), cached analyses, the output folder,
    and services the runtime provides (a pass that needs the machine, like ``profile``, asks
    for ``services["profiler"]`` instead of importing the runtime)."""

    out_dir: Path | None = None
    device: str = "cpu"
    artifacts: dict[str, Any] = field(default_factory=dict)
    services: dict[str, Any] = field(default_factory=dict)
    analyses: AnalysisCache = field(default_factory=AnalysisCache)
    log: Callable[[str], None] = lambda message: None
    #: What the passes of the running pipeline need from the profile (their ``profile_needs``),
    #: set by :class:`~mutwo.ir.pass_manager.PassManager`.
    profile_needs: frozenset[str] = frozenset()

    def analysis(self, graph: Graph, analysis: Pass) -> Any:
        """The (cached) result of an analysis pass on ``graph``."""
        return self.analyses.get(graph, analysis, self)

    def save_json(self, filename: str, data: Any) -> Path | None:
        """Write ``data`` as JSON into the output folder, atomically; returns the path."""
        if self.out_dir is None:
            return None
        return write_atomic(self.out_dir / filename, json.dumps(data, indent=2, sort_keys=True) + "\n")


def write_atomic(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file and a rename: never half-written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp{os.getpid()}")
    temporary.write_text(text, encoding="utf-8")
    os.replace(temporary, path)
    return path
