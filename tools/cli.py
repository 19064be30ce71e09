"""What mutwo's command-line tools share: exit codes, and bad usage as one line instead of argparse's exit."""

from __future__ import annotations

import argparse
from typing import NoReturn

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """Bad usage, config or pipeline: one line on stderr, exit code 2."""


class Parser(argparse.ArgumentParser):
    """An argument parser that raises :class:`UsageError` (naming ``--help``) instead of exiting."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {self.prog} --help)")
