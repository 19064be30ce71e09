"""The documentation stays true: the pass reference is generated from the registry, and every
command written as a `$ mutwo-opt ...` line in docs/ runs and succeeds."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from mutwo.tools.mutwo_opt import main
from mutwo.tools.pass_docs import render

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"


def _commands() -> list[tuple[str, str]]:
    found = []
    for page in sorted(DOCS.glob("*.md")):
        for line in page.read_text(encoding="utf-8").splitlines():
            if line.startswith("$ mutwo-opt "):
                found.append((page.name, line[2:]))
    return found


def test_pass_reference_is_generated_from_the_registry() -> None:
    expected = render()
    assert (DOCS / "passes.md").read_text(encoding="utf-8") == expected, "regenerate: python -m mutwo.tools.pass_docs"


def test_docs_have_commands_to_run() -> None:
    pages = {page for page, _ in _commands()}
    assert {"writing-a-pass.md", "walkthrough-resnet152.md"} <= pages


@pytest.mark.slow
@pytest.mark.parametrize("page,command", _commands(), ids=[f"{p}:{i}" for i, (p, _) in enumerate(_commands())])
def test_documented_command_runs(page: str, command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    argv = shlex.split(command)[1:]
    out_index = argv.index("-o") + 1
    argv[out_index] = str(tmp_path / Path(argv[out_index]).name)
    assert main(argv) == 0, f"{page}: {command}"
    summary = json.loads((Path(argv[out_index]) / "summary.json").read_text())
    if "--check" in argv:
        assert summary["equivalent"] is True
    loaded = [argv[i + 1] for i, a in enumerate(argv) if a == "--load-passes"]
    if any("peak_consumers" in f for f in loaded):
        data = json.loads((Path(argv[out_index]) / "peak_consumers.json").read_text())
        assert len(data["top"]) == int(re.search(r"top=(\d+)", command).group(1))
    if any("recompute_pointwise" in f for f in loaded):
        assert "clone-of(%" in (Path(argv[out_index]) / "final.ir.txt").read_text()


def _synopsis_options(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])(--[a-z][a-z-]*|-[a-z])\b", text))


def test_the_synopses_name_every_option_of_the_parser() -> None:
    """docs/mutwo-opt.md's synopsis and the module's docstring list exactly the parser's options."""
    from mutwo.tools import mutwo_opt

    options = {o for action in mutwo_opt.build_parser()._actions for o in action.option_strings} - {"-h", "--help"}
    page = (DOCS / "mutwo-opt.md").read_text(encoding="utf-8")
    block = page.split("## Synopsis", 1)[1].split("```", 2)[1]
    docstring = (mutwo_opt.__doc__ or "").split("\n\n")[1]
    for where, text in (("docs/mutwo-opt.md's synopsis", block), ("mutwo_opt's docstring", docstring)):
        assert _synopsis_options(text) == options, f"{where}: missing {sorted(options - _synopsis_options(text))}, " \
                                                   f"unknown {sorted(_synopsis_options(text) - options)}"


def test_the_parser_describes_mutwo_opt_as_its_docstring_does() -> None:
    """``mutwo-opt --help`` opens with the first line of the module's docstring (the parser is built
    in mutwo_opt_args, the docstring is the command module's)."""
    from mutwo.tools import mutwo_opt

    assert mutwo_opt.build_parser().description == (mutwo_opt.__doc__ or "").split("\n\n")[0].replace("``", "")
