"""A copy of each snapshot in another host's memory, so that a lost host loses nothing.

Only when the ranks span more than one host: ranks on one host share its
``/dev/shm`` folder already. Each host keeps its own folder at the same path
(``cfg.snapshot_dir``, 0700, made by the first rank there that writes), and:

* **after each snapshot** the rank that wrote it (rank 0: a replicated fit's
  snapshot is one file) sends its bytes, from the writer's thread, to its
  *peer*: the next rank after it, in rank order, on another host (rank
  ``r + 1`` when each host holds one rank); the peer's writer thread
  receives them into its own host's folder (temporary name, then renamed;
  the newest ``KEEP`` kept). Both run on the writer's gloo side group, apart
  from training's collectives;
* **at a relaunch** (``fetch_newest``, collective) every rank says which whole
  snapshots its host holds; the newest any host holds is sent by one holder
  to each rank whose host lacks it (a replacement on a new or wiped host),
  so every rank resumes from the same one.

A sharded snapshot (FSDP, pipeline, tensor parallel) is one folder that every
rank writes its part of: ``shard_copies.py`` copies each rank's files to its
peer's host, and ``shard_fetch.py`` puts each rank's reads together at a
relaunch.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from nbddp.worker.checkpoints import files as ckpt


def spans_hosts(placement: Any) -> bool:
    """Whether this fit's ranks are on more than one host (the same answer on every rank)."""
    return placement is not None and placement.local_world_size < placement.world_size


def peer_of(rank: int, hosts: list[str]) -> int | None:
    """The rank holding ``rank``'s copy: the next one after it on another host (None: all on one host)."""
    world = len(hosts)
    for step in range(1, world):
        other = (rank + step) % world
        if hosts[other] != hosts[rank]:
            return other
    return None


class PeerCopies:
    """This rank's part in copying a replicated fit's snapshots (rank 0's file) to another host."""

    def __init__(self, rank: int, hosts: list[str], directory: str, keep: int):
        self.rank, self.directory, self.keep = rank, directory, keep
        self.peer = peer_of(0, hosts)  # the writer is rank 0

    def job(self, write: Any, step: int, group: Any) -> Any:
        """What this rank's writer thread does for the snapshot of ``step`` (None: nothing)."""
        if self.rank == 0 and self.peer is not None:
            return lambda: _write_then_send(write, ckpt.path_for(self.directory, step), self.peer, group)
        if self.rank == self.peer:
            return lambda: receive_file(self.directory, step, 0, group, keep=self.keep)
        return write


def _write_then_send(write: Any, path: str, peer: int, group: Any) -> None:
    """Rank 0's write of ``path`` (None: written already, inline), then its bytes to the peer, which waits for them
    either way."""
    written = False
    try:
        if write is not None:
            write()
        written = True
    finally:
        send_file(path if written else None, peer, group)  # a failed write sends nothing; its error is raised later


def send_file(path: str | None, dst: int, group: Any) -> None:
    """``path``'s bytes to global rank ``dst`` over ``group`` (a size of 0: nothing this time)."""
    data = b""
    if path is not None:
        with open(path, "rb") as f:
            data = f.read()
    dist.send(torch.tensor([len(data)], dtype=torch.int64), dst, group=group)
    if data:
        dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst, group=group)


def receive_file(directory: str, step: int, src: int, group: Any, keep: int | None = None) -> str | None:
    """A snapshot file from global rank ``src``, written into ``directory`` (0600, renamed once whole)."""
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src, group=group)
    if int(size.item()) == 0:
        return None
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(data, src, group=group)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    final = ckpt.path_for(directory, step)
    ckpt.write_private(final, data.numpy())
    if keep is not None:
        ckpt.prune(directory, keep)
    return final


def fetch_newest(directory: str, rank: int, world: int) -> str | None:
    """Collective: the newest snapshot any host holds, received from a holder where this host lacks it."""
    held: list[Any] = [None] * world
    dist.all_gather_object(held, list(ckpt.whole(directory)))  # the steps this host holds whole
    steps = {s for h in held for s in h}
    if not steps:
        return None
    newest = max(steps)
    holder = min(r for r, h in enumerate(held) if newest in h)
    lacking = [r for r, h in enumerate(held) if newest not in h]
    group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")  # bytes go through host memory
    try:
        if rank == holder:
            for r in lacking:
                send_file(ckpt.path_for(directory, newest), r, group)
        elif rank in lacking:
            receive_file(directory, newest, holder, group)
    finally:
        if group is not None:
            dist.destroy_process_group(group)
    return ckpt.path_for(directory, newest)
