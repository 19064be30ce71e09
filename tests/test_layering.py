"""The package's import structure, read from the source with ``ast`` (nothing is imported).

Three promises of docs/architecture.md are checked here, so that a change that breaks one fails
in CI instead of surfacing as a circular-import error in some user's import order:

- no import cycle among the package's modules, counting every import wherever it stands (at the
  top, inside a function, under ``TYPE_CHECKING``): a lazy import hides a cycle, it does not break it;
- the rooms' layering: ``mutwo.ir`` imports none of ``passes``/``runtime``/``tools``, ``mutwo.passes``
  imports no ``runtime``/``tools``, ``mutwo.runtime`` imports no ``tools``;
- inside ``mutwo.runtime``, each sub-package imports only the rooms below it (``RUNTIME_ROOMS``).
  Imports under ``if TYPE_CHECKING:`` are left out of this one: they name a type for an
  annotation and never run.

Every package folder is also listed in pyproject.toml, so that the wheel installs it.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
#: import name of each top-level folder (pyproject.toml's package-dir)
FOLDERS = {"mutwo": "mutwo", "mutwo.ir": "mutwo_ir", "mutwo.passes": "passes", "mutwo.runtime": "runtime",
           "mutwo.tools": "tools"}  # fmt: skip
#: what each room must not import
FORBIDDEN = {
    "mutwo.ir": ("mutwo.passes", "mutwo.runtime", "mutwo.tools"),
    "mutwo.passes": ("mutwo.runtime", "mutwo.tools"),
    "mutwo.runtime": ("mutwo.tools",),
}
#: the sub-packages of mutwo.runtime and the ones each may import (besides itself); the modules
#: at the top of mutwo.runtime (its __init__, api) may import them all
RUNTIME_ROOMS: dict[str, set[str]] = {
    "measurement": set(),
    "capture": set(),
    "parallel": {"capture", "measurement"},
    "execution": {"capture", "measurement"},
    "planning": {"capture", "execution", "measurement", "parallel"},
}


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    line: int
    type_checking: bool


def module_files() -> dict[str, Path]:
    """Every module of the package by its import name (a package by its own name)."""
    modules: dict[str, Path] = {}
    for package, folder in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = [p for p in path.relative_to(ROOT / folder).with_suffix("").parts if p != "__init__"]
            modules[".".join([package, *parts])] = path
    return modules


def _under_type_checking(tree: ast.Module) -> set[ast.AST]:
    guarded: set[ast.AST] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for statement in node.body:
                guarded.update(ast.walk(statement))
    return guarded


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    """The package's modules that ``name`` imports: ``from a.b import c`` imports ``a.b`` and, when
    ``c`` is a module, ``a.b.c`` too."""
    tree = ast.parse(path.read_text(), filename=str(path))
    guarded = _under_type_checking(tree)
    is_package = path.name == "__init__.py"
    found: list[Import] = []
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against the importing module's package
                package = name.split(".") if is_package else name.split(".")[:-1]
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        for target in targets:
            if target in modules and target != name:
                found.append(Import(name, target, node.lineno, node in guarded))
    return found


@pytest.fixture(scope="module")
def imports() -> list[Import]:
    modules = module_files()
    return [found for name, path in modules.items() for found in imports_of(name, path, modules)]


def _room(module: str) -> str:
    return next(room for room in sorted(FOLDERS, key=len, reverse=True) if module == room or
                module.startswith(room + "."))  # fmt: skip


def _runtime_room(module: str) -> str | None:
    """The sub-package of mutwo.runtime holding ``module``; None for the modules at its top."""
    parts = module.split(".")
    return parts[2] if len(parts) > 3 or (len(parts) == 3 and parts[2] in RUNTIME_ROOMS) else None


def test_no_import_cycle(imports: list[Import]) -> None:
    graph = nx.DiGraph((i.importer, i.imported) for i in imports)
    cycles = [sorted(component) for component in nx.strongly_connected_components(graph) if len(component) > 1]
    assert not cycles, "modules that import each other in a circle: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_rooms_import_only_downward(imports: list[Import]) -> None:
    wrong = [f"{i.importer} (line {i.line}) imports {i.imported}" for i in imports
             if any(i.imported == f or i.imported.startswith(f + ".") for f in FORBIDDEN.get(_room(i.importer), ()))]
    assert not wrong, "imports against the layering: " + "; ".join(wrong)


def test_runtime_rooms_import_only_the_rooms_below(imports: list[Import]) -> None:
    assert {p.name for p in (ROOT / "runtime").iterdir() if (p / "__init__.py").exists()} == set(RUNTIME_ROOMS)
    wrong = []
    for i in imports:
        importer, imported = _runtime_room(i.importer), _runtime_room(i.imported)
        if i.type_checking or importer is None or imported is None or importer == imported:
            continue
        if not i.importer.startswith("mutwo.runtime.") or not i.imported.startswith("mutwo.runtime."):
            continue
        if imported not in RUNTIME_ROOMS[importer]:
            wrong.append(f"{i.importer} (line {i.line}) imports {i.imported}")
    assert not wrong, "runtime rooms importing a room not below them: " + "; ".join(wrong)
    modules = module_files()
    top = [name for name in modules if name.startswith("mutwo.runtime") and _runtime_room(name) is None]
    below = [i for i in imports if i.importer.startswith("mutwo.runtime.") and _runtime_room(i.importer) is not None
             and i.imported in top]  # fmt: skip
    assert not below, "a runtime room imports the modules at runtime's top: " + "; ".join(
        f"{i.importer} (line {i.line}) imports {i.imported}" for i in below)


def test_every_package_folder_is_installed() -> None:
    setuptools = (ROOT / "pyproject.toml").read_text().split("[tool.setuptools]")[1]
    listed = set(re.findall(r'"(mutwo(?:\.[\w.]+)?)"', setuptools.split("[tool.setuptools.package-dir]")[0]))
    packages = {name for name, path in module_files().items() if path.name == "__init__.py"}
    assert packages == listed, f"pyproject.toml's packages differ from the package folders: {packages ^ listed}"


def test_a_cycle_is_found(tmp_path: Path) -> None:
    """The checks can fail: a lazy import back from a module it imports is a cycle."""
    first, second = tmp_path / "first.py", tmp_path / "second.py"
    first.write_text("from mutwo.tools import second\n")
    second.write_text("def f():\n    from mutwo.tools.first import x\n")
    modules = {"mutwo.tools.first": first, "mutwo.tools.second": second}
    found = [i for name, path in modules.items() for i in imports_of(name, path, modules)]
    assert {(i.importer, i.imported) for i in found} == {("mutwo.tools.first", "mutwo.tools.second"),
                                                         ("mutwo.tools.second", "mutwo.tools.first")}
    with pytest.raises(AssertionError, match="in a circle"):
        test_no_import_cycle(found)


def test_type_checking_imports_are_marked(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from mutwo.ir import graph\n"
                      "from mutwo.ir import node\n")  # fmt: skip
    modules = {"mutwo.runtime.capture.m": module, "mutwo.ir.graph": module, "mutwo.ir.node": module}
    found = {i.imported: i.type_checking for i in imports_of("mutwo.runtime.capture.m", module, modules)}
    assert found == {"mutwo.ir.graph": True, "mutwo.ir.node": False}


def test_an_upward_import_is_found(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from mutwo.runtime.api import optimize\n")
    modules = {"mutwo.ir.m": module, "mutwo.runtime.api": module}
    with pytest.raises(AssertionError, match=r"mutwo.ir.m \(line 2\) imports mutwo.runtime.api"):
        test_rooms_import_only_downward(imports_of("mutwo.ir.m", module, modules))
