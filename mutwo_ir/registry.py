"""The pass registry: built-in passes loaded lazily, aliases, and users' passes.

Users' passes are found through the ``mutwo.passes`` entry-point group (each entry point names
a Pass subclass, ``my_package.passes:MyPass``) and through :meth:`PassRegistry.load`, behind
``mutwo-opt --load-passes MODULE_OR_FILE``, which registers every Pass subclass with a name
defined in that module or file.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path

from mutwo.ir.pass_base import KEBAB, Pass, PassOptionError
from mutwo.ir.pipeline import PipelineItem, parse_pipeline

ENTRY_POINT_GROUP = "mutwo.passes"

#: Built-in passes: name -> "module:Class", imported only when used.
BUILTIN_PASSES: dict[str, str] = {
    "stats": "mutwo.passes.stats:StatsPass",
    "dce": "mutwo.passes.dce:DeadCodeEliminationPass",
    "liveness": "mutwo.passes.liveness:LivenessPass",
    "memory": "mutwo.passes.memory:MemoryPass",
    "profile": "mutwo.passes.profile:ProfilePass",
    "chunk": "mutwo.passes.chunk:ChunkPass",
    "select": "mutwo.passes.select:SelectPass",
    "extract": "mutwo.passes.extract:ExtractPass",
    "insert-recompute": "mutwo.passes.insert_recompute:InsertRecomputePass",
    "share-gathers": "mutwo.passes.share_gathers:ShareGathersPass",
    "optimizer-in-backward": "mutwo.passes.optimizer_in_backward:OptimizerInBackwardPass",
    "foreach-buckets": "mutwo.passes.foreach_buckets:ForeachBucketsPass",
    "select-swap": "mutwo.passes.select_swap:SelectSwapPass",
    "insert-swap": "mutwo.passes.insert_swap:InsertSwapPass",
}

#: Names that stand for several passes.
BUILTIN_ALIASES: dict[str, tuple[str, ...]] = {
    "rewrite": ("extract", "insert-recompute", "share-gathers"),
    "optimizer": ("optimizer-in-backward", "foreach-buckets"),  # each applies only where the peak drops
    "swap": ("select-swap", "insert-swap"),  # keep, recompute or swap each activation, then rewrite
}


class RegistryError(ValueError):
    """An unknown pass, a bad option, an unmet requirement, or a pass that cannot be loaded."""


class PassRegistry:
    """Pass names to classes, with lazy loading."""

    def __init__(self, builtins: bool = True) -> None:
        self._loaders: dict[str, Callable[[], type[Pass]]] = {}
        self._classes: dict[str, type[Pass]] = {}
        self.aliases: dict[str, tuple[str, ...]] = dict(BUILTIN_ALIASES) if builtins else {}
        self._loaded_files: dict[Path, list[str]] = {}  #: resolved path -> the passes it registered
        if builtins:
            for name, target in BUILTIN_PASSES.items():
                self._loaders[name] = _lazy(target)
            for entry in entry_points(group=ENTRY_POINT_GROUP):
                self._loaders.setdefault(entry.name, entry.load)
            self._classes.update(_DECORATED)

    # -- registration ----------------------------------------------------------------------
    def register(self, cls: type[Pass]) -> type[Pass]:
        """Register a Pass subclass under its ``name``; usable as a decorator."""
        if not (inspect.isclass(cls) and issubclass(cls, Pass)):
            raise RegistryError(f"{cls!r} is not a subclass of mutwo.ir.pass_base.Pass")
        if not KEBAB.match(cls.name or ""):
            raise RegistryError(f"pass class {cls.__name__} has name {cls.name!r}; a pass name is kebab-case, "
                                "like 'my-pass'")  # fmt: skip
        existing = self._classes.get(cls.name)
        if (existing is not None and existing is not cls) or (existing is None and cls.name in self._loaders):
            source = _source_file(cls)
            if existing is not None and source is not None and source == _source_file(existing):
                raise RegistryError(f"pass '{cls.name}' was loaded twice from {source}, as {existing.__module__} "
                                    f"and as {cls.__module__}; give it once to --load-passes")  # fmt: skip
            where = existing.__module__ if existing is not None else "a built-in or installed pass"
            raise RegistryError(f"two passes are named '{cls.name}': {where} and {cls.__module__}; rename yours")
        self._classes[cls.name] = cls
        self._loaders.pop(cls.name, None)
        return cls

    def load(self, module_or_file: str) -> list[str]:
        """Import a module (``pkg.mod``) or a Python file and register the passes it defines.
        A file loaded before (the same file under any path) is not loaded again."""
        path = Path(module_or_file)
        try:
            if module_or_file.endswith(".py") or path.exists():
                if not path.is_file():
                    raise RegistryError(f"--load-passes: no such file: {module_or_file}")
                if path.resolve() in self._loaded_files:
                    return self._loaded_files[path.resolve()]
                spec = importlib.util.spec_from_file_location(f"mutwo_user_passes_{path.stem}", path)
                assert spec is not None and spec.loader is not None
                module = importlib.util.module_from_spec(spec)
                sys.modules[spec.name] = module
                spec.loader.exec_module(module)
            else:
                module = importlib.import_module(module_or_file)
        except RegistryError:
            raise
        except Exception as error:
            hint = ""
            if isinstance(error, ModuleNotFoundError) and error.name == module_or_file.split(".")[0]:
                file = module_file(module_or_file, [Path.cwd()])
                hint = (f"; to load the file {file}, give its path: --load-passes {file}" if file is not None else
                        "; give the path of a .py file (--load-passes my_passes.py) or a module installed in this "
                        "environment")  # fmt: skip
            raise RegistryError(f"--load-passes {module_or_file}: importing it failed: "
                                f"{type(error).__name__}: {error}{hint}") from None  # fmt: skip
        file = Path(module.__file__).resolve() if getattr(module, "__file__", None) else None
        if file in self._loaded_files:  # a module already loaded as a file, or the other way round
            return self._loaded_files[file]
        found = [obj for obj in vars(module).values()
                 if inspect.isclass(obj) and issubclass(obj, Pass) and obj.__module__ == module.__name__ and obj.name]
        if not found:
            raise RegistryError(f"--load-passes {module_or_file}: it defines no Pass subclass with a name")
        names = [self.register(cls).name for cls in found]
        if file is not None:
            self._loaded_files[file] = names
        return names

    # -- lookup ----------------------------------------------------------------------------
    def names(self) -> list[str]:
        return sorted(set(self._loaders) | set(self._classes))

    def get(self, name: str) -> type[Pass]:
        if name not in self._classes:
            loader = self._loaders.get(name)
            if loader is None:
                raise RegistryError(self._unknown(name))
            try:
                cls = loader()
            except Exception as error:  # a broken plugin must not take every run down with a traceback
                raise RegistryError(f"pass '{name}' could not be loaded: {type(error).__name__}: {error}") from None
            if not (inspect.isclass(cls) and issubclass(cls, Pass)):
                raise RegistryError(f"pass '{name}' does not name a Pass subclass")
            if cls.name != name:
                raise RegistryError(f"pass registered as '{name}' calls itself '{cls.name}'")
            self._classes[name] = cls
        return self._classes[name]

    def _unknown(self, name: str) -> str:
        valid = self.names() + sorted(self.aliases)
        close = difflib.get_close_matches(name, valid, n=1)
        hint = f"did you mean '{close[0]}'? " if close else "passes of your own need --load-passes FILE; "
        return f"unknown pass '{name}'; {hint}valid passes: {', '.join(sorted(valid))}"

    # -- pipelines -------------------------------------------------------------------------
    def build_pipeline(self, text: str, available: set[str] | frozenset[str] = frozenset()) -> list[Pass]:
        """Parse, expand aliases, build every pass with its options, and check requirements.

        ``available`` names the artifacts that exist before the first pass (for example a
        profile loaded from a file). Everything is checked before anything runs.
        """
        try:
            items = parse_pipeline(text)
        except ValueError as error:
            raise RegistryError(f"bad pipeline: {error}") from None
        expanded: list[PipelineItem] = []
        for item in items:
            if item.name in self.aliases:
                if item.options:
                    raise RegistryError(f"'{item.name}' is an alias for {','.join(self.aliases[item.name])} and "
                                        "takes no options; give options to those passes instead")  # fmt: skip
                expanded += [PipelineItem(name, {}) for name in self.aliases[item.name]]
            else:
                expanded.append(item)
        passes: list[Pass] = []
        have = set(available)
        for item in expanded:
            cls = self.get(item.name)
            try:
                instance = cls.from_options(item.options)
            except PassOptionError as error:
                raise RegistryError(str(error)) from None
            missing = [r for r in cls.requires if r not in have]
            if missing:
                providers = sorted(n for n in self.names() if set(missing) & set(self.get(n).provides))
                hint = f"; run {' or '.join(providers)} before it" if providers else ""
                raise RegistryError(f"pass '{cls.name}' needs {', '.join(missing)}, which no earlier pass "
                                    f"provides{hint}")  # fmt: skip
            have.update(cls.provides)
            passes.append(instance)
        return passes

    def describe_all(self) -> str:
        """Every pass with its summary and options, and the aliases: the ``--list-passes`` text."""
        lines = []
        for name in self.names():
            cls = self.get(name)
            kind = "transform" if cls.is_transform else "analysis"
            lines.append(f"{name:<18} [{kind}] {cls.summary()}")
            for opt in cls.options():
                lines.append(f"    {opt.name}: {opt.type_name} = {opt.default!r}  {opt.help}")
        for alias, targets in sorted(self.aliases.items()):
            lines.append(f"{alias:<18} [alias] {','.join(targets)}")
        return "\n".join(lines)


#: Passes registered with :func:`register_pass`: part of every registry built with ``builtins=True``.
_DECORATED: dict[str, type[Pass]] = {}


def register_pass(cls: type[Pass]) -> type[Pass]:
    """Make a Pass subclass available to every pipeline of this process; a class decorator.

    ``@mutwo.register_pass`` on a pass defined in your own code lets ``mutwo.optimize(...,
    passes="...,my-pass")`` and in-process ``mutwo-opt`` runs name it. It is refused, like
    :meth:`PassRegistry.register` refuses it, when it is not a Pass subclass, its name is not
    kebab-case, or another pass already has that name.
    """
    PassRegistry().register(cls)
    _DECORATED[cls.name] = cls
    return cls


def module_file(module: str, folders: list[Path]) -> Path | None:
    """The file ``pkg/mod.py`` that a dotted module name would be, in the first of ``folders``
    holding it (as written, relative to the current folder where it is under it); None if none does.
    What to suggest when a module name is given where a file path is expected."""
    for folder in folders:
        candidate = folder / (module.replace(".", "/") + ".py")
        if candidate.is_file():
            try:
                return candidate.relative_to(Path.cwd())
            except ValueError:
                return candidate
    return None


def _source_file(cls: type) -> Path | None:
    try:
        source = inspect.getsourcefile(cls)
    except TypeError:
        return None
    return Path(source).resolve() if source else None


def _lazy(target: str) -> Callable[[], type[Pass]]:
    module_name, _, class_name = target.partition(":")

    def load() -> type[Pass]:
        return getattr(importlib.import_module(module_name), class_name)

    return load
