"""Why AOTAutograd's cache skipped a compile, said rather than found by sampling a restart.

When AOTAutograd's cache cannot key a graph (a Python function it does not know in the graph, an
unpicklable constant) it logs ``Bypassing autograd cache due to: REASON`` at INFO level and traces
the whole step again at every start; Inductor's own cache may still hit afterwards, so the compile
looks cached while most of it is repeated. A BERT-base b64 restart on the H100 spent about 13 of
its 22.9 s re-tracing so before the reason was found in a log (docs/plan-cache.md).
:func:`noting_bypass` keeps that reason for the compile's report. It changes the logger's level
for the length of a compile, which (like Inductor's own ``config.patch``) is not thread-safe.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

#: The logger AOTAutograd's cache reports a bypass on: its module's (``logging.getLogger(__name__)``).
AOT_CACHE_LOGGER = "torch._functorch._aot_autograd.autograd_cache"
_PREFIX = "Bypassing autograd cache due to: "


class _Reasons(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.reasons: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith(_PREFIX):
            self.reasons.append(" ".join(message[len(_PREFIX) :].split()))


@contextmanager
def noting_bypass() -> Iterator[list[str]]:
    """While it is open, collect into the list it yields the reasons AOTAutograd's cache gives for
    skipping a compile, each on one line. The records reach torch's own handlers only where the
    user turned that logger on (``TORCH_LOGS``), as before."""
    logger = logging.getLogger(AOT_CACHE_LOGGER)
    handler = _Reasons()
    level, propagate = logger.level, logger.propagate
    quiet = not logger.isEnabledFor(logging.INFO)
    logger.addHandler(handler)
    if quiet:  # INFO records for this handler only: torch's handlers would print them
        logger.setLevel(logging.INFO)
        logger.propagate = False
    try:
        yield handler.reasons
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate
