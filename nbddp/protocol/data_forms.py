"""Which form of data a person handed over, told apart the same way in the kernel and on the workers.

``dist_fit`` takes map-style datasets (sharded by ``DistributedSampler``),
streams (a ``torch.utils.data.IterableDataset`` or a Hugging Face
``datasets.IterableDataset``, sharded by ``worker/data/streams.py``), loaders over
either, tuples of tensors and zero-argument factories of any of these. ``data_spec``
reads one of them into a ``DataSpec``, the picklable record a worker rebuilds
the data from; it lives here, beside the record, because ``dist_fit``,
``predict``/``evaluate`` and the planner all read data the same way.

Hugging Face ``datasets`` is never imported here: an object can only be one
of its datasets if the person's code imported the package already, so the
checks look it up in ``sys.modules`` (importing ``nbddp`` stays instant, and
a person without ``datasets`` installed never pays for it).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Callable, Protocol, TypeAlias, Union

if TYPE_CHECKING:
    from torch import Tensor
    from torch.utils.data import DataLoader, Dataset


class MapStyle(Protocol):
    """A dataset read by index: what ``DistributedSampler`` shards (torch's map-style ``Dataset`` declares no
    ``__len__``; a Hugging Face ``datasets.Dataset`` is no torch ``Dataset`` at all)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int, /) -> Any: ...


# What ``dist_fit(data=...)``, ``predict`` and the planner accept (``FORMS``), as ``data_spec`` tells them apart:
# torch's datasets (map-style or ``IterableDataset``), a loader over one, any other map-style dataset (a Hugging
# Face ``datasets.Dataset``), any other stream (an ``Iterable``: a Hugging Face ``datasets.IterableDataset``), a
# ``DatasetDict`` of one split (a ``Mapping``), a tuple or list of tensors; or a zero-argument factory of one of
# these, run on each worker.
DataSource: TypeAlias = Union["Dataset[Any]", "DataLoader[Any]", MapStyle, Iterable[Any], Mapping[str, Any],
                              "tuple[Tensor, ...]", "list[Tensor]"]
DataLike: TypeAlias = Union[DataSource, Callable[[], DataSource]]

FORMS = ("a map-style Dataset (with __len__ and __getitem__, e.g. a Hugging Face datasets.Dataset), "
         "an IterableDataset (torch's, or Hugging Face's from load_dataset(..., streaming=True)), "
         "a DataLoader over either, a tuple of tensors (x, y, ...), or a zero-argument function that "
         "builds one of these on each worker")


def _hf(name: str) -> Any:
    """``datasets.<name>`` if the person's code imported ``datasets``, else None."""
    module = sys.modules.get("datasets")
    return getattr(module, name, None) if module is not None else None


def is_hf_iterable(obj: Any) -> bool:
    cls = _hf("IterableDataset")
    return cls is not None and isinstance(obj, cls)


def is_stream(obj: Any) -> bool:
    """A dataset read by iterating it: torch's ``IterableDataset`` or Hugging Face's."""
    from torch.utils.data import IterableDataset

    return isinstance(obj, IterableDataset) or is_hf_iterable(obj)


def is_map_style(obj: Any) -> bool:
    return (not isinstance(obj, (type, str, bytes, Mapping)) and not is_stream(obj)
            and hasattr(obj, "__getitem__") and hasattr(obj, "__len__"))


def is_split_dict(obj: Any) -> bool:
    """A Hugging Face ``DatasetDict`` / ``IterableDatasetDict`` (splits by name)."""
    kinds = tuple(c for c in (_hf("DatasetDict"), _hf("IterableDatasetDict")) if c is not None)
    return bool(kinds) and isinstance(obj, kinds)


def one_split(obj: Any, name: str) -> Any:
    """The only split of a ``DatasetDict`` (what ``load_dataset`` returns without ``split=``).

    Raises:
        ValueError: it holds several splits (or none); the message names them
            and shows how to pass one as ``data`` and another as ``val_data``.
    """
    splits = list(obj)
    if len(splits) == 1:
        return obj[splits[0]]
    train = "train" if "train" in splits else (splits[0] if splits else "train")
    others = [s for s in splits if s != train]
    val = next((s for s in ("validation", "test") if s in splits), others[0] if others else "test")
    raise ValueError(
        f"{name} got a {type(obj).__name__} with the splits {splits}; pass one split as data and another as "
        f"val_data: dist_fit(model, dd[{train!r}], val_data=dd[{val!r}]), or load_dataset(..., split={train!r}) "
        "in a factory"
    )


def describe(obj: Any) -> str:
    return f"the class {obj.__name__}" if isinstance(obj, type) else type(obj).__name__


class DataSpec:
    """How to rebuild a user's data on a worker (picklable)."""

    def __init__(self, dataset: Any = None, factory: Callable[[], Any] | None = None,
                 collate_fn: Callable | None = None, key: str | None = None, stream: bool = False,
                 prebatched: bool = False, loader: dict[str, Any] | None = None, sampler: Any = None):
        self.dataset = dataset
        self.factory = factory
        self.collate_fn = collate_fn
        self.key = key  # cache key: the same key means the same data
        self.stream = stream  # an IterableDataset (a factory's data is told apart on the worker)
        self.prebatched = prebatched  # a DataLoader(batch_size=None) over a stream that yields whole batches
        self.loader = loader  # a person's DataLoader's settings (loader_settings), kept on the workers
        self.sampler = sampler  # that DataLoader's own sampler (not Random/Sequential): shared out per rank


def data_spec(data: Any, name: str) -> tuple[DataSpec, int | None, int | None]:
    """(``DataSpec``, its length if known in the kernel, a DataLoader's batch size).

    The kernel's one reading of a person's data, for ``dist_fit``, ``predict``,
    ``evaluate`` and the planner alike: ``name`` is the argument the errors name
    (``"dist_fit(data=...)"``).

    A stream (``IterableDataset``) has no length here: its epochs end where a
    rank's share of it ends (``worker/data/batch_agreement.py``).
    """
    from torch.utils.data import DataLoader

    if is_split_dict(data):
        data = one_split(data, name)
    if isinstance(data, DataLoader):
        from torch.utils.data.dataloader import default_collate

        collate = None if data.collate_fn is default_collate else data.collate_fn
        if is_stream(data.dataset):
            spec = DataSpec(dataset=data.dataset, collate_fn=collate, stream=True, prebatched=data.batch_size is None,
                            loader=stream_loader_settings(data))
            return spec, None, data.batch_size
        settings, sampler = loader_settings(data)
        spec = DataSpec(dataset=data.dataset, collate_fn=collate, loader=settings, sampler=sampler)
        return spec, len(data.dataset), data.batch_size
    if isinstance(data, (tuple, list)) and _tensor_tuple(data):
        return DataSpec(dataset=_tensor_dataset(data, name)), len(data[0]), None
    if is_stream(data):
        return DataSpec(dataset=data, stream=True), None, None
    if is_map_style(data):
        return DataSpec(dataset=data), len(data), None
    if callable(data):
        return DataSpec(factory=data), None, None
    hint = ""
    if isinstance(data, Iterator):
        hint = (". An iterator or generator can be read only once and cannot travel to the workers: wrap what makes it "
                "in an IterableDataset whose __iter__ starts afresh (class S(IterableDataset): def __iter__(self): ...)")
    raise TypeError(f"{name} must be {FORMS}; got {describe(data)}{hint}")


def _tensor_tuple(data: Any) -> bool:
    """Whether ``data`` is meant as tensors (x, y, ...): any tuple, or a list of tensors only."""
    import torch

    return isinstance(data, tuple) or bool(data) and all(isinstance(t, torch.Tensor) for t in data)


def _tensor_dataset(data: Any, name: str) -> Any:
    import torch
    from torch.utils.data import TensorDataset

    if not data or not all(isinstance(t, torch.Tensor) for t in data):
        kinds = [type(t).__name__ for t in data]
        raise TypeError(f"{name}: a tuple must hold tensors (x, y, ...), got ({', '.join(kinds)})")
    lengths = [t.shape[0] if t.dim() else None for t in data]
    if None in lengths or len(set(lengths)) != 1:
        raise ValueError(
            f"{name}: the tensors of the tuple must have the same first dimension (one row per sample); "
            f"got lengths {lengths}"
        )
    return TensorDataset(*data)


def stream_loader_settings(loader: Any) -> dict[str, Any]:
    """A person's ``DataLoader`` over a stream (``IterableDataset``): the settings the workers' loaders keep.

    A stream has no sampler and no order to keep; each rank's loader reads
    only that rank's part of it (``worker/data/streams.py``), with the
    person's batch size, loader workers, ``worker_init_fn``, generator,
    ``drop_last``, ``pin_memory``, timeout and prefetch factor.
    """
    return {"batch_size": loader.batch_size, "num_workers": loader.num_workers, "pin_memory": loader.pin_memory,
            "drop_last": loader.drop_last, "worker_init_fn": loader.worker_init_fn, "generator": loader.generator,
            "timeout": loader.timeout, "prefetch_factor": loader.prefetch_factor}


def loader_settings(loader: Any) -> tuple[dict[str, Any], Any]:
    """``(settings, sampler)`` of a person's map-style ``DataLoader``: what the workers' loaders keep.

    Lightning and accelerate keep every setting of a loader and swap only its
    sampler for a distributed one, so nbddp does too: ``shuffle`` is read
    from the sampler (a ``RandomSampler`` shuffles, a ``SequentialSampler``
    keeps the order), and any other sampler is returned to be shared out per
    rank (``worker/data/datasets.py``, ``RankShareSampler``).
    """
    from torch.utils.data import RandomSampler, SequentialSampler

    sampler = loader.sampler
    settings = {"batch_size": loader.batch_size, "shuffle": isinstance(sampler, RandomSampler),
                "num_workers": loader.num_workers, "pin_memory": loader.pin_memory, "drop_last": loader.drop_last,
                "worker_init_fn": loader.worker_init_fn, "generator": loader.generator, "timeout": loader.timeout,
                "prefetch_factor": loader.prefetch_factor}
    return settings, None if isinstance(sampler, (RandomSampler, SequentialSampler)) else sampler
