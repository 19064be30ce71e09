"""What mutwo's command-line tools share: exit codes, and bad usage as one line instead of argparse's exit."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import os
import shutil
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
    """An output folder a run makes, remembering what was in it before: a run refused after it has
    started writing (a backend that cannot run the plan the passes made) removes what it wrote, so
    bad usage leaves nothing half-written. Files that were there before are left alone."""

    path: Path
    before: frozenset[Path]
    created: Path | None  #: the outermost folder this run created, if any

    @classmethod
    def make(cls, path: Path) -> OutputFolder:
        """Create ``path`` (and missing parents), noting what it held."""
        created = None
        for folder in (path, *path.parents):
            if folder.exists():
                break
            created = folder
        before = frozenset(path.rglob("*")) if path.exists() else frozenset()
        path.mkdir(parents=True, exist_ok=True)
        return cls(path, before, created)

    def remove_written(self) -> None:
        """Remove every file and folder made since :meth:`make`, deepest first, and the folders it created."""
        for item in sorted(set(self.path.rglob("*")) - self.before, key=lambda p: len(p.parts), reverse=True):
            if item.is_dir() and not item.is_symlink():
                shutil.rmtree(item, ignore_errors=True)
            else:
                item.unlink(missing_ok=True)
        if self.created is not None:
            folder = self.path
            while True:
                with contextlib.suppress(OSError):  # not empty: something else wrote there meanwhile
                    folder.rmdir()
                if folder == self.created:
                    break
                folder = folder.parent
