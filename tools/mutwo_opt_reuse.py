"""The files of an earlier ``mutwo-opt`` run that ``--profile-from`` and ``--plan-from`` give in place
of a pass's artifact: which file each one is, the refusals of a file that is unreadable, of another
kind, or that the pipeline would not use (all before the capture, which can take minutes), and
loading them once the graph is captured (refused unless they belong to it)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mutwo.ir.graph import Graph
from mutwo.ir.pass_base import Pass
from mutwo.passes.select import Plan
from mutwo.passes.select_swap import SwapPlan
from mutwo.runtime.measurement.profiler import Profile, fingerprint
from mutwo.tools.cli import UsageError, unreadable


@dataclass(frozen=True)
class ReusedFile:
    """A file of an earlier run that an option gives in place of a pass's artifact."""

    option: str  #: --profile-from or --plan-from
    artifact: str  #: the artifact it stands for (ctx.artifacts' key)
    filename: str  #: as the pass writes it
    maker: str  #: the pass that writes it
    cls: Any  #: what reads it (from_json)
    example: str  #: a pipeline that uses it without making it again
    fields: tuple[str, ...]  #: keys its JSON has and the other files' lack, to tell them apart


REUSED = (
    ReusedFile("--profile-from", "profile", "profile.json", "profile", Profile, "-p select,rewrite",
               ("nodes", "runs", "iteration")),
    ReusedFile("--plan-from", "plan", "plan.json", "select", Plan, "-p rewrite", ("clones", "entries")),
    ReusedFile("--plan-from", "swap-plan", "swap_plan.json", "select-swap", SwapPlan, "-p insert-swap",
               ("transfer", "entries")),
)  # fmt: skip

#: A file an option gives: what it stands for, its path, and which file it was recognised as
#: (:func:`artifact_file`; None when unreadable or none of them).
GivenFile = tuple[ReusedFile, Path, str | None]


def artifact_file(path: Path) -> str | None:
    """Which of the files mutwo-opt reuses ``path`` holds, by its fields (``swap_plan.json``); None
    when it cannot be read or is none of them (loading it then says what is wrong)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    return next((r.filename for r in REUSED if all(key in data for key in r.fields)), None)


def given_files(args: argparse.Namespace) -> list[GivenFile]:
    """The files ``--profile-from`` and ``--plan-from`` give, each with what it stands for and which
    file it was recognised as (each read once here: a profile.json can be megabytes): a
    ``--plan-from`` file is select's plan or, by its fields, select-swap's."""
    given = []
    for option in ("--profile-from", "--plan-from"):
        text = getattr(args, option.removeprefix("--").replace("-", "_"))
        if text:
            kinds = [r for r in REUSED if r.option == option]
            written = artifact_file(Path(text))
            given.append((next((r for r in kinds if r.filename == written), kinds[0]), Path(text), written))
    return given


def check_given_files(given: list[GivenFile]) -> None:
    """The given files are readable files of their option's kind (whether a file belongs to the graph
    is checked once it is captured, by :func:`load_artifact`)."""
    for reused, path, written in given:
        accepted = " or ".join(r.filename for r in REUSED if r.option == reused.option)
        problem = unreadable(path, f"{reused.option}:")
        if problem is not None:
            raise UsageError(f"{problem}; give the {accepted} an earlier run wrote")
        if written is not None and written != reused.filename:
            maker = next(r.maker for r in REUSED if r.filename == written)
            raise UsageError(f"{reused.option}: {path} is a {written} written by the {maker} pass, not a "
                             f"{accepted}; give the {accepted} an earlier run wrote")  # fmt: skip


def refuse_remade_artifacts(given: list[GivenFile], passes: list[Pass]) -> None:
    """Refuse ``--profile-from``/``--plan-from`` beside a pass that makes the same artifact again:
    the pass would silently replace what the file gave, and the file would go unused."""
    for reused, _, _ in given:
        maker = next((p.name for p in passes if reused.artifact in type(p).provides), None)
        if maker is not None:
            raise UsageError(f"{reused.option} gives the {reused.artifact}, but the pipeline's '{maker}' pass "
                             f"would make a new one and leave the file unused; drop {maker} from --passes "
                             f"({reused.example} {reused.option} FILE)")  # fmt: skip


def refuse_unread_plan(given: list[GivenFile], passes: list[Pass]) -> None:
    """Refuse ``--plan-from`` when no pass of the pipeline reads its plan: the file would go unused."""
    for reused, _, written in given:
        if reused.option == "--plan-from" and not any(reused.artifact in type(p).requires for p in passes):
            pipeline = ",".join(p.name for p in passes)
            what = reused.filename if written == reused.filename else "plan file"
            raise UsageError(f"--plan-from gives a {what}, but no pass of this pipeline ({pipeline}) "
                             f"reads it, so the file would go unused; {reused.example.removeprefix('-p ')} "
                             f"applies it ({reused.example} --plan-from FILE)")  # fmt: skip


def load_artifact(graph: Graph, reused: ReusedFile, path: Path) -> Any:
    """A profile.json, plan.json or swap_plan.json of an earlier run, refused unless it belongs to this graph."""
    option = reused.option
    try:
        artifact = reused.cls.from_json(json.loads(path.read_text(encoding="utf-8")))
    except OSError as error:  # checked before the capture; gone or unreadable since
        raise UsageError(f"{option}: {str(path)!r} cannot be read ({error.strerror})") from None
    except (ValueError, KeyError, TypeError) as error:
        raise UsageError(f"{option}: {path} is not a {reused.filename} written by the {reused.maker} pass "
                         f"({type(error).__name__}: {error})") from None  # fmt: skip
    if artifact.fingerprint != fingerprint(graph):
        raise UsageError(f"{option}: {path} belongs to a different graph (fingerprint {artifact.fingerprint}, "
                         f"this graph {fingerprint(graph)}); run the {reused.maker} pass again for this model, "
                         "batch size and device")  # fmt: skip
    return artifact
