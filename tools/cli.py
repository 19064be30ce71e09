"""What mutwo's command-line tools share: exit codes, and bad usage as one line instead of argparse's exit."""

from __future__ import annotations

import argparse
import difflib
import os
import shutil
import tempfile
import traceback
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from mutwo.runtime.tracing import debug_enabled

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
        """Stage output for ``path``: inside it when it exists, else in its nearest existing parent."""
        home = next(folder for folder in (path, *path.parents) if folder.exists())
        return cls(path, Path(tempfile.mkdtemp(prefix=f".{path.name or 'out'}.mutwo-staging-", dir=home)))

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
