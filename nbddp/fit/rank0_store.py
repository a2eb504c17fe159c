"""How one fit's kernel reaches rank 0 while it trains: the file in /dev/shm, or rank 0's torch store.

A synchronous callback's answer and ``handle.profile``'s request go to rank
0 in a small owner-only file when rank 0 runs on the kernel's host (it is
faster there: ``docs/performance.md#synchronous-callbacks``). When rank 0
runs elsewhere (SSH, MPI, Slurm), they go through the ``TCPStore`` the
ranks met at (``protocol/store_channel.py``). ``Rank0Link.open`` decides,
once per fit, before any rank starts: a store it cannot reach within
``CONNECT_TIMEOUT_S`` leaves the fit on today's behaviour (asynchronous
hooks, ``handle.profile`` refused) and ``reason`` says why.
"""

from __future__ import annotations

import secrets
from typing import Any

from nbddp.protocol import store_channel
from nbddp.protocol.store_channel import CONNECT_TIMEOUT_S, KernelStore


class Rank0Link:
    """One fit's way to rank 0: ``channel`` is "" for the file, else the fit's token in every store key."""

    def __init__(self, session: Any, channel: str = "", reason: str = "", timeout_s: float = CONNECT_TIMEOUT_S):
        self.session, self.channel, self.reason, self.timeout_s = session, channel, reason, timeout_s
        self._store: KernelStore | None = None

    @classmethod
    def open(cls, session: Any, timeout_s: float = CONNECT_TIMEOUT_S) -> "Rank0Link":
        """The file when rank 0 is on this host; else a client of rank 0's store (``reason`` set if it failed)."""
        placements = session.placements
        if not placements or getattr(placements[0], "local", True):
            return cls(session)
        link = cls(session, channel=secrets.token_hex(8), timeout_s=timeout_s)
        try:
            link.store()
        except OSError as e:
            return cls(session, reason=str(e), timeout_s=timeout_s)
        return link

    @property
    def remote(self) -> bool:
        """Rank 0 is on another host, reached through its store."""
        return bool(self.channel)

    @property
    def reachable(self) -> bool:
        """Rank 0 can be reached at all (through the file or the store)."""
        return not self.reason

    def store(self) -> KernelStore:
        """The client of the current group's store (a new one after the group re-formed: an elastic relaunch).

        Raises:
            OSError: the store did not answer within the connect timeout.
        """
        group = self.session.group
        store = self._store
        if store is None or (store.host, store.port, store.generation) != (group.master_addr, group.master_port,
                                                                           group.generation):
            store = self._store = KernelStore(group.master_addr, group.master_port, group.generation,
                                                   self.timeout_s)
        return store

    def answer_key(self, seq: int) -> str:
        return store_channel.answer_key(self.channel, self.session.generation, seq)
