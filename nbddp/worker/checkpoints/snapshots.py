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

The step waits only for the copy into host buffers; the write itself runs
in a thread (``background.py``), and the next snapshot, the fit's end and
a relaunch's read (``setup.wrap_and_restore``, after every rank's previous
task has ended) wait for it.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist

from nbddp.protocol.fit_options import AUTO_SNAPSHOT_COST, AUTO_SNAPSHOT_S, FitConfig
from nbddp.worker.checkpoints import background, files as ckpt, peer_copies, shard_copies, shard_fetch
from nbddp.worker.engine.rank_state import STATE

KEEP = 2  # the last whole snapshot survives a death while the next one is written


class SnapshotClock:
    """When this fit writes its next snapshot (``cfg.snapshot_every``), and what writing them cost."""

    def __init__(self, cfg: FitConfig, device: torch.device, group: Any = None, strategy: Any = None):
        if not cfg.snapshot_dir:
            raise ValueError(f"an elastic fit's snapshots need the folder the kernel makes for them "
                             f"(cfg.snapshot_dir), and this fit's is {cfg.snapshot_dir!r}; the kernel sets it for "
                             "dist_fit(max_restarts=...)")
        self.every = cfg.snapshot_every
        self.directory: str = cfg.snapshot_dir
        self.device = device
        self.group = group
        self.last = time.monotonic()
        self.last_cost = 0.0  # seconds the last snapshot took on this rank
        self.total_s = 0.0  # seconds the training thread spent on snapshots (History.timings["snapshot_s"])
        self.count = 0
        self.waited_s = 0.0  # of total_s: waiting for the previous snapshot's write to end
        self.writer = background.Writer(device)  # the writes, in its thread: History.timings["snapshot_write_s"]
        self.peers = copies_across_hosts(self.directory, strategy, group)  # (collective when the ranks span hosts)

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

    def write(self, strategy: Any, step: int, optimizer: Any, extra: dict[str, Any], rank: int) -> None:
        """One snapshot (collective): the previous write waited for, this one copied, then written by the
        writer's thread (``background.py``); files owner-only (0600), the oldest beyond ``KEEP`` removed."""
        t0 = time.monotonic()
        before = os.umask(0o077)  # what the training thread creates (a sharded snapshot's folder)
        try:
            self.writer.wait()  # its buffers are refilled now
            self.waited_s += time.monotonic() - t0  # (0 unless snapshots come faster than they are written)
            if isinstance(self.peers, shard_copies.ShardCopies):
                self.peers.prepare(step)  # this host's temporary folder, where rank 0 is not
            job = strategy.save_snapshot(self.directory, step, optimizer, extra, rank, self.writer)
            if self.peers is not None:  # a copy in another host's memory (peer_copies.py)
                job = self.peers.job(job, step, self.writer.side_group(self.group))
        finally:
            os.umask(before)
        if rank == 0 or job is not None:
            self.writer.submit(lambda: self._written(job, rank))
        self.last = time.monotonic()
        self.last_cost = self.last - t0
        self.total_s += self.last_cost
        self.count += 1

    def _written(self, job: Any, rank: int) -> None:
        """In the writer's thread: the write, then rank 0 keeps the newest ``KEEP``."""
        if job is not None:
            job()
        if rank == 0:
            ckpt.prune(self.directory, KEEP)

    def timings(self) -> dict[str, float]:
        """For ``History.timings``: what the steps waited (of which for a previous write), how many snapshots, what
        the writes took in the thread."""
        out = {"snapshot_s": self.total_s, "snapshots": self.count, "snapshot_write_s": self.writer.write_s,
               "snapshot_wait_s": self.waited_s}
        if isinstance(self.peers, shard_copies.ShardCopies):  # of snapshot_write_s: the copies to other hosts
            out.update(snapshot_copy_s=self.peers.copy_s, snapshot_copy_bytes=self.peers.copy_bytes)
        return out

    def close(self) -> None:
        """The fit's end, whatever its outcome: the last write finished (a failed one leaves the previous)."""
        self.writer.close(raise_error=False)


def copies_across_hosts(directory: str, strategy: Any, group: Any) -> Any:
    """Who copies this fit's snapshots to which host, when its ranks span hosts (collective then); else None.

    Rank 0's file for a replicated fit (``peer_copies.py``), every rank's files for a sharded one
    (``shard_copies.py``).
    """
    if strategy is None or not peer_copies.spans_hosts(STATE.placement):
        return None
    hosts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, STATE.placement.host, group=group)
    copies = peer_copies.PeerCopies if strategy.snapshot_is_one_file else shard_copies.ShardCopies
    return copies(dist.get_rank(group), hosts, directory, KEEP)


def relaunch_from(cfg: FitConfig, strategy: Any, rank: int, world: int) -> str | None:
    """Collective: the snapshot a relaunch resumes from, the same on every rank (``setup.wrap_and_restore``).

    Across hosts, the newest any host holds, copied to the hosts that lack it (a replacement's new host); for a
    sharded one, the newest whose files the hosts hold together, its index copied now and the rest of each
    rank's reads by ``before_load``.
    """
    if not cfg.snapshot_dir:  # (every rank alike) no snapshot was ever written: as latest() says
        return None
    if peer_copies.spans_hosts(STATE.placement):
        if strategy.snapshot_is_one_file:
            return peer_copies.fetch_newest(cfg.snapshot_dir, rank, world)
        return shard_fetch.newest(cfg.snapshot_dir, STATE.placement.host, world)
    return latest(cfg)


def before_load(cfg: FitConfig, strategy: Any, path: str, optimizer: Any, world: int) -> None:
    """Collective on a relaunch across hosts of a sharded fit: the files its load reads on each rank, onto that
    rank's host (from the hosts that hold them). Nothing otherwise."""
    if not (cfg.from_snapshot and cfg.snapshot_dir and peer_copies.spans_hosts(STATE.placement)) or \
            strategy.snapshot_is_one_file or os.path.dirname(os.path.abspath(path)) != os.path.abspath(cfg.snapshot_dir):
        return
    shard_fetch.fetch_reads(path, strategy.snapshot_reads(path, optimizer), STATE.placement.host, world)


def latest(cfg: FitConfig) -> str | None:
    """The newest whole snapshot of this fit, or None when none was written before the failure."""
    if not cfg.snapshot_dir or not os.path.isdir(cfg.snapshot_dir):
        return None
    return ckpt.latest(cfg.snapshot_dir)
