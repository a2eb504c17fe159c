"""Which samples a rank predicts: one contiguous block of the dataset, no padding.

Rank ``r`` of ``world`` reads samples ``r * n // world`` up to ``(r + 1) * n // world``:
every sample exactly once, block sizes at most one apart, and the ranks'
outputs put one after the other are in the dataset's order. (Training's
``DistributedSampler`` pads the last batch with repeated samples so that
every rank runs as many steps; inference needs no steps in common.)
"""

from __future__ import annotations

from typing import Any

import torch

from nbddp.protocol.data_forms import DataSpec
from nbddp.worker.data import loaders
from nbddp.worker.data.datasets import loader_kwargs


def block(n: int, rank: int, world: int) -> range:
    """The dataset indices of rank ``rank``'s block."""
    return range(rank * n // world, (rank + 1) * n // world)


def block_loader(ds: Any, spec: DataSpec, batch_size: int, rank: int, world: int, device: torch.device) -> Any:
    """A loader over this rank's block, in order, with the dataset's own collate function."""
    kwargs = loader_kwargs(device, None, None)
    ds, collate = loaders.by_value(ds, spec.collate_fn, kwargs.get("multiprocessing_context"))
    return loaders.loader(ds, batch_size=batch_size, sampler=block(len(ds), rank, world), collate_fn=collate,
                          **kwargs)
