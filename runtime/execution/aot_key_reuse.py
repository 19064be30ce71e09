"""AOTAutograd's cache key of a compiled step, kept under a cheaper key of mutwo's, so that a
restart loads the step from torch's caches without computing that key again.

A restart from the plan cache compiles a graph torch's caches already hold. Before they answer,
AOTAutograd computes its cache key: it pickles the whole-iteration graph (renaming and regenerating
it first), hashes the installed Triton's files, and in torch 2.11 builds the key's debug text
whether it is logged or not. Sampled in restarts of ResNet-152-cl b128 on an H200 (commit
671d719, ``bench/results/session31_h200/before/``), that took 1.5-1.8 s of a 4-5 s compile.

Everything that key covers is cheaper to read than to pickle: the graph's text (each node's op,
name, target and operands, from which AOTAutograd pickles its code), the inputs' layouts,
Inductor's and AOTAutograd's options (their portable form, as torch's key reads them) and custom
passes (their ``uuid()``, as torch's key reads them), the process's numeric settings (grad mode,
autocast, deterministic algorithms, default dtype, matmul precision) and the versions of torch,
CUDA and Triton with the device's name. :func:`reused_key` hashes those into mutwo's key; the
first compile under it records the key AOTAutograd computed, in a file under torch's cache folder
(``TORCHINDUCTOR_CACHE_DIR``, so it goes where and when the artifacts it points to go); a later
compile with the same mutwo key hands AOTAutograd that key instead of letting it compute one.
torch then loads as it does on any hit: its guards, its FX graph cache and its wrappers run
unchanged.

mutwo's key is stricter than torch's, never looser: the graph's text names its placeholders, and
mutwo's own source digest is part of it. Making it leaves the module as it was: torch's key
pickles the module's attributes in the order they were set, so even regenerating a lazy module's
code earlier than torch does changes torch's key (measured on an H200: restarts that let torch
compute its key then missed the entry the first start stored, and traced the step again, 13-26
s). Where it cannot be made (a graph holding tensor constants, whose values torch's key hashes; an
option whose text names an object's address; a custom pass without ``uuid()``; torch's caches
off) nothing is reused and torch computes its key as before. A reused key whose entry has gone
from torch's cache is a miss like any other: the step is compiled and stored under that key
again.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch
from torch import fx

from mutwo.ir.pass_base import write_atomic
from mutwo.runtime.execution.source_digest import source_digest

#: Bumped when what :func:`mutwo_key` covers changes: keys recorded before are then never read.
FORMAT = 1
#: Inductor's options that name custom passes: torch's key reads each one's ``uuid()``.
CUSTOM_PASS_OPTIONS = ("pre_grad_custom_pass", "post_grad_custom_pre_pass", "post_grad_custom_post_pass",
                       "joint_custom_pre_pass", "joint_custom_post_pass", "_pre_fusion_custom_pass",
                       "_post_fusion_custom_pass", "_fuse_ddp_communication_passes")  # fmt: skip
#: What an object's default text looks like: such a value differs in every process.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
#: A custom pass torch's key cannot read (no ``uuid()``).
_OPAQUE = "<opaque>"
#: The module whose ``autograd_cache_key`` AOTAutograd's cache calls by its global name.
_CACHE_MODULE = "torch._functorch._aot_autograd.autograd_cache"


@dataclass
class KeyReuse:
    """One compile's use of the index: mutwo's key (None where none can be made, with why), the
    AOTAutograd key it found recorded, and the keys AOTAutograd computed during the compile."""

    mutwo_key: str | None
    reason: str | None = None
    recorded: str | None = None
    computed: list[str] = field(default_factory=list)
    #: whether AOTAutograd was handed the recorded key rather than computing the step's
    reused: bool = False


def index_folder() -> Path:
    """Where the recorded keys live: under torch's cache folder, beside the artifacts they name."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "mutwo" / "aot-keys"


def mutwo_key(module: fx.GraphModule, inputs: Sequence[torch.Tensor]) -> tuple[str | None, str | None]:
    """mutwo's key of compiling ``module`` for ``inputs`` under the options in force now, or None
    with why none can be made. Call it where the compile runs: inside the same option patches."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    if not _local_caches_on():
        return None, "torch's compile caches are off"
    constants = [node.target for node in module.graph.nodes if node.op == "get_attr"]
    if constants:
        return None, f"the graph holds a constant ({constants[0]}), whose value torch's key hashes"
    passes = {name: _pass_detail(getattr(inductor_config, name, None)) for name in CUSTOM_PASS_OPTIONS}
    opaque = [name for name, detail in passes.items() if detail is _OPAQUE]
    if opaque:
        return None, f"Inductor's {opaque[0]} names a pass without uuid()"
    comms = _optional_config("torch._inductor.config_comms")
    described = {
        "format": FORMAT,
        # the graph's text, not ``module.code``: reading that regenerates a lazy module's code, which
        # reorders the attributes torch's key pickles, and so changes torch's own key
        "graph": hashlib.sha256(str(module.graph).encode()).hexdigest(),
        "inputs": [_layout(t) for t in inputs],
        "inductor": _portable(inductor_config),
        "inductor_comms": _portable(comms) if comms is not None else None,
        "functorch": _portable(functorch_config),
        "custom_passes": passes,
        "state": _numeric_state(),
        "system": _system(inputs),
        "mutwo": source_digest(),
    }
    text = json.dumps(described, sort_keys=True, default=_stable_text)
    where = _ADDRESS.search(text)
    if where is not None:
        start = max(0, where.start() - 60)
        return None, f"an option's text names an object's address ({text[start:where.end()]!r})"
    return hashlib.sha256(text.encode()).hexdigest()[:40], None


@contextmanager
def reused_key(module: fx.GraphModule, inputs: Sequence[torch.Tensor]) -> Iterator[KeyReuse]:
    """Around one ``compile_fx`` of ``module``: hand AOTAutograd the key recorded under mutwo's
    key, or record the one it computes (when it computes exactly one and the compile returns)."""
    key, reason = mutwo_key(module, inputs)
    reuse = KeyReuse(key, reason)
    if key is None:
        yield reuse
        return
    import importlib

    cache_module = importlib.import_module(_CACHE_MODULE)
    compute: Callable[..., tuple[str, list[str]]] | None = getattr(cache_module, "autograd_cache_key", None)
    if compute is None:  # a torch without it: nothing to hand over
        reuse.mutwo_key, reuse.reason = None, "this torch's AOTAutograd cache has no autograd_cache_key"
        yield reuse
        return
    path = index_folder() / f"{key}.key"
    try:
        reuse.recorded = path.read_text(encoding="utf-8").strip() or None
    except OSError:
        reuse.recorded = None

    def handed(*args: Any, **kwargs: Any) -> tuple[str, list[str]]:
        # A key is recorded only from a compile that computed one key, so the first call is the
        # step's; any further one (a graph of another kind) computes its own.
        if reuse.recorded is not None and not reuse.reused:
            reuse.reused = True
            return reuse.recorded, []
        computed = compute(*args, **kwargs)
        reuse.computed.append(computed[0])
        return computed

    cache_module.autograd_cache_key = handed  # type: ignore[attr-defined]
    try:
        yield reuse
    finally:
        cache_module.autograd_cache_key = compute  # type: ignore[attr-defined]
    if reuse.recorded is None and len(reuse.computed) == 1:
        try:
            write_atomic(path, reuse.computed[0])
        except OSError:  # a read-only cache folder: the next start computes the key, as torch does
            pass


def _pass_detail(custom: Any) -> Any:
    """A custom-pass option as torch's key reads it: each pass's ``uuid()``, a name as it is;
    :data:`_OPAQUE` for a pass without ``uuid()``, which torch's cache refuses to key."""
    if not custom:
        return None
    if isinstance(custom, (list, tuple)):
        details = [_pass_detail(c) for c in custom]
        return _OPAQUE if _OPAQUE in details else details
    if isinstance(custom, str):
        return custom
    uuid = getattr(custom, "uuid", None)
    return repr(uuid()) if callable(uuid) else _OPAQUE


def _local_caches_on() -> bool:
    from torch._inductor import config as inductor_config

    try:
        from torch._functorch._aot_autograd.autograd_cache import should_use_local_autograd_cache
    except ImportError:
        return False
    return bool(should_use_local_autograd_cache() and inductor_config.fx_graph_cache)


def _optional_config(name: str) -> Any:
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _portable(config: Any) -> dict[str, Any]:
    """A config module's options as torch's cache key reads them (its portable form)."""
    return dict(config.save_config_portable())


def _stable_text(value: Any) -> Any:
    """JSON for what ``json`` cannot write, the same in every process: sets in sorted order,
    functions and classes by their qualified names, anything else by its text."""
    if isinstance(value, (set, frozenset)) or type(value).__name__ == "OrderedSet":
        return sorted(repr(v) for v in value)
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    return repr(value)


def _layout(tensor: torch.Tensor) -> str:
    return (f"{tensor.dtype}{list(tensor.shape)}/{list(tensor.stride())}+{tensor.storage_offset()}"
            f"@{tensor.device}{'~grad' if tensor.requires_grad else ''}")  # fmt: skip


def _numeric_state() -> dict[str, Any]:
    """The process's settings that torch's key reads besides the options."""
    matmul = torch.backends.cuda.matmul
    autocast = {}
    for device_type in ("cpu", "cuda"):
        if torch.is_autocast_enabled(device_type):
            autocast[device_type] = str(torch.get_autocast_dtype(device_type))
    return {
        "grad": torch.is_grad_enabled(),
        "autocast": autocast,
        "deterministic": [torch.are_deterministic_algorithms_enabled(),
                          torch.is_deterministic_algorithms_warn_only_enabled(),
                          bool(getattr(torch.utils.deterministic, "fill_uninitialized_memory", False))],
        "default_dtype": str(torch.get_default_dtype()),
        "matmul": [str(getattr(matmul, "fp32_precision", "")), matmul.allow_tf32,
                   matmul.allow_fp16_reduced_precision_reduction, matmul.allow_bf16_reduced_precision_reduction],
        "threads": torch.get_num_threads(),
        "tag": str(getattr(getattr(torch.compiler, "config", None), "cache_key_tag", "")),
    }  # fmt: skip


def _system(inputs: Sequence[torch.Tensor]) -> dict[str, Any]:
    """The versions and devices torch's key reads (it hashes Triton's files; its version stands in)."""
    devices = sorted({str(t.device) for t in inputs})
    cards = [torch.cuda.get_device_properties(torch.device(d)).name for d in devices if d.startswith("cuda")]
    triton = None
    for distribution in ("triton", "pytorch-triton"):
        try:
            triton = version(distribution)
            break
        except PackageNotFoundError:
            continue
    return {"torch": torch.__version__, "git": torch.version.git_version, "cuda": torch.version.cuda,
            "triton": triton, "devices": devices, "cards": cards}  # fmt: skip
