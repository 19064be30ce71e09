"""Sharding a model with FSDP2 as its users do, for ``mutwo-opt --sharding fsdp2``.

FSDP2's users call ``fully_shard`` on each repeated block of the model (its transformer layers,
its residual blocks), then on the model itself: each block's parameters are then gathered just
before the block runs and freed after it. A model built from a config has no user to say which
modules those are, so :func:`shard_blocks` takes them from the model's structure: the items of
every ``nn.ModuleList`` or ``nn.Sequential`` that holds two or more modules of one class with
parameters (Llama's and BERT's layers, GPT-2's blocks, ResNet's bottlenecks), outermost first.
A model with none is sharded as one group (its root).
"""

from __future__ import annotations

import torch
from torch import nn


def repeated_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost repeated blocks of ``model`` (see the module docstring), by qualified name."""
    blocks: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList | nn.Sequential) or len(module) < 2:
            continue
        if any(name == outer or name.startswith(f"{outer}.") for outer, _ in blocks):
            continue
        items = list(module.named_children())
        if len({type(item) for _, item in items}) == 1 and all(any(True for _ in item.parameters())
                                                               for _, item in items):  # fmt: skip
            blocks.extend((f"{name}.{child}" if name else child, item) for child, item in items)
    return blocks


def shard_blocks(model: nn.Module, device: torch.device) -> list[str]:
    """``fully_shard`` each of ``model``'s :func:`repeated_blocks`, then ``model``, over every rank
    of the initialised process group on ``device``'s type (without a mesh, ``fully_shard`` takes
    the accelerator's: a CPU run on a machine with a GPU would move the model there); the blocks'
    names come back. ``fully_shard``'s own refusals come back as :class:`ValueError`, in one line."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    blocks = repeated_blocks(model)
    try:
        for _, block in blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    except (ValueError, RuntimeError, AssertionError) as error:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ValueError(f"fully_shard refused the model: {first}") from None
    return [name for name, _ in blocks]
