"""A sharded snapshot's files on two hosts, so that one lost host loses nothing (FSDP, pipeline, tensor parallel).

A sharded snapshot is a DCP folder (``sharded.py``): one ``__<rank>_0.distcp``
per rank, DCP's ``.metadata`` and nbddp's ``loop.pt`` (rank 0's). When the
ranks span hosts, each host keeps a folder of the same path in its own
``/dev/shm``, holding what its ranks wrote; rank 0 publishes its host's
folder as before, and here the first rank on each other host publishes its
host's (renamed from ``.tmp`` once DCP's write is over on every rank). Then,
in the writers' threads, on the fit's gloo side group:

* every rank sends the files it wrote to its peer (``peer_copies.peer_of``:
  the next rank after it on another host, rank r+1 with one rank a host),
  which writes them into its host's folder, each under a temporary name and
  renamed (0600), so a file there is always whole;
* a barrier: when a rank's write of a snapshot is over, that snapshot is on
  two hosts (the next snapshot, the fit's end and a relaunch wait for it);
* the first rank on each host keeps its folder's newest ``KEEP``.

A host's folder may so hold a step only in part; ``listing`` says which
files it holds and, where its ``.metadata`` is, which a resume needs, and a
relaunch (``shard_fetch.py``) puts each rank's reads together from all hosts.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from nbddp.worker.checkpoints import files as ckpt, sharded
from nbddp.worker.checkpoints.peer_copies import peer_of

PART = ".part-"  # a copy being written: never listed


class ShardCopies:
    """This rank's part in keeping each sharded snapshot's files on a second host."""

    def __init__(self, rank: int, hosts: list[str], directory: str, keep: int):
        self.rank, self.directory, self.keep = rank, directory, keep
        self.peer = peer_of(rank, hosts)
        self.senders = [r for r in range(len(hosts)) if r != rank and peer_of(r, hosts) == rank]
        self.first_here = rank == min(r for r, h in enumerate(hosts) if h == hosts[rank])
        self.copy_s = 0.0  # seconds the copies took in the writer's thread (History.timings["snapshot_copy_s"])
        self.copy_bytes = 0  # bytes this rank sent and received

    def prepare(self, step: int) -> None:
        """On the training thread, before the save: this host's temporary folder, fresh and owner-only.

        Rank 0 makes its own host's (``sharded.save_async``); DCP would make the others with the thread's umask.
        """
        if self.first_here and self.rank != 0:
            sharded.fresh_folder(self.directory, step)

    def job(self, finish: Any, step: int, group: Any) -> Any:
        """What this rank's writer thread does for the snapshot of ``step``: DCP's write, then the copies."""
        return lambda: self._write_and_copy(finish, step, group)

    def _write_and_copy(self, finish: Any, step: int, group: Any) -> None:
        final = ckpt.dir_for(self.directory, step)
        error: BaseException | None = None
        try:
            if finish is not None:
                finish()  # DCP's write (on every rank, once any rank's is over); rank 0 publishes its host's
            if self.first_here and self.rank != 0:
                sharded.publish(final + ".tmp", final)
        except BaseException as exc:  # noqa: BLE001 - raised below, once the peers are not left waiting
            error = exc
        dist.barrier(group=group)  # every host's folder is published: the copies go into it
        t0 = time.perf_counter()
        mine = [] if error is not None else own_files(final, self.rank)
        self.copy_bytes += exchange(final, mine, self.peer, self.senders, group)
        dist.barrier(group=group)  # every copy written: this snapshot is on two hosts
        self.copy_s += time.perf_counter() - t0
        if self.first_here:
            ckpt.prune(self.directory, self.keep)
        if error is not None:
            raise error


def own_files(folder: str, rank: int) -> list[str]:
    """The files ``rank`` wrote into a snapshot folder: its DCP files, and rank 0's ``.metadata`` and ``loop.pt``."""
    names = sorted(n for n in os.listdir(folder) if n.startswith(f"__{rank}_") and PART not in n)
    return names + ([ckpt.SHARDED_METADATA, ckpt.SHARDED_LOOP_FILE] if rank == 0 else [])


def exchange(folder: str, mine: list[str], peer: int | None, senders: list[int], group: Any) -> int:
    """``mine`` (names in ``folder``) to ``peer``, and each sender's files into ``folder``; the bytes moved.

    Sends and receives are posted together (``isend``/``irecv``): every rank sends and receives at once, which
    blocking calls in a ring would deadlock on. First the manifests' sizes, then the manifests, then the bytes.
    """
    datas = [read_bytes(os.path.join(folder, n)) for n in mine]
    manifest = _tensor(json.dumps([[n, int(d.numel())] for n, d in zip(mine, datas)]).encode())
    sizes = {s: torch.zeros(1, dtype=torch.int64) for s in senders}
    _together([(torch.tensor([manifest.numel()], dtype=torch.int64), peer)], sizes, group)
    manifests = {s: torch.empty(int(t.item()), dtype=torch.uint8) for s, t in sizes.items()}
    _together([(manifest, peer)], manifests, group)
    wanted = {s: json.loads(t.numpy().tobytes()) for s, t in manifests.items()}
    incoming = [(s, name, torch.empty(size, dtype=torch.uint8)) for s, names in wanted.items() for name, size in names]
    reqs = [dist.isend(d, peer, group=group) for d in datas if peer is not None]
    reqs += [dist.irecv(buf, s, group=group) for s, _, buf in incoming]
    _wait_all(reqs)
    for _, name, buf in incoming:
        write_bytes(folder, name, buf)
    return sum(int(d.numel()) for d in datas) + sum(int(buf.numel()) for _, _, buf in incoming)


def _together(out: list[tuple[torch.Tensor, int | None]], into: dict[int, torch.Tensor], group: Any) -> None:
    reqs = [dist.isend(t, dst, group=group) for t, dst in out if dst is not None]
    reqs += [dist.irecv(t, src, group=group) for src, t in into.items()]
    _wait_all(reqs)


def _wait_all(reqs: list[dist.Work | None]) -> None:
    """Wait for each send and receive; torch returns None for one that this rank, outside ``group``, never posted."""
    for req in reqs:
        if req is not None:
            req.wait()


def _tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def read_bytes(path: str) -> torch.Tensor:
    """A file's bytes as a uint8 tensor, to send."""
    with open(path, "rb") as f:
        return _tensor(f.read())


def write_bytes(folder: str, name: str, data: torch.Tensor) -> None:
    """``data`` as ``folder/name``: the folder made owner-only if missing, the file 0600, renamed once whole."""
    os.makedirs(os.path.dirname(folder), mode=0o700, exist_ok=True)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    ckpt.write_private(os.path.join(folder, name), data.numpy(), tmp_marker=PART)


def listing(directory: str | None) -> dict[int, dict[str, Any]]:
    """What this host holds of each snapshot in ``directory`` (``protocol.snapshot_pieces``'s listing).

    A file snapshot (DDP) counts whole or not at all; a folder lists the files in it, and where its
    ``.metadata`` is, every file a resume reads.
    """
    out: dict[int, dict[str, Any]] = {}
    if not directory or not os.path.isdir(directory):
        return out
    for path in ckpt.list_checkpoints(directory):
        if os.path.isdir(path):
            have = sorted(n for n in os.listdir(path) if PART not in n)
            needs = ckpt.sharded_files(path)  # None where this host has no .metadata
            out[ckpt.step_of(path)] = {"path": path, "have": have, "needs": sorted(needs) if needs else None}
        elif ckpt.is_complete(path):
            name = os.path.basename(path)
            out[ckpt.step_of(path)] = {"path": path, "have": [name], "needs": [name]}
    return out
