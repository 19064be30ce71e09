"""What mutwo's command-line tools share: exit codes, and bad usage as one line instead of argparse's exit."""

from __future__ import annotations

import argparse
import traceback
from typing import NoReturn

from mutwo.runtime.tracing import debug_enabled

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """Bad usage, config or pipeline: one line on stderr, exit code 2."""


class Parser(argparse.ArgumentParser):
    """An argument parser that raises :class:`UsageError` (naming ``--help``) instead of exiting."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {self.prog} --help)")


def print_debug_traceback(error: BaseException) -> None:
    """With ``--debug`` or ``MUTWO_DEBUG=1``, the traceback of what caused ``error``: the tools turn
    errors into one line with ``raise ... from None``, so the exception it replaced is printed."""
    if debug_enabled():
        traceback.print_exception(error.__cause__ or error.__context__ or error)
