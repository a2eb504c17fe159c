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

from typing import Any, Callable, Iterator, Protocol

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, TensorDataset

from nbddp.protocol import data_forms as dataforms
from nbddp.protocol.data_forms import DataSpec
from nbddp.worker.data import loaders


class MapData(Protocol):
    """Map-style data: a length and a sample per index (a torch ``Dataset`` with ``__len__``, a Hugging Face one)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


class SizedSampler(Protocol):
    """A sampler with a length: what ``SkipSampler`` and ``RankShareSampler`` read of the one they wrap."""

    def __iter__(self) -> Iterator[int]: ...

    def __len__(self) -> int: ...


class EpochSampler(SizedSampler, Protocol):
    """A sampler whose order follows the epoch: ``DistributedSampler``, ``RankShareSampler``."""

    def set_epoch(self, epoch: int) -> None: ...


def materialise(spec: DataSpec, cache: dict[str, Any]) -> Any:
    """The dataset of ``spec`` on this worker; datasets with a ``key`` stay resident.

    Whatever the person's data is: a torch ``Dataset``, a Hugging Face one, a
    stream of either (``is_stream`` tells them apart); no one class covers them.

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

    def __init__(self, inner: SizedSampler, skip: int = 0):
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
        if hasattr(self.inner, "set_epoch"):  # (a StridedSampler's order has no epochs)
            self.inner.set_epoch(epoch)


class StridedSampler(Sampler):
    """Rank ``r`` of ``world`` takes indices ``r, r + world, ...``: no padding."""

    def __init__(self, n: int, rank: int, world: int):
        self.indices = range(rank, n, world)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class RankShareSampler(Sampler):
    """A person's own sampler, shared out per rank as ``DistributedSampler`` shares out a dataset.

    Each epoch every rank draws the sampler's whole sequence of indices from
    the same seed (``seed + epoch``, so a ``WeightedRandomSampler`` draws
    alike everywhere), pads it to a multiple of ``world`` with its first
    indices (or drops the tail with ``drop_last``), and keeps every
    ``world``-th from ``rank``: the ranks read disjoint parts of one draw.
    """

    def __init__(self, inner: SizedSampler, rank: int, world: int, seed: int = 0, drop_last: bool = False):
        self.inner, self.rank, self.world, self.seed, self.drop_last = inner, rank, world, seed, drop_last
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.inner, "set_epoch"):
            self.inner.set_epoch(epoch)

    def _total(self) -> int:
        n = len(self.inner)
        return n - n % self.world if self.drop_last else -(-n // self.world) * self.world

    def __iter__(self) -> Iterator[int]:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed + self.epoch)
            indices = list(self.inner)
        total = self._total()
        while 0 < len(indices) < total:
            indices += indices[: total - len(indices)]
        return iter(indices[:total][self.rank::self.world])

    def __len__(self) -> int:
        return self._total() // self.world


def loader_kwargs(device: torch.device, num_workers: int | None, pin_memory: bool | None) -> dict[str, Any]:
    """DataLoader settings that suit the device, unless the person chose: worker processes on GPU, pinned memory."""
    on_gpu = device.type == "cuda"
    workers = (2 if on_gpu else 0) if num_workers is None else num_workers
    return {"pin_memory": on_gpu if pin_memory is None else pin_memory,
            **loaders.worker_kwargs(workers, loaders.start_method())}


def data_loader(ds: Dataset | MapData, kwargs: dict[str, Any], collate_fn: Callable | None, **more: Any) -> DataLoader:
    """A loader of ``ds`` whose dataset and functions reach loader workers started afresh (``loaders.by_value``)."""
    options = {**kwargs, **more}
    method = options.get("multiprocessing_context")
    ds, collate_fn = loaders.by_value(ds, collate_fn, method)
    if options.get("worker_init_fn") is not None and method not in (None, "fork"):
        options["worker_init_fn"] = loaders.CallByValue(options["worker_init_fn"])  # a notebook function, by value
    return loaders.loader(ds, collate_fn=collate_fn, **options)


def kept_settings(spec: DataSpec, num_workers: int) -> dict[str, Any]:
    """What a person's DataLoader set that nbddp's loader keeps as it was (beyond batch size, order, workers)."""
    own = spec.loader or {}
    kept = {k: own[k] for k in ("worker_init_fn", "generator", "timeout") if own.get(k) is not None}
    if num_workers > 0 and own.get("prefetch_factor") is not None:
        kept["prefetch_factor"] = own["prefetch_factor"]
    return kept


def train_loader(ds: Dataset, spec: DataSpec, cfg: Any, rank: int, world: int, device: torch.device,
                 whole_batches: bool = False) -> tuple[DataLoader, DistributedSampler, Callable[[Sampler], DataLoader]]:
    """The epoch loader, its sampler, and a maker of loaders over another sampler (resume).

    ``rank``/``world``: this rank's shard of the data (ranks that hold one model
    between them share one). ``whole_batches``: drop a partial last batch.
    """
    if spec.sampler is not None:
        sampler: Any = RankShareSampler(spec.sampler, rank, world, cfg.seed, cfg.drop_last)
    else:
        sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=cfg.shuffle, seed=cfg.seed,
                                     drop_last=cfg.drop_last)
    kwargs = loader_kwargs(device, cfg.num_workers, cfg.pin_memory)
    kwargs.update(kept_settings(spec, kwargs["num_workers"]))
    drop_last = whole_batches or bool((spec.loader or {}).get("drop_last"))

    def make(s: Sampler) -> DataLoader:
        return data_loader(ds, kwargs, spec.collate_fn, batch_size=cfg.batch_size, sampler=s, drop_last=drop_last)

    return make(sampler), sampler, make


def val_loader(ds: MapData, spec: DataSpec, cfg: Any, rank: int, world: int, device: torch.device) -> DataLoader:
    """Every sample once, no padding; a validation DataLoader's own batch size and settings kept."""
    own = spec.loader or {}
    kwargs = loader_kwargs(device, own.get("num_workers", cfg.num_workers), own.get("pin_memory", cfg.pin_memory))
    kwargs.update(kept_settings(spec, kwargs["num_workers"]))
    return data_loader(ds, kwargs, spec.collate_fn, batch_size=own.get("batch_size") or cfg.batch_size,
                   sampler=StridedSampler(len(ds), rank, world))
