"""Streams as training data: each rank, and each of its loader workers, reads its own part of the stream.

How a stream (an ``IterableDataset``) is split:

* a Hugging Face ``datasets.IterableDataset`` goes through
  ``datasets.distributed.split_dataset_by_node``: whole files (shards) per
  rank when their number divides by the world size, else every
  ``world``-th example. Its own ``__iter__`` then splits the rank's shards
  among the loader workers;
* a dataset with a true ``shards_itself`` attribute is left alone: it reads
  ``torch.distributed.get_rank()`` (or ``RANK``) and
  ``torch.utils.data.get_worker_info()`` itself;
* anything else is rank-strided (``RankShard``): sample ``i`` of the stream
  goes to rank ``r`` and loader worker ``w`` of ``W`` when
  ``i % (world * W) == r * W + w``. Every rank reads the whole stream and
  keeps its part.

An epoch is one pass over the stream; it ends at the first batch some rank
does not have (``worker/data/batch_agreement.py``). Each batch carries where its loader
worker stood after it (``PositionCollate``): a checkpoint stores, for every
rank, how many batches and samples it trained and, for a dataset with its own
``state_dict()``/``load_state_dict()``, that state per loader worker, so a
resumed fit starts right after the last checkpointed sample. Without a
state the resumed fit reads the epoch's first batches again and skips them.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Iterator, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info
from torch.utils.data.dataloader import default_collate, default_convert

from nbddp.protocol import data_forms as dataforms
from nbddp.worker.data import loaders
from nbddp.worker.data.batch_agreement import Agreement, EpochFeed, lockstep


@runtime_checkable
class Resumable(Protocol):
    """A stream that says where it stands and starts there again (what ``stateful`` looks for)."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


def resumable(ds: object) -> Resumable:
    """``ds`` (a loader worker's copy of a stateful stream) as one that can say and take its state."""
    if not isinstance(ds, Resumable):
        raise TypeError(f"this fit resumes its stream from a saved state, but the loader worker's dataset "
                        f"({type(ds).__name__}) has no state_dict()/load_state_dict(); give the stream both, or "
                        "neither (the epoch's first batches are then read again and skipped)")
    return ds


def stateful(ds: Any) -> bool:
    """Whether the dataset can say where it stands (``state_dict``) and start there (``load_state_dict``)."""
    if isinstance(ds, RankShard):
        return stateful(ds.inner)
    return callable(getattr(ds, "state_dict", None)) and callable(getattr(ds, "load_state_dict", None))


class RankShard(loaders.ByValue, IterableDataset):
    """Every ``world * workers``-th sample of ``inner``, starting at this (rank, loader worker)'s own.

    ``keep_all``: ``inner`` shards itself; then only the epoch (shared with
    persistent loader workers, so that ``set_epoch`` reaches them) and the
    position are this wrapper's.
    """

    def __init__(self, inner: Any, rank: int, world: int, keep_all: bool = False):
        self.inner, self.rank, self.world, self.keep_all = inner, rank, world, keep_all
        self.seen = 0  # samples of inner read in this pass
        self.resume: dict[str, Any] | None = None  # the state to start the next pass from (once)
        self.worker_as: int | None = None  # in a resumed loader worker: the worker whose part it reads (LoadStates)
        self.epoch = torch.zeros((), dtype=torch.int64).share_memory_()  # set in the engine, read in its loader workers

    def set_epoch(self, epoch: int) -> None:
        self.epoch.fill_(epoch)

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        worker = worker if self.worker_as is None else self.worker_as
        n, mine = self.world * workers, self.rank * workers + worker
        if callable(getattr(self.inner, "set_epoch", None)):
            self.inner.set_epoch(int(self.epoch))
        start, self.resume = self.resume, None
        self.seen = 0
        if start is not None:
            self.inner.load_state_dict(start["inner"])
            self.seen = start["seen"]
        for item in self.inner:
            index = self.seen
            self.seen += 1
            if self.keep_all or index % n == mine:
                yield item

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict(), "seen": self.seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.resume = state


def split(ds: Any, rank: int, world: int) -> tuple[Any, str]:
    """This rank's part of the stream, and how it was split: ``"self"``, ``"hf"`` or ``"strided"``."""
    if getattr(ds, "shards_itself", False):
        return RankShard(ds, rank, world, keep_all=True), "self"
    if dataforms.is_hf_iterable(ds):
        from datasets.distributed import split_dataset_by_node

        return split_dataset_by_node(ds, rank=rank, world_size=world), "hf"
    return RankShard(ds, rank, world), "strided"


class PositionCollate(loaders.ByValue):
    """The user's collate, plus where the loader worker stands after the batch: ``(batch, (worker, state))``."""

    def __init__(self, collate: Callable[[Any], Any], dataset: Any, with_state: bool):
        self.collate, self.dataset, self.with_state = collate, dataset, with_state

    def __call__(self, samples: Any) -> tuple[Any, tuple[int, Any]]:
        info = get_worker_info()
        ds = info.dataset if info is not None else self.dataset
        state = resumable(ds).state_dict() if self.with_state else None
        worker = getattr(ds, "worker_as", None)
        worker = worker if worker is not None else (info.id if info is not None else 0)
        return self.collate(samples), (worker, state)


class LoadStates(loaders.ByValue):
    """``worker_init_fn``: each loader worker starts its copy of the dataset from its checkpointed state.

    A loader hands out its workers' batches round-robin from worker 0. After
    a checkpoint whose next batch was worker ``k``'s, loader worker ``w`` of
    a rank-strided stream reads the part of worker ``(w + k) % W`` (``offset``),
    so the resumed epoch hands out the batches in the uninterrupted order.
    """

    def __init__(self, states: dict[int, Any], offset: int = 0, then: Callable[[int], Any] | None = None):
        self.states, self.offset, self.then = states, offset, then

    def __call__(self, worker_id: int) -> None:
        info = get_worker_info()
        if info is None:
            raise RuntimeError("LoadStates is a DataLoader worker_init_fn: it runs in a loader worker process, but "
                               "here get_worker_info() is None; use it with DataLoader(num_workers > 0) only")
        original = (worker_id + self.offset) % info.num_workers
        if isinstance(info.dataset, RankShard):
            info.dataset.worker_as = original
        if original in self.states:
            resumable(info.dataset).load_state_dict(self.states[original])
        if self.then is not None:  # the person's own DataLoader(worker_init_fn=...)
            self.then(worker_id)


class Stream:
    """One fit's training stream on one rank: its loader, the epoch being read, where it stands."""

    def __init__(self, dataset: Any, spec: Any, cfg: Any, rank: int, world: int, device: torch.device,
                 agreement: Agreement):
        from nbddp.worker.data.datasets import kept_settings, loader_kwargs

        self.cfg, self.rank, self.agreement = cfg, rank, agreement
        self.dataset, self.split = split(dataset, rank, world)
        self.with_state = stateful(self.dataset)
        self.kwargs = loader_kwargs(device, cfg.num_workers, cfg.pin_memory)
        self.num_workers = self.kwargs["num_workers"]
        # a person's DataLoader over the stream: its worker_init_fn, generator, timeout, prefetch_factor, drop_last
        self.kwargs.update(kept_settings(spec, self.num_workers))
        self.worker_init_fn = self.kwargs.pop("worker_init_fn", None)
        self.drop_last = cfg.drop_last or bool((spec.loader or {}).get("drop_last"))
        self.batch_size = None if spec.prebatched else cfg.batch_size
        self.collate = spec.collate_fn or (default_convert if spec.prebatched else default_collate)
        self.loader = self.make_loader()
        self.feed: EpochFeed | None = None
        self.resume_states: dict[int, Any] | None = None  # each loader worker's state at the checkpoint
        self.resume_samples = 0  # samples the resumed epoch had trained before the checkpoint
        self.by_state = False  # the epoch being read was resumed through the dataset's own state
        self.resumed_from: dict[int, Any] = {}
        self.next_worker = 0  # the loader worker whose batch came next at the checkpoint
        self.resumed_loader: Any = None

    def make_loader(self, states: dict[int, Any] | None = None, offset: int = 0) -> Any:
        collate = PositionCollate(self.collate, self.dataset if self.num_workers == 0 else None, self.with_state)
        ds, collate_fn = loaders.by_value(self.dataset, collate, self.kwargs.get("multiprocessing_context"))
        init = self.worker_init_fn
        if states:
            init = LoadStates(states, offset, init)
        elif init is not None and self.kwargs.get("multiprocessing_context") not in (None, "fork"):
            init = loaders.CallByValue(init)  # a notebook function reaches a loader worker started afresh
        return loaders.loader(ds, batch_size=self.batch_size, collate_fn=collate_fn,
                              drop_last=self.drop_last and self.batch_size is not None, worker_init_fn=init,
                              **self.kwargs)

    @property
    def batches_per_epoch(self) -> int:
        return self.feed.batches_per_epoch if self.feed is not None else sys.maxsize

    def epoch_loader(self, epoch: int, first: int) -> Any:
        """The loader for ``epoch``; ``first`` batches of it were trained before the checkpoint resumed."""
        if callable(getattr(self.dataset, "set_epoch", None)):
            self.dataset.set_epoch(epoch)
        if self.resumed_loader is not None:  # the resumed epoch is over: its workers go
            loaders.close(self.resumed_loader)
            self.resumed_loader = None
        states, self.resume_states = (self.resume_states if first else None), None
        self.by_state, self.resumed_from = bool(states), states or {}
        if not states:
            return self.loader
        if self.num_workers == 0:
            self.dataset.load_state_dict(states[0])
            return self.loader
        offset = self.next_worker if self.split == "strided" else 0  # others pick their part by worker id
        self.resumed_loader = self.make_loader(states, offset)  # this epoch only: later ones start afresh
        return self.resumed_loader

    def epoch_feed(self, batches: Iterator[Any], epoch: int, first: int) -> EpochFeed:
        local = iter(batches)
        if first and not self.by_state:
            for _ in range(first):  # the batches trained before the checkpoint, read again and dropped
                next(local, None)
        self.feed = EpochFeed(local, self.agreement, epoch, first, self.cfg.grad_accum,
                              samples=self.resume_samples if first else 0,
                              states=self.resumed_from if first and self.by_state else None)
        return self.feed

    def restore(self, extra: dict[str, Any], path: str) -> None:
        """Where a mid-epoch checkpoint left this rank's stream (nothing to do at an epoch's end)."""
        positions = extra.get("stream_per_rank")
        if not extra.get("batches_done") or not positions:
            return  # an epoch end, or a checkpoint of map-style data: its first batches are skipped
        mine = positions[self.rank]
        if mine["num_workers"] != self.num_workers:
            raise ValueError(
                f"resume={path!r}: that checkpoint was saved mid-epoch reading the stream with num_workers="
                f"{mine['num_workers']}, and this fit reads it with num_workers={self.num_workers}: loader workers "
                f"split a rank's stream between them, so the rest of that epoch cannot be found again. Resume "
                f"with num_workers={mine['num_workers']}, or from a checkpoint saved at an epoch end."
            )
        self.resume_samples = mine["samples"]
        if self.with_state and mine.get("states"):
            self.resume_states = mine["states"]
            self.next_worker = mine.get("next_worker") or 0

    def position(self, epoch: int, batches_done: int) -> dict[str, Any]:
        """How far this rank read, for a checkpoint: plain data (``torch.load`` reads it without nbddp)."""
        samples, states, worker = self.feed.position(batches_done) if self.feed is not None else (0, {}, None)
        return {"epoch": epoch, "batches": batches_done, "samples": samples, "num_workers": self.num_workers,
                "split": self.split, "states": dict(states) if self.with_state and batches_done else None,
                "next_worker": (worker + 1) % self.num_workers if worker is not None and self.num_workers else 0}


def train_stream(ds: Any, spec: Any, cfg: Any, rank: int, world: int, device: torch.device, group: Any) -> Stream:
    return Stream(ds, spec, cfg, rank, world, device, Agreement(rank, world, group))


def val_stream_loader(ds: Any, spec: Any, cfg: Any, rank: int, world: int, device: torch.device) -> Any:
    """This rank's part of a validation stream, read whole at every validation (each sample once overall)."""
    from nbddp.worker.data.datasets import kept_settings, loader_kwargs

    part, _ = split(ds, rank, world)
    own = spec.loader or {}  # a validation DataLoader over a stream: its own batch size and settings
    kwargs = loader_kwargs(device, own.get("num_workers", cfg.num_workers), own.get("pin_memory", cfg.pin_memory))
    kwargs.update(kept_settings(spec, kwargs["num_workers"]))
    method = kwargs.get("multiprocessing_context")
    if kwargs.get("worker_init_fn") is not None and method not in (None, "fork"):
        kwargs["worker_init_fn"] = loaders.CallByValue(kwargs["worker_init_fn"])
    collate = spec.collate_fn or (default_convert if spec.prebatched else default_collate)
    part, collate = loaders.by_value(part, collate, method)
    batch_size = None if spec.prebatched else own.get("batch_size") or cfg.batch_size
    return loaders.loader(part, batch_size=batch_size, collate_fn=collate, **kwargs)


def agreement(ts: Any) -> Agreement:
    if ts.agreement is None:
        ts.agreement = Agreement(ts.rank, ts.world, ts.strategy.group)
    return ts.agreement


def val_batches(ts: Any, loader: Any) -> Iterator[tuple[Any, bool]]:
    """A validation stream's ``(batch, counted)`` pairs: in lockstep when the strategy's forward is collective."""
    if not ts.strategy.lockstep_validation:
        return ((batch, True) for batch in loader)
    return lockstep(loader, agreement(ts), ts.epoch)


def gather_positions(ts: Any, batches_done: int) -> list[dict[str, Any]] | None:
    """Every rank's stream position (collective; None without a stream, on every rank alike)."""
    if ts.stream is None:
        return None
    positions: list[Any] = [None] * ts.world
    dist.all_gather_object(positions, ts.stream.position(ts.epoch, batches_done), group=ts.strategy.group)
    return positions


def epoch_record(ts: Any) -> dict[str, Any]:
    """What an epoch of a stream adds to its record: samples per rank (collective), the ranks that ran out."""
    if ts.stream is None or ts.stream.feed is None:
        return {}
    feed = ts.stream.feed
    counts = [0.0] * ts.world
    counts[ts.rank] = float(feed.samples)
    per_rank = [int(c) for c in ts.reporter.reduce_sums(counts)]
    return {"samples_per_rank": per_rank, "ended_on": list(feed.ended_on)}


def release(ts: Any) -> None:
    """At a fit's end: stop every loader worker process, destroy the flags' own group."""
    loaders.close_all()
    if ts is None:
        return
    if ts.stream is not None and ts.stream.feed is not None:
        try:
            ts.stream.feed.drain()
        except Exception:  # noqa: BLE001 - the fit's own error (already on its way) says more than this one
            pass
    if ts.agreement is not None:
        ts.agreement.close()
