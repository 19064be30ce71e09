"""The built wheel installs one import package, ``mutwo``, and works from a fresh environment.

The wheel is built from this checkout (no network: ``--no-build-isolation`` uses the test
environment's setuptools), installed without dependencies into a new virtual environment whose
only view of torch and the other dependencies is a ``.pth`` line naming the test environment's
site-packages. That line adds a path but processes no ``.pth`` file there, so the editable
install of the checkout stays invisible: what imports is the wheel.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(out), str(ROOT)], check=True, capture_output=True, text=True)  # fmt: skip
    (built,) = out.glob("mutwo-*.whl")
    return built


def test_wheel_holds_only_the_mutwo_package(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        top = {name.split("/", 1)[0] for name in archive.namelist()}
        names = set(archive.namelist())
    assert {t for t in top if not t.endswith(".dist-info")} == {"mutwo"}
    for module in ("mutwo/__init__.py", "mutwo/ir/graph.py", "mutwo/passes/select.py", "mutwo/runtime/api.py",
                   "mutwo/tools/mutwo_opt.py"):  # fmt: skip
        assert module in names


def test_fresh_environment_imports_mutwo_and_runs_mutwo_opt(wheel: Path, tmp_path: Path) -> None:
    env_dir = tmp_path / "env"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())  # fmt: skip
    before = {p.name for p in site.iterdir()}
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", str(wheel)],
                   check=True, capture_output=True, text=True)  # fmt: skip
    installed = {p.name for p in site.iterdir()} - before
    assert installed == {"mutwo", "mutwo-0.1.0.dist-info"}, sorted(installed)
    (site / "test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _install_plugin(site)

    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    probe = ("import mutwo, pathlib; print(mutwo.__version__); print(pathlib.Path(mutwo.__file__).parent); "
             "print(mutwo.optimize.__module__, mutwo.Pass.__module__, mutwo.Graph.__module__)")  # fmt: skip
    done = subprocess.run([str(python), "-c", probe], cwd=tmp_path, env=clean, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    version, where, modules = done.stdout.splitlines()
    assert version == "0.1.0"
    assert Path(where) == site / "mutwo"  # the wheel's copy, not the checkout
    assert modules.split() == ["mutwo.runtime.api", "mutwo.ir.pass_base", "mutwo.ir.graph"]

    listed = subprocess.run([str(env_dir / "bin" / "mutwo-opt"), "--list-passes"], cwd=tmp_path, env=clean,
                            capture_output=True, text=True)  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    for name in ("profile", "select", "insert-recompute", "rewrite", "plugin-probe"):
        assert f"\n{name} " in "\n" + listed.stdout
    assert "A pass installed through the mutwo.passes entry-point group." in listed.stdout


def _install_plugin(site: Path) -> None:
    """A distribution that registers a pass through the ``mutwo.passes`` entry-point group, as a
    third-party package installed with pip would (its module plus a dist-info with entry_points.txt)."""
    (site / "mutwo_plugin_probe.py").write_text(
        "from dataclasses import dataclass\n"
        "import mutwo\n\n"
        "@dataclass(frozen=True)\n"
        "class PluginProbe(mutwo.Pass):\n"
        '    """A pass installed through the mutwo.passes entry-point group."""\n'
        '    name = "plugin-probe"\n\n'
        "    def run(self, graph, ctx):\n"
        "        return None\n"
    )
    info = site / "mutwo_plugin_probe-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mutwo-plugin-probe\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[mutwo.passes]\nplugin-probe = mutwo_plugin_probe:PluginProbe\n")


def test_no_file_imports_the_folders_as_top_level_packages() -> None:
    """Code reaches the rooms only through ``mutwo.*``: an import of ``runtime`` or ``tools`` would
    work in a source checkout by accident and break in an installed wheel."""
    folders = {"mutwo_ir", "passes", "runtime", "tools"}
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        if any(part.startswith(".") or part == "build" for part in path.relative_to(ROOT).parts):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            offenders += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names if n.split(".")[0] in folders]
    assert offenders == []
