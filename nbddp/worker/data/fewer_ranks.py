"""The epoch's batches when an elastic fit goes on with fewer ranks (``dist_fit(min_workers=...)``).

The fit began on ``data_world`` ranks, each reading its ``DistributedSampler``
shard (or ``RankShareSampler``'s) in batches of ``batch_size``, ``grad_accum``
of them per optimizer step. After a lost rank that could not be replaced it
goes on with ``world`` ranks, ``world`` dividing ``data_world``: each rank
now reads ``q = data_world // world`` of the original shards (its "data
slots": rank r holds slots ``r*q ... r*q + q - 1``) and accumulates
``grad_accum * q`` micro-batches per step.

Each micro-batch is exactly one batch one original rank would have read, and
one step holds exactly the batches of that step on every original rank. So
every step sees the same samples, in batches of the same size, as the
unbroken fit, and the gradient (the mean of the per-batch means, since DDP
averages ranks and the loop divides by the window) is the same up to the
order of the floating-point sums: no sample of the epoch is skipped or seen
twice. A position in the epoch (``batches_done``) counts micro-batches of
the fit that wrote it; ``slot_batches`` turns it into the original ranks'.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from nbddp.worker.data.datasets import (EpochSampler, RankShareSampler, SkipSampler, data_loader, kept_settings,
                                        loader_kwargs)


class SlotBatches(Sampler):
    """A batch sampler: this rank's data slots' batches, one optimizer step's window at a time.

    ``samplers``: one per slot (the original ranks' samplers); ``skip``: micro-batches of this
    rank's sequence already trained (a resume mid-epoch).
    """

    def __init__(self, samplers: Sequence[EpochSampler], batch_size: int, grad_accum: int, drop_last: bool,
                 skip: int = 0):
        self.samplers, self.batch_size, self.grad_accum = samplers, batch_size, grad_accum
        self.drop_last, self.skip = drop_last, skip

    def set_epoch(self, epoch: int) -> None:
        for s in self.samplers:
            s.set_epoch(epoch)

    def skipping(self, skip: int) -> "SlotBatches":
        return SlotBatches(self.samplers, self.batch_size, self.grad_accum, self.drop_last, skip)

    def _per_slot(self) -> int:
        n = len(self.samplers[0])
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __len__(self) -> int:
        return max(0, self._per_slot() * len(self.samplers) - self.skip)

    def __iter__(self) -> Iterator[list[int]]:
        slots = [_batches(list(s), self.batch_size, self.drop_last) for s in self.samplers]
        order = []
        for start in range(0, len(slots[0]), self.grad_accum):  # one original step: every slot's window
            for batches in slots:
                order += batches[start:start + self.grad_accum]
        return iter(order[self.skip:])


def _batches(indices: list[int], size: int, drop_last: bool) -> list[list[int]]:
    out = [indices[i:i + size] for i in range(0, len(indices), size)]
    return out[:-1] if drop_last and out and len(out[-1]) < size else out


def slots_of(rank: int, world: int, data_world: int) -> list[int]:
    """The original ranks whose shards ``rank`` of ``world`` reads (``world`` divides ``data_world``)."""
    q = data_world // world
    return list(range(rank * q, rank * q + q))


def slot_batches(batches_done: int, saved_world: int, data_world: int) -> int:
    """A saved position (micro-batches of a fit on ``saved_world`` ranks) in each original rank's batches."""
    return batches_done // (data_world // saved_world)


def train_loader(ds: Dataset, spec: Any, cfg: Any, rank: int, world: int, device: torch.device,
                 whole_batches: bool = False) -> tuple[DataLoader, SlotBatches, Callable[[Sampler], DataLoader]]:
    """``datasets.train_loader``'s three, for a rank that reads ``data_world // world`` of the original shards.

    ``cfg.grad_accum`` is already the new accumulation (``grad_accum * q``); the original one is
    ``cfg.grad_accum // q``. The maker of loaders takes ``SkipSampler(sampler, first * batch_size)`` as the
    loop builds it for a resume mid-epoch.
    """
    q = cfg.data_world // world
    made: list[EpochSampler] = []
    for slot in slots_of(rank, world, cfg.data_world):
        if spec.sampler is not None:
            made.append(RankShareSampler(spec.sampler, slot, cfg.data_world, cfg.seed, cfg.drop_last))
        else:
            made.append(DistributedSampler(ds, num_replicas=cfg.data_world, rank=slot, shuffle=cfg.shuffle,
                                           seed=cfg.seed, drop_last=cfg.drop_last))
    drop_last = whole_batches or bool((spec.loader or {}).get("drop_last"))
    sampler = SlotBatches(made, cfg.batch_size, cfg.grad_accum // q, drop_last)
    kwargs = loader_kwargs(device, cfg.num_workers, cfg.pin_memory)
    kwargs.update(kept_settings(spec, kwargs["num_workers"]))

    def make(s: Sampler) -> DataLoader:
        batches = s
        if isinstance(s, SkipSampler) and isinstance(s.inner, SlotBatches):  # the loop's resume mid-epoch
            batches = s.inner.skipping(s.skip // cfg.batch_size)
        return data_loader(ds, kwargs, spec.collate_fn, batch_sampler=batches)

    return make(sampler), sampler, make
