"""What mutwo's command-line tools share: exit codes, and bad usage as one line instead of argparse's exit."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import os
import re
import shutil
import socket
import sys
import tempfile
import traceback
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from mutwo.runtime.capture.tracing import debug_enabled

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """Bad usage, config or pipeline: one line on stderr, exit code 2."""


def unreadable(path: Path, what: str) -> str | None:
    """Why ``path``, given as ``what`` (``config file``), cannot be read as a file: the start of a
    one-line message, to which the caller adds the fix; None if it can be read."""
    if path.is_dir():
        return f"{what} {str(path)!r} is a directory, not a file"
    if not path.is_file():
        return f"{what} {str(path)!r} does not exist"
    if not os.access(path, os.R_OK):
        return f"{what} {str(path)!r} cannot be read (permission denied)"
    return None


def did_you_mean(word: str, choices: Iterable[str]) -> str | None:
    """``did you mean 'X'?`` for the choice closest to a misspelt ``word``; None if none is close."""
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f"did you mean '{close[0]}'?" if close else None


class Parser(argparse.ArgumentParser):
    """An argument parser that raises :class:`UsageError` (naming ``--help``) instead of exiting,
    and answers a misspelt option with the closest real one."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {self.prog} --help)")

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        parsed, extra = self.parse_known_args(args, namespace)
        unknown = [a.split("=", 1)[0] for a in extra if a.startswith("-")]
        if unknown:
            options = [o for action in self._actions for o in action.option_strings]
            hint = did_you_mean(unknown[0], options)
            self.error(f"unrecognized option '{unknown[0]}'" + (f"; {hint}" if hint else ""))
        if extra:
            self.error(f"unrecognized arguments: {' '.join(extra)}")
        return parsed


@contextlib.contextmanager
def mutwo_warnings_on_one_line() -> Iterator[None]:
    """While a tool runs: a warning of mutwo's own (its message starts ``mutwo:``) is printed as
    that one line on stderr, without Python's file, line number and source line; others as usual."""
    default = warnings.showwarning

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Any = None,
             line: str | None = None) -> None:  # fmt: skip
        if str(message).startswith("mutwo:"):
            print(message, file=sys.stderr if file is None else file)
        else:
            default(message, category, filename, lineno, file, line)

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield


def print_debug_traceback(error: BaseException) -> None:
    """With ``--debug`` or ``MUTWO_DEBUG=1``, the traceback of what caused ``error``: the tools turn
    errors into one line with ``raise ... from None``, so the exception it replaced is printed."""
    if debug_enabled():
        traceback.print_exception(error.__cause__ or error.__context__ or error)


@dataclass
class OutputFolder:
    """A run's output, staged in a hidden folder and moved into place only when the run ends.

    A run refused after its passes have written (a backend that cannot run the plan they made) is
    bad usage, and bad usage leaves nothing behind: :meth:`discard` removes the staging folder, and
    the output folder, with the files an earlier run left there, stays as it was. A run that ends,
    or fails in a way whose files explain it (a pass that fails, ``--check`` that finds a
    difference, an interrupt), is moved into place by :meth:`commit`, file by file (``os.replace``,
    within one file system), replacing files of the same names."""

    path: Path
    staging: Path  #: where the run writes: a hidden folder in ``path``, or beside where it will be

    @classmethod
    def make(cls, path: Path) -> OutputFolder:
        """Stage output for ``path``: inside it when it exists, else in its nearest existing parent.
        Stages of ``path`` that killed runs left behind are removed first (:func:`remove_stale_stages`)."""
        remove_stale_stages(path)
        home = next(folder for folder in (path, *path.parents) if folder.exists())
        owner = f"{os.getpid()}@{socket.gethostname()}"
        return cls(path, Path(tempfile.mkdtemp(prefix=f"{_stage_prefix(path)}{owner}-", dir=home)))

    def commit(self) -> None:
        """Move everything staged into the output folder (made with its parents), then drop the stage."""
        self.path.mkdir(parents=True, exist_ok=True)
        for item in sorted(self.staging.rglob("*")):
            target = self.path / item.relative_to(self.staging)
            if item.is_dir():
                target.mkdir(exist_ok=True)
            else:
                os.replace(item, target)
        self.discard()

    def discard(self) -> None:
        """Remove the staging folder and everything in it."""
        shutil.rmtree(self.staging, ignore_errors=True)


def _stage_prefix(path: Path) -> str:
    """How the names of ``path``'s staging folders begin; the owner's ``PID@HOST-`` follows."""
    return f".{path.name or 'out'}.mutwo-staging-"


def remove_stale_stages(path: Path) -> None:
    """Remove the staging folders of ``path`` that runs killed on this host left (a SIGKILL runs no
    cleanup), in every folder a stage of it can be in. A folder's name holds its owner's process
    id and host: a live process's folder is kept, and so is another host's (on a shared file
    system its processes cannot be asked) and one named in no such way."""
    owned = re.compile(re.escape(_stage_prefix(path)) + r"(\d+)@" + re.escape(socket.gethostname()) + r"-[^/]+")
    for home in (path, *path.parents):
        try:
            entries = list(home.iterdir())
        except OSError:  # not there (yet), or not readable: nothing of ours to find
            continue
        for entry in entries:
            match = owned.fullmatch(entry.name)
            if match is not None and entry.is_dir() and process_gone(int(match.group(1))):
                shutil.rmtree(entry, ignore_errors=True)


def process_gone(pid: int) -> bool:
    """Whether no process ``pid`` runs on this host, so that its stage is left for good. Another
    user's process (which cannot be signalled) runs; a number no process can have is kept as well."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):
        return False
    return False
