"""The plan cache: a step's profile and final plan kept on disk, so that a second process with the
same model, batch, device and settings skips profiling, selection and calibration.

Planning a real model takes minutes (issue 40: 142-329 s on an H100, most of it the profile, the
calibration rounds and their compiles), and every restart, resume or sweep paid it again. What
planning produces is small and already has a file format: the ``profile.json`` and ``plan.json``
(or ``swap_plan.json``) that ``mutwo-opt --profile-from``/``--plan-from`` reload. An entry holds
those, for the plan that was compiled (after calibration and the measured choice), keyed by what
they depend on (:mod:`mutwo.runtime.planning.plan_key`). On a hit the pipeline runs without its
``profile`` and ``select``/``select-swap`` passes, the entry's artifacts in their place, so the
passes that apply the plan (rewrite, insert-swap) and those that cost little (optimizer) make the
final graph as before; ``extract`` and ``insert-swap`` refuse a plan made for another graph.
On a miss, the profile another start measured of the same graph is reused
(:mod:`mutwo.runtime.planning.profile_cache`): a plan depends on the budget, its profile does not.
Compiled code is not kept here: torch's own caches (AOTAutograd's and Inductor's FX graph cache,
under ``TORCHINDUCTOR_CACHE_DIR``) already serve a second compile of the same graph in any process.

Where: ``cache=`` a folder, else ``$MUTWO_CACHE_DIR``, else ``$XDG_CACHE_HOME/mutwo``, else
``~/.cache/mutwo``; entries are ``plans/<key hash>.json``. ``cache=False`` (``mutwo-opt
--no-cache``, or ``MUTWO_CACHE=0`` for the default) turns it off. An entry is written to a
temporary file and renamed into place, so a crashed or concurrent process never leaves half of
one; an entry that cannot be read, of another format or of another key is ignored in one log line
and replaced once planning ends. Data-parallel steps do not use it: every rank must plan, or not,
together, and one rank's hit beside another's miss would leave the other waiting in the profile's
collectives.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mutwo.ir.graph import Graph
from mutwo.ir.pass_base import AnalysisCache, Pass, PassContext, write_atomic
from mutwo.ir.pass_manager import Instrumentation, PassManager, PipelineFailure, PipelineResult
from mutwo.ir.timeline import TransferModel
from mutwo.passes.chunk import ChunkPass, ChunkReport
from mutwo.passes.optimizer_schedule import ScheduleOutcome, SchedulingPass
from mutwo.passes.profile import ProfilePass
from mutwo.passes.select import Plan, SelectPass
from mutwo.passes.select_swap import SelectSwapPass, SwapPlan
from mutwo.runtime.measurement.profiler import Profile
from mutwo.runtime.planning.captured import PROFILE_STORE, CapturedGraph
from mutwo.runtime.planning.collector import collection_paused
from mutwo.runtime.planning.held_ratio_cache import HeldRatios
from mutwo.runtime.planning.kept_files import read_kept
from mutwo.runtime.planning.peak_calibration import pipeline_plan
from mutwo.runtime.planning.plan_choice import RECOMPUTE_ONLY, recompute_only_passes
from mutwo.runtime.planning.plan_key import FORMAT, key_digest, pass_source_digest, plan_key
from mutwo.runtime.planning.profile_cache import ProfileStore

#: ``cache=`` of :func:`mutwo.optimize`: None (the default folder, unless ``MUTWO_CACHE`` is off),
#: True (the default folder), False (off), or a folder.
CacheOption = bool | str | os.PathLike[str] | None
#: Values of ``MUTWO_CACHE`` that turn the default off.
OFF = ("0", "off", "false", "no")
#: What an entry keeps, each by its artifact name with the class that reads its JSON back.
ARTIFACTS: dict[str, Any] = {"profile": Profile, "plan": Plan, "swap-plan": SwapPlan, "transfer": TransferModel,
                             "chunk": ChunkReport, "optimizer-in-backward": ScheduleOutcome,
                             "foreach-buckets": ScheduleOutcome}  # fmt: skip
#: The passes whose work a hit skips: what makes the profile, and the policies that make a plan.
PROFILES, POLICIES = (ProfilePass,), (SelectPass, SelectSwapPass)


def cache_folder(option: CacheOption = None) -> Path | None:
    """The cache's folder for ``option`` (:data:`CacheOption`); None when it is off."""
    if option is False:
        return None
    if option is not None and option is not True:
        return Path(option).expanduser()
    if option is None and os.environ.get("MUTWO_CACHE", "").strip().lower() in OFF:
        return None
    given = os.environ.get("MUTWO_CACHE_DIR")
    if given:
        return Path(given).expanduser()
    # The XDG base directory spec: a relative XDG_CACHE_HOME is invalid and ignored.
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache") / "mutwo"


def uncacheable(passes: Sequence[Pass]) -> str | None:
    """Why the plan of this pipeline is not kept (None: it is): a hit skips one profile pass and
    one of mutwo's selection passes after it; a pipeline without them has nothing to skip, and a
    policy of one's own makes a plan whose file this cache cannot read."""
    profiles = [i for i, p in enumerate(passes) if isinstance(p, PROFILES)]
    policies = [i for i, p in enumerate(passes) if isinstance(p, POLICIES)]
    own = [p.name for p in passes if not isinstance(p, POLICIES) and {"plan", "swap-plan"} & set(type(p).provides)]
    if own:
        return f"the pipeline's plan is made by {own[0]}, not by select or select-swap"
    if len(profiles) != 1 or len(policies) != 1 or profiles[0] > policies[0]:
        return "the pipeline does not run one profile followed by one select or select-swap"
    unread = [p.name for p in passes if not type(p).__module__.startswith("mutwo.") and pass_source_digest(p) is None]
    if unread:  # a change to its code would not change the key
        return f"pass {unread[0]} has no source file to read (defined in a notebook or at the prompt)"
    return None


@dataclass
class Entry:
    """What a cache entry holds: the artifacts of the compiled plan (its profile and plan), whether
    the measured choice kept recompute only, and what the miss recorded (calibration, choice, setup
    seconds), for the log and reports."""

    artifacts: dict[str, Any]
    recompute_only: bool = False
    calibration: dict[str, Any] | None = None
    choice: dict[str, Any] | None = None
    setup_seconds: dict[str, float] = field(default_factory=dict)

    def to_json(self, key: dict[str, Any]) -> dict[str, Any]:
        return {"format": FORMAT, "key": key, "recompute_only": self.recompute_only,
                "artifacts": {name: artifact.to_json() for name, artifact in self.artifacts.items()},
                "calibration": self.calibration, "choice": self.choice,
                "setup_seconds": self.setup_seconds}  # fmt: skip

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Entry:
        artifacts = {name: ARTIFACTS[name].from_json(value) for name, value in data["artifacts"].items()}
        return cls(artifacts, bool(data["recompute_only"]), data.get("calibration"), data.get("choice"),
                   dict(data.get("setup_seconds") or {}))  # fmt: skip

    def passes(self, pipeline: Sequence[Pass]) -> list[Pass]:
        """The pipeline a hit runs: ``pipeline`` (or, when the measured choice kept recompute only,
        its recompute-only form) without the profile and the policy, whose artifacts this holds,
        with ``chunk`` slicing as it did for the kept plan (:meth:`ChunkPass.replaying`) and the
        optimizer-scheduling passes doing what they did, untried (:meth:`SchedulingPass.replaying`)."""
        planning = recompute_only_passes(pipeline) if self.recompute_only else list(pipeline)
        # an entry keeps one record per pass name, the last run's: a pass listed twice decides again
        listed = Counter(p.name for p in planning)
        replayed = [self._replaying(p) if listed[p.name] == 1 else p for p in planning]
        return [p for p in replayed if p is not None and not isinstance(p, PROFILES + POLICIES)]

    def _replaying(self, pass_: Pass) -> Pass | None:
        decided = self.artifacts.get(pass_.name)
        if isinstance(pass_, ChunkPass) and isinstance(decided, ChunkReport):
            return pass_.replaying(decided)
        if isinstance(pass_, SchedulingPass) and isinstance(decided, ScheduleOutcome):
            return pass_.replaying(decided)
        return pass_

    def missing(self, pipeline: Sequence[Pass]) -> str | None:
        """What the replayed pipeline needs that the entry lacks (None: nothing)."""
        swaps = not self.recompute_only and any(isinstance(p, SelectSwapPass) for p in pipeline)
        needed = ("profile", "swap-plan" if swaps else "plan")
        absent = [name for name in needed if name not in self.artifacts]
        return f"it holds no {absent[0]}" if absent else None


class PlanCache:
    """The entries under a folder: read (:meth:`load`) and written (:meth:`store`) by key."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def path(self, digest: str) -> Path:
        return self.folder / "plans" / f"{digest}.json"

    def load(self, key: dict[str, Any]) -> tuple[Entry | None, str | None]:
        """The entry kept under ``key``, or None with why it was ignored (None when there is none)."""
        return read_kept(self.path(key_digest(key)), key, Entry.from_json, "an entry")

    def store(self, key: dict[str, Any], entry: Entry) -> Path:
        """Keep ``entry`` under ``key``, atomically (a temporary file renamed into place)."""
        return write_atomic(self.path(key_digest(key)), json.dumps(entry.to_json(key)))


@dataclass
class CachedPlanning:
    """One planning's use of the cache: its key, and the entry found under it (a hit) or not.
    ``cache`` is None where the cache is off or does not apply (then it runs the whole pipeline
    and keeps nothing). ``log`` takes its lines (hit, miss, an entry ignored), unprefixed."""

    cache: PlanCache | None = None
    key: dict[str, Any] | None = None
    entry: Entry | None = None
    log: Callable[[str], None] = lambda message: None

    @classmethod
    def begin(cls, option: CacheOption, lowered: CapturedGraph, pipeline: Sequence[Pass], settings: dict[str, Any],
              device_memory: int | None, log: Callable[[str], None],
              data_parallel: bool = False) -> CachedPlanning:  # fmt: skip
        """Look the plan of ``lowered`` up (as captured, before any pass); say in one line whether
        it was found (naming the key's short hash), or why it is not looked up."""
        folder = cache_folder(option)
        if folder is None:
            return cls(log=log)
        reason = "data-parallel ranks plan together" if data_parallel else uncacheable(pipeline)
        if reason is not None:
            log(f"plan cache not used: {reason}")
            return cls(log=log)
        cache = PlanCache(folder)
        key = json.loads(json.dumps(plan_key(lowered, pipeline, settings, device_memory)))  # as an entry holds it
        entry, ignored = cache.load(key)
        planning = cls(cache, key, entry, log)
        if entry is not None:
            missing = entry.missing(pipeline)
            if missing is None:
                skipped = [p.name for p in pipeline if isinstance(p, PROFILES + POLICIES)]
                skipped += [name for name, asked in (("calibration", settings.get("calibration_rounds")),
                                                     ("the measured choice", settings.get("measure_choice"))) if asked]
                saved = entry.setup_seconds.get("total")
                log(f"plan cache hit {planning.short}: skipping {', '.join(skipped)}, their profile and plan "
                    f"from {cache.path(key_digest(key))}"
                    + (f" (setup took {saved:.1f} s when it was made)" if saved is not None else ""))  # fmt: skip
                return planning
            planning.entry, ignored = None, missing
        if ignored is not None:
            log(f"plan cache: ignoring entry {planning.short} ({ignored}); planning again and replacing it")
        else:
            log(f"plan cache miss {planning.short}: planning, then keeping the plan in {folder}")
        return planning

    @property
    def hit(self) -> bool:
        return self.entry is not None

    @property
    def keeps(self) -> bool:
        """Whether the plan made now is to be kept (:meth:`keep`): the cache is used, and this is a miss."""
        return self.cache is not None and self.key is not None and self.entry is None

    @property
    def short(self) -> str:
        """The key's short hash, as the log names it."""
        return key_digest(self.key)[:12] if self.key is not None else ""

    def run(self, pipeline: Sequence[Pass], graph: Graph, context: PassContext,
            instrumentation: Instrumentation | None = None) -> tuple[Graph, PassContext, PipelineResult]:  # fmt: skip
        """Run the pipeline on ``graph``: on a hit without its profile and policy, from the entry's
        artifacts, on a copy in a context of its own (both returned); when that fails (the entry
        does not fit this graph after all), the whole pipeline on ``graph`` in ``context``, which
        is then what a miss keeps. ``profile.json`` and the plan's files go to the output folder."""
        if self.entry is not None:
            try:
                with collection_paused():  # a replay runs no profile: it only rewrites the IR
                    replayed = dataclasses.replace(context, artifacts={**context.artifacts, **self.entry.artifacts},
                                                   analyses=AnalysisCache())  # fmt: skip
                    self._write_files(replayed)  # a failure below writes them again, from the passes
                    copy = graph.copy()
                    # each pass was verified on this graph when the entry was made; a failure at
                    # the end plans again below, verifying pass by pass
                    once = dataclasses.replace(instrumentation or Instrumentation(), verify_once=True)
                    return copy, replayed, PassManager(self.passes(pipeline), once).run(copy, replayed)
            except PipelineFailure as failure:
                if failure.crashed:  # a bug or the device out of memory, not an entry that does not fit
                    raise
                self.log(f"plan cache: entry {self.short} does not apply "
                         f"({str(failure).splitlines()[0]}); planning again and replacing it")  # fmt: skip
                self.entry = None
        if self.cache is not None and self.key is not None:  # a miss: a profile another start made may serve
            context.services[PROFILE_STORE] = ProfileStore(self.cache.folder, self.key, self.log)
        return graph, context, PassManager(pipeline, instrumentation).run(graph, context)

    @property
    def held_ratios(self) -> HeldRatios | None:
        """Where what this graph's steps held over their simulated peaks is kept; None where the
        cache is not used."""
        if self.cache is None or self.key is None:
            return None
        return HeldRatios(self.cache.folder, self.key, self.log)

    def held_ratio(self) -> float | None:
        """On a miss, the ratio of held to simulated bytes earlier calibrations of this graph
        measured (:mod:`~mutwo.runtime.planning.held_ratio_cache`), for the first plan's aim; else None."""
        ratios = self.held_ratios
        return ratios.ratio() if ratios is not None and not self.hit else None

    def passes(self, pipeline: Sequence[Pass]) -> list[Pass]:
        """The passes :meth:`run` runs: on a hit, the pipeline without what the entry holds."""
        return self.entry.passes(pipeline) if self.entry is not None else list(pipeline)

    def _write_files(self, context: PassContext) -> None:
        """What the skipped passes write into the output folder, from the entry: profile.json and
        the plan's JSON and CSV (logged as select logs it)."""
        assert self.entry is not None
        if context.out_dir is not None:  # a large profile's JSON is costly to build, and nothing reads it
            context.save_json("profile.json", self.entry.artifacts["profile"].to_json())
        for name, stem, maker in (("plan", "plan", "select"), ("swap-plan", "swap_plan", "select-swap")):
            plan = self.entry.artifacts.get(name)
            if plan is not None:
                plan.publish(context, name, stem, f"{maker} (from the plan cache)")

    def keep(self, context: PassContext, *, calibration: dict[str, Any] | None, choice: dict[str, Any] | None,
             setup_seconds: dict[str, float]) -> Path | None:  # fmt: skip
        """After a miss, keep the plan that was compiled (``context``'s, the kept round's after
        calibration) with what made it; nothing on a hit, for a plan that misses its budget, or when
        the folder cannot be written (said in one line: training goes on)."""
        if not self.keeps:
            return None
        assert self.cache is not None and self.key is not None
        held = self.held_ratios
        if held is not None:  # what the rounds held, whichever is kept
            held.keep(calibration)
        plan = pipeline_plan(context.artifacts)
        if plan is None or not plan.met or "profile" not in context.artifacts:
            return None
        artifacts = {name: context.artifacts[name] for name in ARTIFACTS if name in context.artifacts}
        recompute_only = choice is not None and choice.get("kept") == RECOMPUTE_ONLY
        if recompute_only:  # the swap pipeline's artifacts describe the plan weighed and not kept
            artifacts.pop("swap-plan", None)
        entry = Entry(artifacts, recompute_only, calibration, choice, setup_seconds)
        try:
            return self.cache.store(self.key, entry)
        except OSError as error:
            self.log(f"plan cache: could not keep the plan in {self.cache.folder} ({error.strerror or error}); "
                     "the next process will plan again")  # fmt: skip
            return None

    def describe(self) -> dict[str, Any] | None:
        """The cache's part of a run's record (summary.json): hit or miss, the key's hash and the entry's
        file; None where the cache was not used."""
        if self.cache is None or self.key is None:
            return None
        described: dict[str, Any] = {"hit": self.hit, "key": key_digest(self.key),
                                     "entry": str(self.cache.path(key_digest(self.key)))}  # fmt: skip
        if self.entry is not None:
            described.update(calibration=self.entry.calibration, measured_choice=self.entry.choice,
                             setup_seconds_when_planned=self.entry.setup_seconds)  # fmt: skip
        return described
