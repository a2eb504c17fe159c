"""DataLoader worker processes inside an engine: how they start, what reaches them, when they end.

* **Start method.** Linux forks loader workers by default, which is cheap and
  sees the parent's objects as they are. Once CUDA is initialised in the
  engine a forked child cannot use it ("Cannot re-initialize CUDA in forked
  subprocess"), and a fork of a process holding CUDA contexts is undefined,
  so then the workers come from a *forkserver* (``start_method``): a clean
  process, started once per engine, that imported torch once; each loader
  worker forks from it, never from the engine. Spawning each worker instead
  would import torch again in every one, every fit: 5-10 s here against
  0.3 s from the forkserver (measured on a loaded 2-core VM).
* **By value.** Those workers unpickle their dataset and collate function
  with plain pickle, which finds classes by name; a class defined in a
  notebook cell (shipped to the engine by value with cloudpickle) has no name
  to import there. ``by_value`` wraps them so that they travel with
  cloudpickle, as they reached the engine.
* **Persistence.** With ``num_workers > 0`` the workers live across epochs
  (``persistent_workers=True``) instead of being started again each epoch,
  and every loader a fit made is shut down when the fit ends
  (``close_all``), so no worker process outlives its fit.
"""

from __future__ import annotations

import io
import pickle
import weakref
from typing import Any, Callable

import cloudpickle
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

_OPEN: "weakref.WeakSet[DataLoader]" = weakref.WeakSet()  # loaders with worker processes, until close_all


def start_method() -> str | None:
    """``"forkserver"`` once CUDA is initialised in this process; else None (the platform's default, fork on Linux)."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    torch.multiprocessing.get_context("forkserver").set_forkserver_preload(["torch"])  # read when the server starts
    return "forkserver"


class _KeepShared(cloudpickle.CloudPickler):
    """cloudpickle, except tensors in shared memory: those stay out of band, for torch's own pickling to share."""

    def __init__(self, file: Any, shared: list[torch.Tensor]):
        super().__init__(file, protocol=5)
        self.shared = shared

    def persistent_id(self, obj: Any) -> int | None:
        if isinstance(obj, torch.Tensor) and obj.is_shared():
            self.shared.append(obj)
            return len(self.shared) - 1
        return None


class _WithShared(pickle.Unpickler):
    def __init__(self, file: Any, shared: list[torch.Tensor]):
        super().__init__(file)
        self.shared = shared

    def persistent_load(self, pid: Any) -> torch.Tensor:
        return self.shared[pid]


def _rebuild(cls: type[ByValue], blob: bytes, shared: list[torch.Tensor]) -> ByValue:
    obj = cls.__new__(cls)
    obj.__dict__.update(_WithShared(io.BytesIO(blob), shared).load())
    return obj


class ByValue:
    """Pickled with cloudpickle: its class by name (an nbddp class), what it holds by value.

    A tensor in shared memory (the epoch counter a dataset shares with its
    persistent loader workers, a dataset's shipped tensors) is left to torch's
    pickling, so the loader worker shares it instead of holding a copy.
    """

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        buf = io.BytesIO()
        shared: list[torch.Tensor] = []
        _KeepShared(buf, shared).dump(self.__dict__)
        return _rebuild, (type(self), buf.getvalue(), shared)


class MapByValue(ByValue, Dataset):
    """A map-style dataset that reaches a loader worker started afresh (forkserver, spawn) by value."""

    def __init__(self, inner: Any):
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: Any) -> Any:
        return self.inner[index]

    def __getitems__(self, indices: list[Any]) -> Any:
        # a Hugging Face Dataset reads a whole batch at once through __getitems__; keep that fast path
        batched = getattr(self.inner, "__getitems__", None)
        return batched(indices) if batched is not None else [self.inner[i] for i in indices]


class StreamByValue(ByValue, IterableDataset):
    """A stream that reaches a loader worker started afresh by value (its state and epoch still reachable)."""

    def __init__(self, inner: Any):
        self.inner = inner

    def __iter__(self) -> Any:
        return iter(self.inner)

    def state_dict(self) -> Any:
        return self.inner.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.inner.load_state_dict(state)


class CallByValue(ByValue):
    """A function (a collate_fn) that reaches a loader worker started afresh (forkserver, spawn) by value."""

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)


def by_value(dataset: Any, collate_fn: Callable | None, method: str | None) -> tuple[Any, Callable | None]:
    """``dataset`` and ``collate_fn`` ready for workers started with ``method`` (fork needs nothing: the
    children already hold them)."""
    if method in (None, "fork"):
        return dataset, collate_fn
    if not isinstance(dataset, ByValue):
        dataset = StreamByValue(dataset) if isinstance(dataset, IterableDataset) else MapByValue(dataset)
    if collate_fn is not None and not isinstance(collate_fn, ByValue):
        collate_fn = CallByValue(collate_fn)
    return dataset, collate_fn


def worker_kwargs(num_workers: int, method: str | None = None) -> dict[str, Any]:
    """The DataLoader settings for ``num_workers`` loader processes started with ``method``."""
    if num_workers <= 0:
        return {"num_workers": 0}
    return {"num_workers": num_workers, "persistent_workers": True, "multiprocessing_context": method}


def loader(dataset: Any, **kwargs: Any) -> DataLoader:
    """A DataLoader that ``close_all`` shuts down when the fit ends."""
    made = DataLoader(dataset, **kwargs)
    if made.num_workers > 0:
        _OPEN.add(made)
    return made


def close(made: Any) -> None:
    """Stop a loader's persistent worker processes now, not whenever the garbage collector gets to it."""
    iterator = getattr(made, "_iterator", None)  # torch keeps the persistent workers' iterator there
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
    if hasattr(made, "_iterator"):
        made._iterator = None


def close_all() -> None:
    """Every loader with workers that this process opened since the last call (the end of a fit)."""
    for made in list(_OPEN):
        close(made)
        _OPEN.discard(made)
