"""Profiles kept beside the plan cache's entries, so that a start whose plan is not kept under its key
does not profile a graph another start profiled.

A plan depends on the budget, the backend and ``keep_grads``; the profile it was made from does
not. A sweep over budgets, or a start that changes only those, missed the plan cache and measured
the same graph again: the profile was 33-36 s of BERT-base's and the Llama's first starts on an H200
(issue 40, ``bench/results/session33_h200/``). On a plan-cache miss, the runtime's profiler looks its
profile up here first, and keeps what it measures.

A profile's key holds what the profiler reads and nothing it does not:

- the captured graph (the plan key's digest of it), and the passes before the profile with the
  profile pass's own options (the plan key's pipeline up to the profile): what is profiled;
- the device, as the plan key describes it, and torch's and mutwo's versions and source;
- whether the profile runs out of core or in memory: all the budget and the memory limit change of
  a profile. Out of core, how many bytes of the iteration's values the device may hold decides only
  which values wait in host memory between ops, not what an op measures (each runs with what it
  reads on the device, and no peaks are kept), so a byte budget below the unoptimized step's peak
  reuses the profile another such budget made. Keyed by those bytes, every budget of a sweep on a
  card the step does not fit missed (BERT-base b64 under a 16 GiB cap on an H200, 15 against 16
  GiB: profiled again, 21.9 s; ``bench/results/session34_h200/``);
- what the profile pass asked the profiler for (runs, warm-up, isolation, copy contention, which
  depends on the passes after it).

Entries are ``profiles/<key hash>.json`` in the plan cache's folder, written atomically; one that
cannot be read, of another format or of another key is said in one line, measured again and replaced.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mutwo.ir.graph import Graph
from mutwo.ir.pass_base import write_atomic
from mutwo.ir.printer import fingerprint
from mutwo.passes.profile import unsteady_runs
from mutwo.runtime.measurement.profiler import Profile
from mutwo.runtime.planning.kept_files import read_kept
from mutwo.runtime.planning.plan_key import FORMAT, key_digest

#: The class of the profile pass as the plan key's pipeline names it: the key's pipeline ends there.
PROFILE_PASS = "mutwo.passes.profile.ProfilePass"


@dataclass
class ProfileStore:
    """The profiles under ``folder`` for one planning, whose plan key
    (:func:`~mutwo.runtime.planning.plan_key.plan_key`) gives the graph, device, pipeline and
    versions; ``log`` takes its lines, unprefixed."""

    folder: Path
    plan_key: dict[str, Any]
    log: Callable[[str], None]

    def key(self, graph: Graph, device_limit: int | None, asked: dict[str, Any]) -> dict[str, Any]:
        """The key of the profile of ``graph`` made with ``device_limit`` (out of core unless None)
        and the options ``asked``, as a kept file holds it (JSON values only)."""
        pipeline = self.plan_key["pipeline"]
        through = next((i for i, p in enumerate(pipeline) if p.get("class") == PROFILE_PASS), len(pipeline) - 1)
        return json.loads(json.dumps({
            "format": FORMAT, "graph": self.plan_key["graph"], "profiled": fingerprint(graph),
            "pipeline": pipeline[:through + 1], "device": self.plan_key["device"],
            "out_of_core": device_limit is not None, "asked": asked, "torch": self.plan_key["torch"],
            "mutwo": self.plan_key["mutwo"], "mutwo_source": self.plan_key["mutwo_source"]}))  # fmt: skip

    def path(self, key: dict[str, Any]) -> Path:
        return self.folder / "profiles" / f"{key_digest(key)}.json"

    def load(self, key: dict[str, Any]) -> Profile | None:
        """The profile kept under ``key`` (:meth:`key`), or None (and why, in one line, when a file
        was there but is not one)."""
        path = self.path(key)
        profile, ignored = read_kept(path, key, lambda data: Profile.from_json(data["profile"]), "a profile")
        if ignored is not None:
            self.log(f"plan cache: ignoring the kept profile {path.stem[:12]} ({ignored}); measuring it again and "
                     "replacing it")  # fmt: skip
        if profile is not None:
            self.log(f"profile: reusing the profile kept in {path} (this graph, device and profile options, made by "
                     "an earlier start whose plan differs): not measuring it again")  # fmt: skip
        return profile

    def keep(self, key: dict[str, Any], profile: Profile) -> None:
        """Keep ``profile`` (as measured: the profile pass pools its times after) under ``key``; a
        folder that cannot be written is said in one line. A profile whose runs were too far apart
        to trust is not kept: the profile pass warns of it, and a start on a quieter machine measures
        again rather than reusing it for every budget."""
        if unsteady_runs(profile.meta.get("run_seconds", [])) is not None:
            self.log("plan cache: not keeping the profile, whose runs were unsteady: the next start measures it again")
            return
        try:
            write_atomic(self.path(key), json.dumps({"format": FORMAT, "key": key, "profile": profile.to_json()}))
        except OSError as error:
            self.log(f"plan cache: could not keep the profile in {self.folder} ({error.strerror or error}); "
                     "the next start will measure it again")  # fmt: skip
