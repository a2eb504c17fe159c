"""What one rank holds of a model it shares with others: its own shards, their bytes, a copy of them.

Under FSDP a parameter is a ``DTensor`` whose local shard is this rank's;
under pipeline parallelism a rank holds its stages' plain tensors; under
tensor parallelism, ``DTensor`` shards again. In every case "what this rank
holds" is each tensor's local part, so a snapshot of it is a copy of those
local parts (no collective, 1/N of the model per rank) and restoring it is
a copy back, in place.
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.nn as nn


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (its storage, writable in place), a plain tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def own_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters()
    yield from module.named_buffers()


def local_param_bytes(module: nn.Module) -> int:
    """Parameter bytes this rank holds: a DTensor's local shard, a plain parameter whole."""
    return sum(local(p).numel() * local(p).element_size() for p in module.parameters())


def snapshot_own(module: nn.Module) -> dict[str, torch.Tensor]:
    """A host-memory copy of what this rank holds of ``module`` (``restore_own`` puts it back)."""
    return {name: local(t).detach().to("cpu", copy=True) for name, t in own_tensors(module)}


def restore_own(module: nn.Module, saved: dict[str, torch.Tensor] | None) -> None:
    """Put ``snapshot_own``'s copy back, in place; every rank holds its own copy."""
    if saved is None:
        raise ValueError(f"restoring the weights of {type(module).__name__}: this rank holds its own part of the "
                         "model, so it needs its own snapshot, and was given None; pass what snapshot_weights "
                         "returned here")
    with torch.no_grad():
        for name, t in own_tensors(module):
            local(t).copy_(saved[name])
