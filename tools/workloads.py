"""Building the model, an example batch and the loss from a config's ``model`` section."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils import _pytree as pytree

from mutwo.ir.registry import module_file
from mutwo.runtime.capture.training import TrainingOptions
from mutwo.tools.config import OPTIMIZERS, Config, ConfigError


@dataclass
class Workload:
    """A model, one batch (a tuple or dict of tensors passed to the model) and the loss."""

    model: nn.Module
    batch: Any
    loss_fn: Callable[[Any, Any], torch.Tensor]


def target_device(config: Config) -> torch.device:
    """The device a config trains on: ``auto`` is the GPU when torch sees one, else the CPU."""
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("CUDA was requested but no GPU is visible to torch; use --device cpu or auto")
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(config.device)


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor moved to ``device``."""
    return pytree.tree_map(lambda leaf: leaf.to(device) if isinstance(leaf, torch.Tensor) else leaf, batch)


class ImageClassifier(nn.Module):
    """Lets a classifier take ``(inputs, labels)`` batches (the labels are for the loss)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.net(inputs)


def classification_loss(output: torch.Tensor, batch: Any) -> torch.Tensor:
    """Cross-entropy of the logits against ``batch[1]``."""
    return F.cross_entropy(output, batch[1])


def _model_loss(output: Any, batch: Any) -> torch.Tensor:
    return output.loss


def build_workload(config: Config) -> Workload:
    """Build the config's workload on CPU, seeded with ``config.seed``, in its memory format."""
    torch.manual_seed(config.seed)
    builder = {"torchvision": _torchvision, "transformers": _transformers, "python": _python}[config.model.source]
    workload = builder(config)
    if config.memory_format == "channels_last":
        workload = channels_last(workload, config.model.name)
    return workload


def channels_last(workload: Workload, name: str) -> Workload:
    """The workload with its model's and batch's 4-D floating-point tensors channels-last (NHWC),
    as ``model.to(memory_format=torch.channels_last)`` and ``x.contiguous(memory_format=...)`` make
    them. Convolutions then run cuDNN's NHWC kernels without transposing each input and output
    (19.4 ms of ResNet-152 b128's iteration on the H100, docs/benchmarks.md). A model with no 4-D
    tensor at all is refused: the option would silently do nothing."""
    leaves = [t for t in pytree.tree_leaves(workload.batch) if isinstance(t, torch.Tensor)]
    if not any(t.dim() == 4 for t in [*workload.model.parameters(), *leaves]):
        raise ConfigError(f"memory_format channels_last lays out 4-D (image) tensors, and model '{name}' and its "
                          "batch have none; remove memory_format (or set it to contiguous)")  # fmt: skip

    def laid_out(tensor: Any) -> Any:
        if isinstance(tensor, torch.Tensor) and tensor.dim() == 4 and tensor.is_floating_point():
            return tensor.contiguous(memory_format=torch.channels_last)
        return tensor

    model = workload.model.to(memory_format=torch.channels_last)
    return Workload(model, pytree.tree_map(laid_out, workload.batch), workload.loss_fn)


def _torchvision(config: Config) -> Workload:
    import torchvision

    name = config.model.name
    classifiers = torchvision.models.list_models(module=torchvision.models)
    if name not in classifiers:
        every = torchvision.models.list_models()
        if name in every:
            raise ConfigError(f"torchvision model '{name}' is not an image classifier; the torchvision source "
                              "builds classifiers only: use source: python for other models")  # fmt: skip
        close = __import__("difflib").get_close_matches(name, classifiers, n=3)
        hint = f"did you mean {', '.join(repr(c) for c in close)}?" if close else "see torchvision.models.list_models()"
        raise ConfigError(f"unknown torchvision model '{name}'; {hint}")
    try:
        net = torchvision.models.get_model(name, weights=None, **config.model.config)
    except TypeError as error:
        raise ConfigError(f"torchvision model '{name}' rejects its config: {error}") from None
    num_classes = config.input.get("num_classes", config.model.config.get("num_classes", 1000))
    size, channels = config.input.get("image_size", 224), config.input.get("channels", 3)
    images = torch.randn(config.batch_size, channels, size, size)
    labels = torch.randint(0, num_classes, (config.batch_size,))
    return Workload(ImageClassifier(net), (images, labels), classification_loss)


def _transformers(config: Config) -> Workload:
    import transformers

    name = config.model.name
    cls = getattr(transformers, name, None)
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        candidates = [n for n in dir(transformers) if n.endswith(("ForMaskedLM", "ForCausalLM",
                                                                  "ForSequenceClassification"))]  # fmt: skip
        close = __import__("difflib").get_close_matches(name, candidates, n=3)
        hint = f"did you mean {', '.join(repr(c) for c in close)}?" if close else "give a class like BertForMaskedLM"
        raise ConfigError(f"unknown transformers model class '{name}'; {hint}")
    overrides = {"attn_implementation": "sdpa", **config.model.config}
    try:
        model_config = cls.config_class(**overrides)
        if config.model.weights:
            model = cls.from_pretrained(config.model.weights, config=model_config, local_files_only=True)
        else:
            model = cls(model_config)
    except (OSError, TypeError, ValueError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(f"cannot build transformers model '{name}': {first}") from None
    seq_len = config.input.get("seq_len", 128)
    limit = getattr(model_config, "max_position_embeddings", seq_len)
    if seq_len > limit:
        raise ConfigError(f"input.seq_len {seq_len} exceeds {name}'s max_position_embeddings {limit}")
    ids = torch.randint(0, model_config.vocab_size, (config.batch_size, seq_len))
    batch: dict[str, torch.Tensor] = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if name.endswith(("ForMaskedLM", "ForCausalLM", "LMHeadModel", "ForPreTraining")):
        batch["labels"] = ids.clone()
    elif name.endswith("ForSequenceClassification"):
        batch["labels"] = torch.randint(0, model_config.num_labels, (config.batch_size,))
    else:
        raise ConfigError(f"mutwo does not know how to make labels for '{name}'; use a *ForMaskedLM, *ForCausalLM "
                          "or *ForSequenceClassification class, or source: python")  # fmt: skip
    return Workload(model, batch, _model_loss)


def _python(config: Config) -> Workload:
    spec = config.model.name
    target, _, function_name = spec.rpartition(":")
    if not target or not function_name:
        raise ConfigError(f"model.name {spec!r} must be 'package.module:function' or 'path/to/file.py:function'")
    module = _import_target(target, config.path, function_name)
    factory = getattr(module, function_name, None)
    if not callable(factory):
        raise ConfigError(f"'{target}' has no function '{function_name}'; check model.name")
    try:
        made = factory(config.batch_size, **config.model.config)
    except Exception as error:  # the user's code: any failure is reported in one line
        raise ConfigError(f"calling {spec}(batch_size, **config) failed: {type(error).__name__}: {error}") from None
    if not (isinstance(made, tuple) and len(made) == 3):
        raise ConfigError(f"{spec} must return (model, batch, loss_fn), it returned {type(made).__name__}")
    model, batch, loss_fn = made
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{spec} returned a {type(model).__name__} as model; it must be a torch.nn.Module")
    if not isinstance(batch, (tuple, list, dict)) or not any(
            isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(batch)):  # fmt: skip
        raise ConfigError(f"{spec} must return a batch that is a tuple or dict of tensors")
    if not callable(loss_fn):
        raise ConfigError(f"{spec} returned a loss_fn that is not callable")
    return Workload(model, batch, loss_fn)


def _import_target(target: str, config_path: Path, function: str = "function") -> Any:
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_absolute():
            beside = config_path.parent / path
            path = beside if beside.is_file() else path
        if not path.is_file():
            raise ConfigError(f"model file '{target}' does not exist (looked beside the config and in the "
                              "current folder)")  # fmt: skip
        module_name = f"mutwo_user_model_{path.stem}"
        spec = importlib.util.spec_from_file_location(module_name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as error:
            raise ConfigError(f"importing model file '{target}' failed: {type(error).__name__}: {error}") from None
        return module
    try:
        return importlib.import_module(target)
    except ImportError as error:
        hint = ""
        if isinstance(error, ModuleNotFoundError) and error.name == target.split(".")[0]:
            # A file is found beside the config or in the current folder, by the same relative name.
            file = module_file(target, [config_path.parent, Path.cwd()])
            hint = (f"; a file is named with its .py: model.name: {target.replace('.', '/')}.py:{function}"
                    if file is not None else "; name an installed module, or a file as 'path/to/file.py:function'")
        raise ConfigError(f"cannot import model module '{target}': {error}{hint}") from None


def build_optimizer(config: Config, model: nn.Module) -> torch.optim.Optimizer:
    """The torch.optim optimizer named by the config, over the model's trainable parameters."""
    options = {k: v for k, v in config.optimizer.items() if k != "name"}
    if "betas" in options:
        options["betas"] = tuple(options["betas"])
    cls = getattr(torch.optim, OPTIMIZERS[config.optimizer["name"]])
    params = [p for p in model.parameters() if p.requires_grad]
    try:
        return cls(params, **options)
    except (TypeError, ValueError, IndexError) as error:
        raise ConfigError(f"optimizer {config.optimizer['name']}: {error}") from None


def training_options(config: Config, device: torch.device) -> TrainingOptions:
    """Clipping, precision, grad scaling and gradient accumulation as the config asks (a fresh
    GradScaler for ``device``)."""
    scaler = torch.amp.GradScaler(device.type) if config.grad_scaler else None
    return TrainingOptions(max_grad_norm=config.max_grad_norm, precision=config.precision, grad_scaler=scaler,
                           accumulation_steps=config.accumulation_steps)  # fmt: skip
