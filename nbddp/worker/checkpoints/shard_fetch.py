"""A relaunch across hosts of a sharded fit: every rank's reads put together from the files its peers' hosts hold.

After a lost host (or a lost Slurm job whose new nodes hold only parts of
a snapshot) no host may hold a whole step, but the hosts together do
(``shard_copies.py``). Two collectives, on the relaunched group:

* ``newest``, before the model is wrapped: every rank says what its host
  holds (``shard_copies.listing``); all take the newest step whose every
  file is on some host (``protocol.snapshot_pieces.newest_covered``, the
  rule the kernel applies to a lost Slurm job too), and its ``.metadata``
  and ``loop.pt`` are copied to each host that lacks them;
* ``fetch_reads``, once the model and optimizer are built: every rank names
  the files DCP's load will read on it (``sharded.reads``: its own shard,
  and those holding the replicated entries DCP saved once), and one holder
  sends each file to one rank of each host that lacks it.

The copies travel through host memory over gloo (the default group when it
is gloo, else a gloo group made for it), as ``peer_copies.fetch_newest``'s do.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.distributed as dist

from nbddp.protocol.snapshot_pieces import newest_covered, path_of
from nbddp.worker.checkpoints import files as ckpt
from nbddp.worker.checkpoints.shard_copies import PART, listing, read_bytes, write_bytes


def newest(directory: str, host: str, world: int) -> str | None:
    """Collective: the snapshot every rank resumes from (None: none can be put together), its ``.metadata`` and
    ``loop.pt`` on every host."""
    with _gloo() as group:
        held: list[Any] = [None] * world
        dist.all_gather_object(held, (host, listing(directory)), group=group)
        listings = [entry for _, entry in held]
        step = newest_covered(listings)
        if step is None:
            return None
        path = os.path.join(directory, os.path.basename(path_of(listings, step)))  # (the same path on every host)
        hosts = [h for h, _ in held]
        have = [set((entry.get(step) or {}).get("have", ())) for entry in listings]
        index = {ckpt.SHARDED_METADATA, ckpt.SHARDED_LOOP_FILE}
        _move(path, plan_transfers(hosts, have, [index] * world), group)
        return path


def fetch_reads(path: str, reads: set[str], host: str, world: int) -> int:
    """Collective: the files in ``reads`` (names in ``path``) onto this rank's host; the copies made, all ranks."""
    with _gloo() as group:
        held: list[Any] = [None] * world
        here = {n for n in os.listdir(path) if PART not in n} if os.path.isdir(path) else set()
        dist.all_gather_object(held, (host, sorted(here), sorted(reads)), group=group)
        transfers = plan_transfers([h for h, _, _ in held], [set(h) for _, h, _ in held], [set(r) for _, _, r in held])
        _move(path, transfers, group)
        return len(transfers)


def plan_transfers(hosts: list[str], have: list[set[str]], wants: list[set[str]]) -> list[tuple[str, int, int]]:
    """``(name, from rank, to rank)`` for each file a rank wants and its host lacks: one copy a host, sent by the
    lowest rank whose host holds it, received by the lowest rank of that host that wants it. The same list on
    every rank, so the sends and receives, run in its order, always meet.

    Raises:
        FileNotFoundError: a wanted file is on no host (the snapshot is not whole anywhere).
    """
    transfers = []
    for name in sorted(set().union(*wants)):
        holders = [r for r, h in enumerate(have) if name in h]
        if not holders:
            raise FileNotFoundError(f"nbddp: a relaunch needs the snapshot file {name!r}, and no host of the fit holds "
                                    f"it (the hosts lost since the snapshot held every copy); the fit cannot resume "
                                    "from this snapshot")
        for host in sorted(set(hosts)):
            ranks = [r for r, h in enumerate(hosts) if h == host]
            wanting = [r for r in ranks if name in wants[r]]
            if wanting and not any(name in have[r] for r in ranks):
                transfers.append((name, holders[0], wanting[0]))
    return transfers


def _move(path: str, transfers: list[tuple[str, int, int]], group: Any) -> None:
    """Run ``transfers`` in order (one at a time, so none waits on another), then a barrier: every copy written."""
    rank = dist.get_rank()
    for name, src, dst in transfers:
        if rank == src:
            data = read_bytes(os.path.join(path, name))
            dist.send(torch.tensor([data.numel()], dtype=torch.int64), dst, group=group)
            dist.send(data, dst, group=group)
        elif rank == dst:
            size = torch.zeros(1, dtype=torch.int64)
            dist.recv(size, src, group=group)
            data = torch.empty(int(size.item()), dtype=torch.uint8)
            dist.recv(data, src, group=group)
            write_bytes(path, name, data)
    dist.barrier(group=group)


@contextmanager
def _gloo() -> Iterator[Any]:
    """The group the bytes go over: the default one when it is gloo, else a gloo group for this collective."""
    group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    try:
        yield group
    finally:
        if group is not None:
            dist.destroy_process_group(group)
