"""YAML configs of mutwo-opt: safe-loaded, every key checked, unknown keys answered with a
did-you-mean. See the README's config reference."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mutwo.ir.budget import Budget, BudgetError, parse_budget
from mutwo.runtime.execution.auto_backend import AUTO, BACKEND_CHOICES
from mutwo.runtime.planning.step_planning import DEFAULT_PASSES
from mutwo.tools.cli import did_you_mean, unreadable

#: The pipeline run when neither the config nor the command line names one: ``mutwo.optimize``'s.
DEFAULT_PIPELINE = DEFAULT_PASSES
SOURCES = ("torchvision", "transformers", "python")
DEVICES = ("auto", "cpu", "cuda")
#: optimizer name in the config -> the torch.optim class (every one mutwo captures)
OPTIMIZERS = {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW", "rmsprop": "RMSprop", "adagrad": "Adagrad",
              "adamax": "Adamax", "nadam": "NAdam", "radam": "RAdam", "adadelta": "Adadelta", "rprop": "Rprop",
              "asgd": "ASGD"}  # fmt: skip
PRECISIONS = ("fp32", "bf16-autocast", "fp16-autocast")
#: How the model's and the batch's 4-D tensors are laid out in memory (docs/backends.md, "Channels-last").
MEMORY_FORMATS = ("contiguous", "channels_last")


class ConfigError(ValueError):
    """A config that cannot be used; the message names the key and the fix."""


@dataclass(frozen=True)
class Key:
    types: tuple[type, ...]
    what: str  #: the expected value, in words


_NUMBER = (int, float)
TOP_KEYS = {
    "model": Key((dict,), "a mapping with source, name and config"),
    "batch_size": Key((int,), "a positive integer"),
    "input": Key((dict,), "a mapping (image_size, channels, num_classes, seq_len)"),
    "optimizer": Key((dict,), "a mapping with name, lr and options"),
    "device": Key((str,), "one of auto, cpu, cuda"),
    "budget": Key((int, float, str), "a fraction like 0.5 or bytes like '6GiB'"),
    "passes": Key((str,), "a pipeline like 'stats,dce'"),
    "seed": Key((int,), "an integer"),
    "backend": Key((str,), "one of " + ", ".join(BACKEND_CHOICES)),
    "precision": Key((str,), "one of " + ", ".join(PRECISIONS)),
    "memory_format": Key((str,), "one of " + ", ".join(MEMORY_FORMATS)),
    "max_grad_norm": Key(_NUMBER, "a positive number (clip_grad_norm_ before the optimizer step)"),
    "grad_scaler": Key((bool,), "true or false (a torch.amp.GradScaler, for fp16-autocast)"),
    "accumulation_steps": Key((int,), "a whole number of micro-batches per optimizer step, 1 or more"),
}
MODEL_KEYS = {
    "source": Key((str,), "one of " + ", ".join(SOURCES)),
    "name": Key((str,), "a model name or 'module:function'"),
    "config": Key((dict,), "a mapping of keyword arguments"),
    "weights": Key((str,), "a local path to pretrained weights (transformers)"),
}
INPUT_KEYS = {
    "image_size": Key((int,), "a positive integer"),
    "channels": Key((int,), "a positive integer"),
    "num_classes": Key((int,), "a positive integer"),
    "seq_len": Key((int,), "a positive integer"),
}
OPTIMIZER_KEYS = {
    "name": Key((str,), "one of " + ", ".join(OPTIMIZERS)),
    "lr": Key(_NUMBER, "a positive number"),
    "momentum": Key(_NUMBER, "a number"),
    "dampening": Key(_NUMBER, "a number"),
    "nesterov": Key((bool,), "true or false"),
    "weight_decay": Key(_NUMBER, "a number"),
    "betas": Key((list,), "a list of two numbers"),
    "eps": Key(_NUMBER, "a number"),
    "amsgrad": Key((bool,), "true or false"),
    "maximize": Key((bool,), "true or false"),
    "foreach": Key((bool,), "true or false"),
    "alpha": Key(_NUMBER, "a number"),
    "centered": Key((bool,), "true or false"),
    "lr_decay": Key(_NUMBER, "a number"),
    "initial_accumulator_value": Key(_NUMBER, "a number"),
    "momentum_decay": Key(_NUMBER, "a number"),
    "decoupled_weight_decay": Key((bool,), "true or false"),
    "rho": Key(_NUMBER, "a number"),
}


@dataclass
class ModelSpec:
    source: str
    name: str
    config: dict[str, Any] = field(default_factory=dict)
    weights: str | None = None


@dataclass
class Config:
    """A validated config. ``name`` is the file's stem, used for the default output folder."""

    name: str
    path: Path
    model: ModelSpec
    batch_size: int = 2
    input: dict[str, int] = field(default_factory=dict)
    optimizer: dict[str, Any] = field(default_factory=lambda: {"name": "adam", "lr": 1e-3})
    device: str = "auto"
    budget: Budget | None = None
    passes: str = DEFAULT_PIPELINE
    seed: int = 0
    backend: str = AUTO  #: mutwo-opt chooses (mutwo.runtime.execution.auto_backend)
    precision: str = "fp32"
    memory_format: str = "contiguous"
    max_grad_norm: float | None = None
    grad_scaler: bool = False
    #: micro-batches per optimizer step (gradient accumulation); mutwo-opt plans the last one's graph
    accumulation_steps: int = 1


def _check_keys(section: str, data: dict[str, Any], schema: dict[str, Key]) -> None:
    for key, value in data.items():
        if key not in schema:
            hint = did_you_mean(str(key), schema) or f"valid keys: {', '.join(schema)}"
            raise ConfigError(f"unknown key '{section}{key}'; {hint}")
        spec = schema[key]
        if spec.types == _NUMBER and isinstance(value, str):  # YAML 1.1 reads 1e-3 as a string
            try:
                data[key] = value = float(value)
            except ValueError:
                pass
        # bool is an int subclass: a boolean is only accepted where the schema says so.
        ok = isinstance(value, spec.types) and not (isinstance(value, bool) and bool not in spec.types)
        if not ok:
            raise ConfigError(f"'{section}{key}' must be {spec.what}, got {value!r}")


def load_config(path: str | Path) -> Config:
    """Read and validate a YAML config file."""
    path = Path(path)
    problem = unreadable(path, "config file")
    if problem is not None:
        raise ConfigError(f"{problem}; pass the path of a YAML file such as examples/tiny_mlp.yaml")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or "invalid YAML"
        raise ConfigError(f"{path} is not valid YAML{where}: {problem}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not a UTF-8 text file") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a YAML mapping with at least a 'model' key")
    return parse_config(data, path)


def parse_config(data: dict[str, Any], path: Path) -> Config:
    """Validate a config mapping; see :func:`load_config`."""
    _check_keys("", data, TOP_KEYS)
    if "model" not in data:
        raise ConfigError(f"{path} has no 'model' key; add model: {{source: torchvision, name: resnet18}}")
    model = data["model"]
    _check_keys("model.", model, MODEL_KEYS)
    for required in ("source", "name"):
        if required not in model:
            raise ConfigError(f"'model.{required}' is missing; it must be {MODEL_KEYS[required].what}")
    if model["source"] not in SOURCES:
        raise ConfigError(f"unknown model source {model['source']!r}; use one of {', '.join(SOURCES)}")
    inputs = data.get("input", {})
    _check_keys("input.", inputs, INPUT_KEYS)
    for key, value in inputs.items():
        if value <= 0:
            raise ConfigError(f"'input.{key}' must be a positive integer, got {value}")
    optimizer = {"name": "adam", "lr": 1e-3, **data.get("optimizer", {})}
    _check_keys("optimizer.", optimizer, OPTIMIZER_KEYS)
    if optimizer["name"] not in OPTIMIZERS:
        raise ConfigError(f"unknown optimizer {optimizer['name']!r}; use one of {', '.join(OPTIMIZERS)}")
    betas = optimizer.get("betas")
    if betas is not None and (len(betas) != 2 or not all(isinstance(b, _NUMBER) and not isinstance(b, bool)
                                                         for b in betas)):  # fmt: skip
        raise ConfigError(f"'optimizer.betas' must be a list of two numbers like [0.9, 0.999], got {betas!r}")
    if optimizer["lr"] <= 0:
        raise ConfigError(f"'optimizer.lr' must be positive, got {optimizer['lr']}")
    config = Config(
        name=path.stem, path=path,
        model=ModelSpec(model["source"], model["name"], dict(model.get("config", {})), model.get("weights")),
        input=dict(inputs), optimizer=optimizer, grad_scaler=data.get("grad_scaler", False),
    )  # fmt: skip
    if data.get("max_grad_norm") is not None:
        if data["max_grad_norm"] <= 0:
            raise ConfigError(f"'max_grad_norm' must be a positive number, got {data['max_grad_norm']}")
        config.max_grad_norm = float(data["max_grad_norm"])
    if data.get("accumulation_steps") is not None:
        if data["accumulation_steps"] < 1:
            raise ConfigError(f"'accumulation_steps' must be {TOP_KEYS['accumulation_steps'].what}, "
                              f"got {data['accumulation_steps']}")  # fmt: skip
        config.accumulation_steps = data["accumulation_steps"]
    apply_overrides(config, batch_size=data.get("batch_size"), device=data.get("device"),
                    budget=data.get("budget"), passes=data.get("passes"), seed=data.get("seed"),
                    backend=data.get("backend"), precision=data.get("precision"),
                    memory_format=data.get("memory_format"))  # fmt: skip
    return config


def apply_overrides(config: Config, *, batch_size: int | None = None, device: str | None = None,
                    budget: float | str | None = None, passes: str | None = None,
                    seed: int | None = None, backend: str | None = None,
                    precision: str | None = None, memory_format: str | None = None) -> Config:  # fmt: skip
    """Apply values from the file or the command line, checking each."""
    if batch_size is not None:
        if batch_size <= 0:
            raise ConfigError(f"batch size must be a positive integer, got {batch_size}")
        config.batch_size = batch_size
    if device is not None:
        config.device = _one_of("device", device, DEVICES)
    if budget is not None:
        try:
            config.budget = parse_budget(budget)
        except BudgetError as error:
            raise ConfigError(str(error)) from None
    if passes is not None:
        config.passes = passes
    if seed is not None:
        config.seed = seed
    if backend is not None:
        config.backend = _one_of("backend", backend, BACKEND_CHOICES)
    if precision is not None:
        config.precision = _one_of("precision", precision, PRECISIONS)
    if memory_format is not None:
        config.memory_format = _one_of("memory format", memory_format, MEMORY_FORMATS)
    return config


def _one_of(what: str, value: str, allowed: Iterable[str]) -> str:
    """``value`` if it is one of ``allowed``, else a one-line :class:`ConfigError`."""
    if value not in allowed:
        raise ConfigError(f"unknown {what} {value!r}; use one of {', '.join(allowed)}")
    return value
