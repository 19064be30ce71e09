"""A digest of mutwo's own source, for the keys of what mutwo keeps between processes (the plan
cache's entries, the AOTAutograd keys handed over): a development checkout changes its code
without changing its version."""

from __future__ import annotations

import functools
import hashlib
from importlib.util import find_spec
from pathlib import Path

import mutwo.ir

#: The folder of mutwo's runtime (this file's parent's parent).
_RUNTIME = Path(__file__).resolve().parents[1]


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """A hash of mutwo's modules that planning and compiling run (ir, passes, runtime); read once a
    process. The passes' folder is found without importing it: they import the runtime."""
    passes = find_spec("mutwo.passes")
    assert passes is not None and passes.origin is not None
    digest = hashlib.sha256()
    for folder in (Path(mutwo.ir.__file__).parent, Path(passes.origin).parent, _RUNTIME):
        for path in sorted(folder.rglob("*.py")):
            digest.update(f"{path.relative_to(folder.parent)}\n".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()
