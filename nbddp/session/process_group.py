"""Forming the process group: probe the engines, assign ranks, meet, join.

A failed group cannot be reused, so after any failure the group is formed
again as generation ``g + 1`` on a fresh store. On one host the store is a
file in ``/dev/shm`` (no TCP listener at all); across hosts it is rank 0's
address on a port free there.

The result is one immutable ``GroupState``. The session swaps it in whole,
so a reader (``status()``, a view) never sees the ranks of one generation
with the number of another.
"""

from __future__ import annotations

import contextlib
import glob
import os
import time
from dataclasses import dataclass, field

from nbddp.cluster.engines import Workers
from nbddp.protocol import placement as topology
from nbddp.protocol.errors import ClusterError
from nbddp.protocol.notes import shm_dir
from nbddp.session.start_options import StartOptions
from nbddp.execution.send import on_engines, to_engine, to_ranks

JOIN_TIMEOUT_S = 120.0
PROBE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class GroupState:
    """One generation of the process group, as every rank joined it."""

    generation: int
    backend: str
    placements: tuple[topology.Placement, ...]
    probes: tuple[topology.Probe, ...]
    init_method: str  # file://... on one host, tcp://addr:port across hosts
    master_addr: str
    master_port: int
    allocator: tuple[str, ...] = field(default=())  # what each worker's C allocator runs with (worker/memory/allocator.py)

    @property
    def world_size(self) -> int:
        return len(self.placements)

    def by_rank(self) -> dict[int, topology.Placement]:
        return {p.rank: p for p in self.placements}


def check_versions(probes: list[topology.Probe]) -> None:
    """The workers must run the kernel's Python (minor version) and torch (release).

    Code travels by value: a function pickled by Python 3.11 does not load in
    3.12, and tensors and modules pickled by one torch may not load in another.

    Raises:
        ClusterError: naming the kernel's versions and each differing worker's.
    """
    import sys

    import torch

    kernel_py = ".".join(map(str, sys.version_info[:2]))
    kernel_torch = torch.__version__.split("+")[0]
    bad = []
    for p in probes:
        py = ".".join(p.python.split(".")[:2])
        th = p.torch_version.split("+")[0]
        if (p.python and py != kernel_py) or (p.torch_version and th != kernel_torch):
            bad.append(f"engine {p.engine_id} on {p.host}: Python {p.python}, torch {p.torch_version}")
    if bad:
        raise ClusterError(
            f"the workers run other versions than this kernel (Python {sys.version.split()[0]}, torch {torch.__version__}): "
            f"{'; '.join(bad)}. Code and tensors travel pickled, so both sides need the same Python minor version and "
            "torch release: start the engines from the kernel's environment, or install the same versions there."
        )


class GroupFormer:
    """Probes engines and joins them into one generation of the process group."""

    def __init__(self, workers: Workers, file_prefix: str, token: str):
        self.workers = workers
        self.file_prefix = file_prefix
        self.token = token
        self.token_path = os.path.join(shm_dir(), f"{file_prefix}-probe")

    def probe(self) -> list[topology.Probe]:
        """Ask every engine where it runs; record their pids for killing by pid."""
        from nbddp.worker.tasks.probe import probe
        with open(os.open(self.token_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write(self.token)
        host = self.workers.controller_host
        # engines of an attached cluster must outlive this kernel: only our own engines watch it
        kernel_pid = os.getpid() if self.workers.owned else 0
        client = self.workers.client
        try:
            ars = {eid: to_engine(client, eid, probe, eid, host, self.token_path, self.token, kernel_pid,
                                  self.file_prefix) for eid in self.workers.ids}
            probes = [ar.get(timeout=PROBE_TIMEOUT_S) for ar in ars.values()]
        finally:  # read only while probing: a kernel killed later leaves no token file behind
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.token_path)
        self.workers.pids.update({p.engine_id: p.pid for p in probes})
        return probes

    def form(self, options: StartOptions, generation: int, probes: list[topology.Probe]) -> GroupState:
        """Assign ranks over ``probes`` and join every engine as ``generation``."""
        from nbddp.worker.tasks.process_group import join_process_group

        check_versions(probes)
        backend = options.backend
        if backend is None:  # attached clusters: decide from what the engines see
            backend = "nccl" if all(p.cuda_devices for p in probes) else "gloo"
        placements = topology.assign(probes, backend)
        init_method, master, port, ifnames = self._rendezvous(placements, probes, options, generation)
        threads = options.threads or 0  # 0: each engine counts the CPUs of its own host (protocol/cpus.py)
        client = self.workers.client
        ars = to_ranks(client, placements, join_process_group,
                       lambda p: (p, backend, init_method, generation, options.timeout, threads, ifnames[p.rank],
                                  self.file_prefix, master, port))
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        joined = [ar.get(timeout=max(1.0, deadline - time.monotonic())) for ar in ars.values()]
        self._remove_old_stores(generation)
        return GroupState(generation=generation, backend=backend, placements=tuple(placements), probes=tuple(probes),
                          init_method=init_method, master_addr=master, master_port=port,
                          allocator=tuple(sorted({j.allocator for j in joined})))

    def _rendezvous(self, placements: list[topology.Placement], probes: list[topology.Probe], options: StartOptions,
                    generation: int) -> tuple[str, str, int, dict[int, str | None]]:
        """Where the ranks meet: (init_method, master address, master port, rank -> socket interface).

        One host that shares the kernel's file system: a file store in
        ``/dev/shm``, no TCP listener; the master address and port are
        still given to the ranks (frameworks read ``MASTER_ADDR``/``PORT``),
        with a port that was free when chosen. Several hosts: rank 0's
        controller-facing address on a port free there, with each rank's
        gloo/NCCL traffic on the interface carrying its address (or
        ``start(interface=...)``). The torch store listens on rank 0 only.
        """
        from nbddp.protocol.host import free_port

        single_host = len({p.host for p in placements}) == 1 and all(p.local for p in placements)
        if single_host:
            path = os.path.join(shm_dir(), f"{self.file_prefix}-pg-{generation}")
            # torch's FileStore creates its file with the umask's mode (0644): made first, owner-only, it keeps 0600
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
            ifname = options.interface or "lo"
            return f"file://{path}", "127.0.0.1", free_port("127.0.0.1"), {p.rank: ifname for p in placements}
        master = topology.master_address(placements)
        ifnames = topology.socket_interfaces(placements, probes, options.interface)
        port = to_engine(self.workers.client, placements[0].engine_id, free_port, master).get()
        return f"tcp://{master}:{port}", master, port, ifnames

    def _remove_old_stores(self, generation: int) -> None:
        """The previous generation's file store is dead once every rank joined the new one."""
        for old in glob.glob(os.path.join(shm_dir(), glob.escape(f"{self.file_prefix}-pg-") + "*")):
            if not old.endswith(f"-pg-{generation}"):
                os.unlink(old)

    def leave(self) -> None:
        """Tear the group down on every engine (an attached cluster's engines live on)."""
        from nbddp.worker.tasks.process_group import leave_process_group

        try:
            on_engines(self.workers.client, self.workers.ids, leave_process_group)
        except Exception:  # noqa: BLE001 - best effort on an attached cluster
            pass
