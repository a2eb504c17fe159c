"""In-memory snapshots of an elastic fit (``dist_fit(max_restarts=...)``): when, and owner-only.

A snapshot IS a checkpoint (``files.py`` for a replicated model, ``sharded.py``
for shards: every rank writes its own), written into the folder the kernel
made for this fit in ``/dev/shm`` (0700), so it outlives any rank's process
and is read back by the exact ``resume=`` path. Both formats write under a
temporary name and rename, and the newest ``KEEP`` are kept: a rank killed
mid-write leaves the previous whole snapshot, which is the double buffer.

When one is due must be the same answer on every rank (writing is
collective): steps and epochs are; a time interval is decided at the
reporter's synchronisation steps (the same on every rank) by one small
``all_reduce`` of "my interval has passed".
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Iterator

import torch
import torch.distributed as dist

from nbddp.protocol.fit_options import AUTO_SNAPSHOT_COST, AUTO_SNAPSHOT_S, FitConfig
from nbddp.worker.checkpoints import files as ckpt

KEEP = 2  # the last whole snapshot survives a death while the next one is written


class SnapshotClock:
    """When this fit writes its next snapshot (``cfg.snapshot_every``), and what writing them cost."""

    def __init__(self, cfg: FitConfig, device: torch.device, group: Any = None):
        self.every = cfg.snapshot_every
        self.directory = cfg.snapshot_dir
        self.device = device
        self.group = group
        self.last = time.monotonic()
        self.last_cost = 0.0  # seconds the last snapshot took on this rank
        self.total_s = 0.0  # seconds spent writing snapshots in this fit (History.timings["snapshot_s"])
        self.count = 0

    @property
    def by_time(self) -> bool:
        return isinstance(self.every, float) or self.every == "auto"

    def due(self, step: int, sync_step: bool) -> bool:
        """Whether a snapshot follows this optimizer step (collective when timed and ``sync_step``)."""
        if isinstance(self.every, int):
            return step % self.every == 0
        if not self.by_time or not sync_step:
            return False
        wait = self.every
        if self.every == "auto":  # stretched so that writing costs at most AUTO_SNAPSHOT_COST of the time
            wait = max(AUTO_SNAPSHOT_S, self.last_cost / AUTO_SNAPSHOT_COST)
        flag = torch.tensor([1.0 if time.monotonic() - self.last >= wait else 0.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return flag.item() > 0

    @property
    def at_epoch_end(self) -> bool:
        return self.every == "epoch"

    @contextlib.contextmanager
    def writing(self, rank: int) -> Iterator[None]:
        """Around one snapshot: files owner-only (0600), the oldest beyond ``KEEP`` removed, the cost kept."""
        t0 = time.monotonic()
        before = os.umask(0o077)
        try:
            yield
        finally:
            os.umask(before)
        if rank == 0:
            ckpt.prune(self.directory, KEEP)
        self.last = time.monotonic()
        self.last_cost = self.last - t0
        self.total_s += self.last_cost
        self.count += 1


def latest(cfg: FitConfig) -> str | None:
    """The newest whole snapshot of this fit, or None when none was written before the failure."""
    if not cfg.snapshot_dir or not os.path.isdir(cfg.snapshot_dir):
        return None
    return ckpt.latest(cfg.snapshot_dir)
