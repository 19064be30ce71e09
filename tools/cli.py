"""What mutwo's command-line tools share: exit codes, and bad usage as one line instead of argparse's exit."""

from __future__ import annotations

import argparse
import difflib
import os
import traceback
from collections.abc import Iterable, Sequence
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
