"""Uneven ends that never hang: the ranks agree, batch by batch, whether every rank has its next one.

A stream's shards rarely end together. Under DDP the gradient all-reduce of
a step needs every rank, so a rank whose stream ended would leave the others
waiting in ``backward`` until the process-group timeout; ``torch``'s ``Join``
instead lets the others go on with shadow collectives, which trains the long
shards further than the short ones. Here every rank stops at the same step,
the first one some rank cannot fill:

* before a batch is handed to the training loop, one tiny all-reduce (a
  vector with one slot per rank: 1 where that rank holds the batch) tells
  every rank who has it. Only a batch all ranks hold is trained;
* the all-reduce of the batch ahead is launched asynchronously and waited on
  only at the next step, so it runs while this step computes; the loop also
  knows, while training a batch, whether it is the epoch's last
  (``EpochFeed.batches_per_epoch``), so the epoch ends with its usual
  record, validation and checkpoint;
* a rank that has nothing at the start of an epoch is an error on every
  rank at once, naming it (``EmptyShard``), never a hang; so is a rank whose
  data pipeline raised: it raises its error, the others ``PeerFailed``.

Under NCCL the flags travel on a gloo group of their own, so that reading
them never waits for the GPU's queue.
"""

from __future__ import annotations

import sys
from collections import deque
from typing import Any, Iterator

import torch
import torch.distributed as dist

from nbddp.worker.data.batches import batch_size_of
from nbddp.worker.engine.heartbeat import BEAT
from nbddp.worker.engine.group_lifetime import destroy_subgroup

UNKNOWN = sys.maxsize  # the epoch's length until its end is agreed
NONE, HAVE, FAILED = 0, 1, 2  # what a rank's slot says of the batch: it has none, has it, or failed reading it


class PeerFailed(RuntimeError):
    """Raised on a rank whose own work was fine because another rank failed (never the headline in the kernel)."""


class EmptyShard(ValueError):
    """Some rank's share of a stream holds no batch: training on it could only wait forever."""


class Agreement:
    """Which ranks hold a batch: one all-reduce of one slot per rank (nothing at all with one rank)."""

    def __init__(self, rank: int, world: int, group: Any = None):
        self.rank, self.world = rank, world
        self.group = group
        self.own_group = None  # the gloo group made for the flags under another backend, destroyed by close()

    def _flag_group(self) -> Any:
        if self.group is None and self.own_group is None and dist.get_backend() != "gloo":
            self.own_group = dist.new_group(backend="gloo")  # collective: every rank makes it at its first flag
        return self.own_group if self.own_group is not None else self.group

    def launch(self, state: int) -> tuple[Any, torch.Tensor]:
        """Start telling the others this rank's ``state`` of one batch (``HAVE``, ``NONE`` or ``FAILED``)."""
        flags = torch.zeros(self.world, dtype=torch.float32)
        flags[self.rank] = float(state)
        if self.world == 1:
            return None, flags
        BEAT.mark("collective")
        return dist.all_reduce(flags, group=self._flag_group(), async_op=True), flags

    def wait(self, pending: tuple[Any, torch.Tensor]) -> list[int]:
        """Every rank's state of that batch; raises where some rank failed reading it."""
        work, flags = pending
        if work is not None:
            BEAT.mark("collective")
            work.wait()
        states = [round(v) for v in flags.tolist()]
        failed = [r for r, v in enumerate(states) if v == FAILED]
        if failed and self.rank not in failed:
            raise PeerFailed(f"rank {', '.join(map(str, failed))} failed reading its data")
        return states

    def close(self) -> None:
        if self.own_group is not None:
            destroy_subgroup(self.own_group)
            self.own_group = None


def empty_shard(have: list[bool], what: str, epoch: int) -> EmptyShard:
    missing = [r for r, h in enumerate(have) if not h]
    if len(missing) == len(have):
        return EmptyShard(f"{what} yielded no sample on any rank in epoch {epoch}. A stream that can be read only "
                          "once (a generator made in __init__) is empty the second time: make __iter__ start afresh")
    return EmptyShard(
        f"{what}: rank {', '.join(map(str, missing))} got no sample in epoch {epoch}: its share of the stream is empty "
        f"while rank {', '.join(str(r) for r, h in enumerate(have) if h)} has data. With nbddp's rank-strided split each "
        "rank needs at least one sample (per loader worker); a dataset with shards_itself=True must give every rank some"
    )


class EpochFeed:
    """One epoch of this rank's ``(batch, position)`` pairs, handed out only as far as every rank holds them.

    ``first`` batches of the epoch were trained before a mid-epoch checkpoint
    (already skipped, or restored through the dataset's state). ``accum``:
    the loop's gradient accumulation, so that a whole window is agreed
    before its first micro-batch (its length scales the loss).
    """

    def __init__(self, local: Iterator[Any], agreement: Agreement, epoch: int, first: int = 0, accum: int = 1,
                 samples: int = 0, states: dict[int, Any] | None = None):
        self.local, self.agreement, self.epoch, self.accum = local, agreement, epoch, accum
        self.first = first
        self.next_index = first  # the index of the next batch handed out
        self.confirmed: deque[Any] = deque()  # held by every rank, not handed out yet
        self.pending: deque[Any] = deque()  # (item or None, flags in flight)
        self.ended = False
        self.ended_on: list[int] = []  # ranks that had no batch where the epoch ended
        self.local_done = False
        self.error: Exception | None = None  # this rank's data pipeline raised (everyone learns at the next flags)
        self.samples = samples  # handed out this epoch (``samples``: before the checkpoint this epoch resumes)
        self.states = dict(states or {})  # loader worker -> its dataset's state after its latest batch handed out
        self.positions: deque[tuple[int, int, Any, int]] = deque(maxlen=8)  # (index, samples, states, worker)

    @property
    def batches_per_epoch(self) -> int:
        return self.next_index + len(self.confirmed) if self.ended else UNKNOWN

    def _fetch_and_launch(self) -> None:
        item, state = None, NONE
        if not self.local_done:
            BEAT.mark("data")
            try:
                item = next(self.local, None)
            except Exception as exc:  # noqa: BLE001 - told to the others first, then raised on this rank
                self.error, state = exc, FAILED
            self.local_done = item is None
        self.pending.append((item, self.agreement.launch(HAVE if item is not None else state)))

    def _settle_one(self) -> None:
        item, flags = self.pending.popleft()
        have = [s == HAVE for s in self.agreement.wait(flags)]
        if self.error is not None:
            raise self.error
        if self.ended:
            return
        if all(have):
            self.confirmed.append(item)
            return
        if self.next_index + len(self.confirmed) == 0:
            raise empty_shard(have, "the training data", self.epoch)
        self.ended, self.ended_on = True, [r for r, h in enumerate(have) if not h]

    def _needed(self) -> int:
        """Batches to hold from the next one on: to the end of its accumulation window, and one beyond."""
        i = self.next_index
        window_end = i - i % self.accum + self.accum - 1
        return window_end - i + 2

    def __iter__(self) -> "EpochFeed":
        return self

    def __next__(self) -> Any:
        while len(self.confirmed) < self._needed() and not self.ended:
            if not self.pending:
                self._fetch_and_launch()
            self._settle_one()
        if not self.confirmed:
            while self.pending:  # every rank launched the same flags: wait for all of them
                self._settle_one()
            raise StopIteration
        if not self.ended and not self.pending:
            self._fetch_and_launch()  # its all-reduce runs while the loop trains the batch handed out now
        batch, (worker, state) = self.confirmed.popleft()
        self.samples += batch_size_of(batch)
        if state is not None:
            self.states = {**self.states, worker: state}
        self.positions.append((self.next_index, self.samples, self.states, worker))
        self.next_index += 1
        return batch

    def drain(self) -> None:
        """Wait for the flags still in flight (a stop or ``max_steps`` left mid-epoch): every rank launched them."""
        while self.pending:
            item, flags = self.pending.popleft()
            self.agreement.wait(flags)

    def position(self, batches_done: int) -> tuple[int, dict[int, Any], int | None]:
        """(samples handed out this epoch, each loader worker's state, the worker of the batch) after batch
        ``batches_done - 1``."""
        for index, samples, states, worker in reversed(self.positions):
            if index == batches_done - 1:
                return samples, states, worker
        return self.samples, {}, None


def lockstep(loader: Any, agreement: Agreement, epoch: int) -> Iterator[tuple[Any, bool]]:
    """``(batch, counted)`` pairs, as many on every rank as the longest shard has batches.

    For validation under a strategy whose forward is collective (FSDP): a rank
    whose shard ended runs its last batch again, counted with weight zero.
    """
    last, started = None, False
    local = iter(loader)
    while True:
        batch = next(local, None)
        have = [s == HAVE for s in agreement.wait(agreement.launch(HAVE if batch is not None else NONE))]
        if not started and not all(have):
            raise empty_shard(have, "val_data (validated in lockstep under a sharded strategy)", epoch)
        started = True
        if not any(have):
            return
        if batch is not None:
            last = batch
            yield batch, True
        else:
            yield last, False
