"""How the step hands a batch to the model and to the loss, as users write their loops.

The model's ``forward`` signature decides (``inspect.signature(forward).bind``), the whole batch
first, so every batch a model takes as it is keeps being passed as it is:

* a dict: ``model(**batch)`` and ``loss_fn(output, batch)`` (transformers' batches);
* a tuple or list that ``forward`` takes: ``model(*batch)`` and ``loss_fn(output, batch)``
  (``forward(images, labels)``, ``forward(images, targets=None)``);
* an ``(inputs, labels)`` pair whose ``forward`` takes the inputs only: ``model(batch[0])`` and
  ``loss_fn(output, batch[1])``, as ``loss = criterion(model(images), labels)`` is written, so
  ``F.cross_entropy`` or ``nn.CrossEntropyLoss()`` is the loss as it is (inputs that are a dict
  go as ``model(**batch[0])``; a tuple or list that ``forward`` does not take as one argument, as
  ``model(*batch[0])``);
* anything else (one tensor): ``model(batch)`` and ``loss_fn(output, batch)``.

A batch none of these fit is refused in one sentence naming ``forward``'s signature and the fix.
The choice is made once, on the example batch, and said in the step's log (:meth:`BatchCall.sentence`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from mutwo.runtime.capture.tracing import CaptureError

WHOLE, SINGLE, KEYWORDS, PAIR = "whole", "single", "keywords", "pair"
#: how the inputs of a pair are passed: as one argument, as keywords (a dict) or spread (a tuple or list)
SPREAD = "spread"


@dataclass(frozen=True)
class BatchCall:
    """How the model and the loss are called with a batch: ``how`` is ``whole`` (``model(*batch)``),
    ``keywords`` (``model(**batch)``), ``single`` (``model(batch)``) or ``pair`` (``model`` gets
    ``batch[0]``, passed as ``inputs`` says, and the loss gets ``batch[1]``)."""

    how: str
    inputs: str = SINGLE  #: with ``pair``: ``single``, ``keywords`` or ``spread``
    forward: str = ""  #: ``Type.forward(signature)``, for the log and errors
    bound: str = ""  #: which parameter of forward gets which part of the batch, in words

    def model_arguments(self, batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The positional and keyword arguments the model is called with."""
        if self.how == PAIR:
            return _arguments(batch[0], self.inputs)
        return _arguments(batch, {WHOLE: SPREAD}.get(self.how, self.how))

    def loss_batch(self, batch: Any) -> Any:
        """What the loss function gets beside the model's output: the labels of a pair, else the batch."""
        return batch[1] if self.how == PAIR else batch

    def model_text(self) -> str:
        """The call of the model, written as Python: ``model(batch[0])``."""
        if self.how == PAIR:
            return {SINGLE: "model(batch[0])", KEYWORDS: "model(**batch[0])", SPREAD: "model(*batch[0])"}[self.inputs]
        return {WHOLE: "model(*batch)", KEYWORDS: "model(**batch)", SINGLE: "model(batch)"}[self.how]

    def sentence(self) -> str:
        """One line for the step's log: how the model and the loss are called."""
        model = self.model_text()
        loss = "loss_fn(output, batch[1])" if self.how == PAIR else "loss_fn(output, batch)"
        why = (f"an (inputs, labels) batch; {self.forward} takes the inputs" if self.how == PAIR
               else f"{self.forward} gets {self.bound}" if self.bound else self.forward)  # fmt: skip
        return f"mutwo: calling the model as {model} and the loss as {loss} ({why})"


def _arguments(value: Any, how: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if how == KEYWORDS:
        return (), dict(value)
    if how == SPREAD:
        return tuple(value), {}
    return (value,), {}


def _shape(value: Any) -> str:
    if isinstance(value, dict):
        return KEYWORDS
    return SPREAD if isinstance(value, (tuple, list)) else SINGLE


def batch_call(model: torch.nn.Module, batch: Any) -> BatchCall:
    """Decide how ``model`` and the loss are called with ``batch`` (see the module docstring);
    raise :class:`CaptureError` when ``forward`` takes none of the ways."""
    shape = _shape(batch)
    how = {SPREAD: WHOLE}.get(shape, shape)
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):  # a builtin or C++ forward: let the call say what it says
        return BatchCall(how, forward=f"{type(model).__name__}.forward")
    forward = f"{type(model).__name__}.forward({', '.join(_parameter_words(p) for p in signature.parameters.values())})"
    whole = _bind(signature, batch, shape)
    if not isinstance(whole, str):
        return BatchCall(how, forward=forward, bound=_bound_words(whole, batch, shape))
    if shape == SPREAD and len(batch) == 2:
        # inputs that are a tuple or list: as one argument first, then spread
        tried = [SINGLE, SPREAD] if _shape(batch[0]) == SPREAD else [_shape(batch[0])]
        for inputs in tried:
            if not isinstance(_bind(signature, batch[0], inputs), str):
                return BatchCall(PAIR, inputs, forward=forward)
        pair = f"{BatchCall(PAIR, tried[0]).model_text()}: {_bind(signature, batch[0], tried[0])}"
        raise CaptureError(
            f"{forward} cannot take the batch, a 2-element tuple or list, whole (model(*batch): {whole}) nor as "
            f"(inputs, labels) ({pair}); give forward what it takes, as (inputs, labels) with loss_fn(output, "
            "labels), or wrap the model in a module whose forward takes the whole batch and read the labels in "
            "loss_fn(output, batch)")  # fmt: skip
    if shape == KEYWORDS:
        given = f"a dict with keys {sorted(batch)}, passed as model(**batch)"
    elif shape == SPREAD:
        given = f"a {len(batch)}-element tuple or list, passed as model(*batch)"
    else:
        given = f"a {type(batch).__name__}, passed as model(batch)"
    pair = "; an (inputs, labels) pair would be passed as model(inputs) with loss_fn(output, labels)"
    raise CaptureError(
        f"{forward} cannot take the batch ({whole}): the batch is {given}{pair if shape == SPREAD else ''}; give "
        "forward what it takes, or wrap the model in a module whose forward takes the whole batch and read the "
        "rest in loss_fn(output, batch)")  # fmt: skip


def _parameter_words(parameter: inspect.Parameter) -> str:
    """A parameter as the log and errors write it: its name, its stars, ``=...`` for a default."""
    star = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}.get(parameter.kind, "")
    return star + parameter.name + ("=..." if parameter.default is not inspect.Parameter.empty else "")


def _bind(signature: inspect.Signature, value: Any, how: str) -> inspect.BoundArguments | str:
    """``value`` bound to ``forward``'s parameters as ``how`` passes it, or why it does not bind."""
    args, kwargs = _arguments(value, how)
    try:
        return signature.bind(*args, **kwargs)
    except TypeError as mismatch:
        return str(mismatch)


def _bound_words(bound: inspect.BoundArguments, batch: Any, shape: str) -> str:
    """``batch[0] as x, batch[1] as mask``: which parameter gets which element of a tuple batch
    (empty for other batches, whose keys or single value say it)."""
    if shape != SPREAD or len(batch) < 2:
        return ""
    names = []
    for name, value in bound.arguments.items():
        kind = bound.signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            names += [f"*{name}"] * len(value)
        elif kind is not inspect.Parameter.VAR_KEYWORD:
            names.append(name)
    return ", ".join(f"batch[{i}] as {name}" for i, name in enumerate(names))
