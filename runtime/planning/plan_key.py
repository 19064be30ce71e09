"""What a step's plan depends on, as the plan cache's key (:mod:`mutwo.runtime.planning.plan_cache`).

A cached plan may be used again only where planning would make the same plan, so the key holds
everything planning reads and nothing that changes from one process to the next (object ids,
addresses, times, paths):

- the captured graph: its text IR (every node's op, operands and scalar arguments, kind, phase,
  shape, dtype, bytes and aliasing, the inputs' kinds and labels) and, from the captured fx
  graph, every value's strides, storage offset and device, which the IR text does not show;
- the device: the card's name, memory, compute capability, CUDA/cuDNN versions, whether the
  allocator maps expandable segments and the settings that choose its kernels (TF32, cuDNN's
  autotuning, deterministic algorithms, cuBLAS's workspace) (on the CPU: the machine, its cores and
  torch's threads), and what the process may hold on it;
- the run's settings: budget, memory limit, backend, calibration rounds, measured choice,
  ``keep_grads`` and precision;
- the pipeline: every pass's class and options (for a pass that is not mutwo's, a digest of its
  source file, whose code may change without a version);
- torch's version, mutwo's version and a digest of mutwo's own source (``ir``, ``passes``,
  ``runtime``): a development checkout changes its code without changing its version.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import json
import os
import platform
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch

import mutwo.ir
import mutwo.passes
from mutwo.ir.budget import Budget
from mutwo.ir.pass_base import Pass
from mutwo.ir.printer import print_graph
from mutwo.runtime.measurement.expandable_segments import expandable_segments_on
from mutwo.runtime.planning.captured import CapturedGraph

#: Bumped when the key or the entry changes shape: entries of another format are never read.
FORMAT = 1
#: The folders of mutwo whose code decides a plan (tools only run it).
_RUNTIME = Path(__file__).resolve().parents[1]


def plan_key(lowered: CapturedGraph, passes: Sequence[Pass], settings: dict[str, Any],
             device_memory: int | None) -> dict[str, Any]:  # fmt: skip
    """The key of the plan of ``lowered`` (as captured, before any pass) made by ``passes`` with
    ``settings`` (:func:`run_settings`); ``device_memory``: what the process may hold on the
    device (select's default budget). Only JSON values, so that an entry can hold it to compare."""
    return {
        "format": FORMAT,
        "graph": graph_digest(lowered),
        "device": device_description(lowered.device),
        "device_memory": device_memory,
        "settings": settings,
        "pipeline": [pass_description(p) for p in passes],
        "torch": torch.__version__,
        "mutwo": mutwo_version(),
        "mutwo_source": source_digest(),
    }


def key_digest(key: dict[str, Any]) -> str:
    """The key's hash: the entry's file name (its first 12 characters name it in the log)."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]


def run_settings(*, budget: Budget | None, memory_limit: int | None, backend: str, calibration_rounds: int,
                 measure_choice: bool, keep_grads: bool, precision: str) -> dict[str, Any]:  # fmt: skip
    """The settings of a run that planning reads, as the API and mutwo-opt both give them, so that
    either can use a plan the other made."""
    return {"budget": dataclasses.asdict(budget) if budget is not None else None, "memory_limit": memory_limit,
            "backend": backend, "calibration_rounds": calibration_rounds, "measure_choice": measure_choice,
            "keep_grads": keep_grads, "precision": precision}  # fmt: skip


def graph_digest(lowered: CapturedGraph) -> str:
    """A hash of the captured graph: its text IR, then each fx value's layout (strides and
    devices, which the IR text leaves out)."""
    digest = hashlib.sha256(print_graph(lowered.graph).encode())
    for node in lowered.captured.graph_module.graph.nodes:
        digest.update(f"{node.op} {node.name} {_layout(node.meta.get('val'))}\n".encode())
    return digest.hexdigest()


def _layout(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return (f"{value.dtype}{list(value.shape)}/{list(value.stride())}+{value.storage_offset()}@{value.device}"
                f"{'~grad' if value.requires_grad else ''}")  # fmt: skip
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(_layout(v) for v in value) + ")"
    # A number, a symbol or nothing: its type is enough (its value is an operand in the IR text).
    return type(value).__name__


def device_description(device: torch.device) -> dict[str, Any]:
    """What a profile's times and a plan's memory depend on of the device."""
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        return {"type": "cuda", "name": properties.name, "total_memory": properties.total_memory,
                "capability": [properties.major, properties.minor],
                "processors": properties.multi_processor_count, "cuda": torch.version.cuda,
                "cudnn": torch.backends.cudnn.version(),
                # what the step holds over its allocation, which calibration plans around, depends on it
                "expandable_segments": expandable_segments_on(), "kernels": kernel_settings()}  # fmt: skip
    return {"type": device.type, "machine": platform.machine(), "processor": platform.processor(),
            "cores": os.cpu_count(), "threads": torch.get_num_threads()}  # fmt: skip


def kernel_settings() -> dict[str, Any]:
    """The process's settings that choose the CUDA kernels a step runs, and so its profile's
    times and workspaces and what a calibrated plan holds, without changing its graph: TF32,
    cuDNN's autotuning and determinism, deterministic algorithms, cuBLAS's workspace size."""
    return {"float32_matmul_precision": torch.get_float32_matmul_precision(),
            "matmul_tf32": torch.backends.cuda.matmul.allow_tf32, "cudnn_tf32": torch.backends.cudnn.allow_tf32,
            "cudnn_benchmark": torch.backends.cudnn.benchmark,
            "cudnn_deterministic": torch.backends.cudnn.deterministic,
            "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG")}  # fmt: skip


def pass_description(pass_: Pass) -> dict[str, Any]:
    """A pass as the key holds it: its name, class and every option (defaults included: a default
    may change between versions of a user's pass)."""
    cls = type(pass_)
    described: dict[str, Any] = {
        "name": pass_.name, "class": f"{cls.__module__}.{cls.__qualname__}",
        "options": {f.name: repr(getattr(pass_, f.name)) for f in dataclasses.fields(pass_)},
    }  # fmt: skip
    if not cls.__module__.startswith("mutwo."):
        described["source"] = pass_source_digest(pass_)
    return described


def pass_source_digest(pass_: Pass) -> str | None:
    """The digest of the file defining a pass that is not mutwo's, or None when it has none to read
    (a class defined in a notebook or at the prompt): the key then cannot cover its code."""
    try:
        return _file_digest(inspect.getsourcefile(type(pass_)))
    except (OSError, TypeError):
        return None


def _file_digest(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def mutwo_version() -> str:
    """mutwo's installed version (read here rather than from ``mutwo.__version__``: the package's
    ``__init__`` imports the API, which imports this module)."""
    try:
        return version("mutwo")
    except PackageNotFoundError:
        return "0+unknown"


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """A hash of mutwo's modules that planning runs (ir, passes, runtime); read once a process."""
    digest = hashlib.sha256()
    for folder in (Path(mutwo.ir.__file__).parent, Path(mutwo.passes.__file__).parent, _RUNTIME):
        for path in sorted(folder.rglob("*.py")):
            digest.update(f"{path.relative_to(folder.parent)}\n".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()
