"""Reading back what the plan cache keeps (its plans, :mod:`mutwo.runtime.planning.plan_cache`, and
its profiles, :mod:`mutwo.runtime.planning.profile_cache`): one JSON file per key, holding the
cache's format, the key itself and what was kept. A file is read back only for the same format and
the same key (another key of the same hash, or a file edited by hand, is not), and one that cannot
be read or parsed is reported in a phrase for the log line that ignores it, never raised."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from mutwo.runtime.planning.plan_key import FORMAT

Kept = TypeVar("Kept")


def read_kept(path: Path, key: dict[str, Any], parse: Callable[[dict[str, Any]], Kept],
              what: str) -> tuple[Kept | None, str | None]:  # fmt: skip
    """What ``path`` keeps for ``key``, parsed by ``parse`` from the file's JSON, or None with why
    it was ignored (None when there is no file); ``what`` names it in that phrase ("an entry")."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, NotADirectoryError):  # none kept (a folder under a file fails when kept)
        return None, None
    except (OSError, ValueError) as error:
        return None, f"it cannot be read ({type(error).__name__}: {error})"
    try:
        if data.get("format") != FORMAT:
            return None, f"it is of format {data.get('format')!r}, this mutwo reads {FORMAT}"
        if data["key"] != key:
            return None, "it was kept for another key"
        return parse(data), None
    except (AttributeError, KeyError, TypeError, ValueError) as error:
        return None, f"it is not {what} of this mutwo ({type(error).__name__}: {error})"
