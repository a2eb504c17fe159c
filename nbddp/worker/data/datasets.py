"""Datasets and loaders on a worker: one shard per rank.

Training uses ``DistributedSampler``: each rank sees ``ceil(N / world)``
samples per epoch; when ``N`` is not divisible by the world size the
sampler *pads* by repeating the first few indices (``drop_last=True``
drops the tail instead). Every rank therefore runs the same number of
batches, so no rank waits for another at an epoch's end.

Validation does not pad (a repeated sample would bias the metric): rank
``r`` takes samples ``r, r + world, ...``, runs without collectives, and
the sums are reduced once at the end.

Streams (``IterableDataset``) are split and fed by ``streams.py``; the loader
settings both share (worker processes, their start method) are
``loaders.py``'s.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, TensorDataset

from nbddp.protocol import data_forms as dataforms
from nbddp.protocol.data_forms import DataSpec
from nbddp.worker.data import loaders
def materialise(spec: DataSpec, cache: dict[str, Any]) -> Dataset:
    """The dataset of ``spec`` on this worker; datasets with a ``key`` stay resident.

    The kernel decides what is resident (``Session.resident``): it ships a
    dataset with its key once, and afterwards only the key.
    """
    if spec.key is not None and spec.key in cache:
        return cache[spec.key]
    if spec.factory is not None:
        ds = built(spec.factory())
    elif spec.dataset is not None:
        ds = spec.dataset
    else:
        raise RuntimeError(
            f"the kernel sent only the key of a resident dataset ({spec.key}), but this worker does not hold it; "
            "run nbddp.restart() to start from a clean state"
        )
    if not dataforms.is_stream(ds) and len(ds) == 0:
        raise ValueError("the dataset built on the worker is empty (len 0)")
    if spec.key is not None:
        cache[spec.key] = ds
    return ds


def built(ds: Any) -> Any:
    """What a data factory returned, as a dataset: a loader's dataset, a tuple's TensorDataset, a DatasetDict's one split."""
    if isinstance(ds, DataLoader):
        ds = ds.dataset
    elif isinstance(ds, tuple):
        ds = TensorDataset(*ds)
    if dataforms.is_split_dict(ds):
        ds = dataforms.one_split(ds, "the data factory")
    if not dataforms.is_stream(ds) and not dataforms.is_map_style(ds):
        raise TypeError(f"the data factory returned {dataforms.describe(ds)}; it must return a map-style Dataset "
                        f"(with __len__ and __getitem__), an IterableDataset, a DataLoader or a tuple of tensors")
    return ds


def keep_only(cache: dict[str, Any], keys: list[str]) -> None:
    """Drop resident datasets the kernel no longer tracks (it sends the list with each fit)."""
    for key in [k for k in cache if k not in keys]:
        del cache[key]


class SkipSampler(Sampler):
    """Yields a sampler's indices after skipping the first ``skip`` (resume mid-epoch)."""

    def __init__(self, inner: Sampler, skip: int = 0):
        self.inner = inner
        self.skip = skip

    def __iter__(self) -> Iterator[int]:
        it = iter(self.inner)
        for _ in range(self.skip):
            next(it, None)
        return it

    def __len__(self) -> int:
        return max(0, len(self.inner) - self.skip)

    def set_epoch(self, epoch: int) -> None:
        self.inner.set_epoch(epoch)


class StridedSampler(Sampler):
    """Rank ``r`` of ``world`` takes indices ``r, r + world, ...``: no padding."""

    def __init__(self, n: int, rank: int, world: int):
        self.indices = range(rank, n, world)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def loader_kwargs(device: torch.device, num_workers: int | None, pin_memory: bool | None) -> dict[str, Any]:
    """DataLoader settings that suit the device, unless the person chose: worker processes on GPU, pinned memory."""
    on_gpu = device.type == "cuda"
    workers = (2 if on_gpu else 0) if num_workers is None else num_workers
    return {"pin_memory": on_gpu if pin_memory is None else pin_memory,
            **loaders.worker_kwargs(workers, loaders.start_method())}


def _loader(ds: Dataset, kwargs: dict[str, Any], collate_fn: Callable | None, **more: Any) -> DataLoader:
    ds, collate_fn = loaders.by_value(ds, collate_fn, kwargs.get("multiprocessing_context"))
    return loaders.loader(ds, collate_fn=collate_fn, **kwargs, **more)


def train_loader(ds: Dataset, spec: DataSpec, cfg: Any, rank: int, world: int, device: torch.device,
                 whole_batches: bool = False) -> tuple[DataLoader, DistributedSampler, Callable[[Sampler], DataLoader]]:
    """The epoch loader, its sampler, and a maker of loaders over another sampler (resume).

    ``rank``/``world``: this rank's shard of the data (ranks that hold one model
    between them share one). ``whole_batches``: drop a partial last batch.
    """
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=cfg.shuffle, seed=cfg.seed, drop_last=cfg.drop_last)
    kwargs = loader_kwargs(device, cfg.num_workers, cfg.pin_memory)

    def make(s: Sampler) -> DataLoader:
        return _loader(ds, kwargs, spec.collate_fn, batch_size=cfg.batch_size, sampler=s, drop_last=whole_batches)

    return make(sampler), sampler, make


def val_loader(ds: Dataset, spec: DataSpec, cfg: Any, rank: int, world: int, device: torch.device) -> DataLoader:
    return _loader(ds, loader_kwargs(device, cfg.num_workers, cfg.pin_memory), spec.collate_fn,
                   batch_size=cfg.batch_size, sampler=StridedSampler(len(ds), rank, world))
