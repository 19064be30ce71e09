"""Batch tensors that share memory: traced as separate inputs, refused if the graph writes to one.

Users pass the same tensor twice (``{"input_ids": ids, "labels": ids}``) or views of one tensor.
Traced as they are, fake tensors give both placeholders one storage, which the IR cannot express
(every placeholder owns its storage). AOTAutograd makes the same choice as here: aliased inputs
that are only read are traced as independent inputs (feeding the same tensor to both at run time
is then harmless); only an aliased input that is *written* needs more (AOTAutograd's synthetic
bases), and mutwo refuses that case with one sentence instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import fx

from mutwo.runtime.capture.tracing import CaptureError


def _storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    return (str(tensor.device), tensor.untyped_storage().data_ptr())


def separate_aliases(inputs: list[torch.Tensor], first: int) -> tuple[list[torch.Tensor], dict[int, int]]:
    """``inputs`` where each tensor from position ``first`` on that shares storage with an earlier
    input is replaced by a copy, for tracing; and ``{position: position of the earlier input}``."""
    seen: dict[tuple[str, int], int] = {}
    separated = list(inputs)
    aliases: dict[int, int] = {}
    for position, tensor in enumerate(inputs):
        if tensor.untyped_storage().nbytes() == 0:  # empty storages share address 0: nothing to alias
            continue
        key = _storage_key(tensor)
        if key in seen and position >= first:
            aliases[position] = seen[key]
            # Same strides (a clone of a strided view would be contiguous, and the graph would
            # then use views that the real, strided input cannot take).
            copy = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=tensor.device)
            separated[position] = copy.copy_(tensor.detach()).requires_grad_(tensor.requires_grad)
        seen.setdefault(key, position)
    return separated, aliases


def _written_storages(graph: fx.Graph) -> set[int]:
    """Addresses of the fake storages some op of ``graph`` writes to in place."""
    written: set[int] = set()
    for node in graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None:
            continue
        for index, argument in enumerate(schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = node.kwargs.get(argument.name, node.args[index] if index < len(node.args) else None)
            for arg in value if isinstance(value, (list, tuple)) else [value]:
                fake = arg.meta.get("val") if isinstance(arg, fx.Node) else None
                if isinstance(fake, torch.Tensor):
                    written.add(fake.untyped_storage()._cdata)
    return written


def refuse_written_aliases(graph: fx.Graph, aliases: dict[int, int], labels: Sequence[str]) -> None:
    """Raise :class:`CaptureError` if the traced step writes in place to an input that shares memory
    with another (``aliases`` from :func:`separate_aliases`; ``labels`` names every input)."""
    if not aliases:
        return
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    written = _written_storages(graph)
    for position, other in aliases.items():
        for index in (position, other):
            fake = placeholders[index].meta.get("val")
            if isinstance(fake, torch.Tensor) and fake.untyped_storage()._cdata in written:
                raise CaptureError(
                    f"{labels[position]} and {labels[other]} share memory and the training step writes to "
                    f"{labels[index]} in place, which mutwo cannot capture; pass a separate copy "
                    "(for example labels=input_ids.clone())"
                )
