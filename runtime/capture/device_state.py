"""Where the optimizer state of a step recorded as a CUDA graph lives.

A recording cannot read host numbers at replay. For a step captured for a CUDA graph
(``graphed``), :mod:`mutwo.runtime.capture.optim` traces torch.optim's capturable form wherever the
optimizer has one; this module puts the state that form reads on the device — in the user's
``optimizer.state`` itself, where torch.optim keeps it for a capturable group — and refuses, in one
sentence, an optimizer without that form whose state stays on the host.
"""

from __future__ import annotations

from typing import Any

import torch

from mutwo.runtime.capture.optim import UnsupportedOptimizerError, traced_capturable


def state_for_cuda_graphs(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> set[torch.Tensor]:
    """Make the state of ``params`` (created already: :func:`~mutwo.runtime.capture.optim.init_state`)
    one a CUDA graph can read, and return the parameters whose state must stay on their device.

    In a group traced capturable (:func:`~mutwo.runtime.capture.optim.traced_capturable`), the
    state tensors torch.optim keeps on the CPU for a non-capturable group (step counts, NAdam's
    ``mu_product``) are moved to their parameter's device in ``optimizer.state`` itself, same
    dtype and value, as torch.optim keeps them for a capturable group.

    Why the user's state rather than copies of mutwo's: the graph updates them in place at fixed
    addresses like the rest of the state, so nothing is copied back and forth at every step (a copy
    back to the host would wait for the step), a step a grad scaler skips leaves them as it leaves
    eager's, and ``state_dict()`` holds the true counts (a non-capturable optimizer that loads it
    keeps them on the device and reads them with ``.item()``, as torch.optim does).
    ``optimizer.load_state_dict`` keeps a non-capturable group's step counts where the loaded dict
    had them, so the step moves them again before every call (:func:`state_on_device`).

    A group without the option whose state lives on the CPU is refused in one sentence: its
    optimizer computes with that state on the host (Adagrad's step size from its step count), so a
    recording would freeze it."""
    kept: set[torch.Tensor] = set()
    wanted = set(params)
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param not in wanted:
                continue
            state = optimizer.state.get(param, {})
            if traced_capturable(group, True):
                state_on_device(state, param.device)
                kept.add(param)
                continue
            on_host = [key for key, value in state.items()
                       if isinstance(value, torch.Tensor) and value.device != param.device]  # fmt: skip
            if on_host:
                where = state[on_host[0]].device
                raise UnsupportedOptimizerError(
                    f"{_qualified_name(optimizer)} keeps its {on_host[0]} on "
                    f"{'the CPU' if where.type == 'cpu' else where} and "
                    "has no capturable option, so a CUDA graph would freeze what it computes from it at recording; "
                    "train it with the eager or inductor backend, or use an optimizer that takes capturable=True "
                    "(Adam, AdamW, RMSprop...)"
                )
    return kept


def state_on_device(state: dict[str, Any], device: torch.device) -> None:
    """Move the tensors of one parameter's optimizer ``state`` that are not on ``device`` there (same
    dtype and value), in the dict itself."""
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.device != device:
            state[key] = value.to(device)


#: An optimizer's state by parameter, each entry's tensors themselves (:func:`state_entries`).
StateEntries = dict[torch.Tensor, dict[str, Any]]


def state_entries(optimizer: torch.optim.Optimizer) -> StateEntries:
    """The state of ``optimizer``'s parameters as it is now: each parameter's entries, the tensors
    themselves (not copies): what a capture may replace (a step count moved to the device) or
    create (:func:`~mutwo.runtime.capture.optim.init_state`), for :func:`put_state_back`."""
    state = optimizer.state
    return {p: dict(state[p]) for group in optimizer.param_groups for p in group["params"] if p in state}


def put_state_back(optimizer: torch.optim.Optimizer, entries: StateEntries) -> None:
    """Make ``optimizer``'s state what :func:`state_entries` saw: entries replaced since get their
    tensors back, and state created since is dropped, as if the capture had not run."""
    state = optimizer.state
    for param in (p for group in optimizer.param_groups for p in group["params"]):
        if param not in entries:
            state.pop(param, None)
        elif param in state:
            state[param].clear()
            state[param].update(entries[param])


def _qualified_name(optimizer: torch.optim.Optimizer) -> str:
    cls = type(optimizer)
    return f"torch.optim.{cls.__name__}" if cls.__module__.startswith("torch.optim") else cls.__name__
