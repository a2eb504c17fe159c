"""How one fit's kernel reaches rank 0 while it trains: the file in /dev/shm, or rank 0's torch store.

Whenever the ranks met at a ``TCPStore`` (a group across hosts:
``tcp://master:port``), a synchronous callback's answer and
``handle.profile``'s request go through it (``protocol/store_channel.py``):
it reaches a rank 0 on any host, and rank 0 blocks on the key instead of
polling (``benchmarks/answer_channel.py``: about 0.5 ms from the write to
rank 0 holding it, against about 3 ms for the polled file). On one host the
group's store is a ``FileStore`` the kernel must not open (it counts its
users and deletes its file), and there is no TCP listener to use: there
they go in a small owner-only file in /dev/shm that rank 0 polls.
``Rank0Link.open`` decides, once per fit, before any rank starts: a store
it cannot reach within ``CONNECT_TIMEOUT_S`` leaves the fit on the file
when rank 0 shares this host, else on asynchronous hooks and a refused
``handle.profile``, with ``reason`` saying why.
"""

from __future__ import annotations

import secrets
from nbddp.protocol import store_channel
from nbddp.protocol.store_channel import CONNECT_TIMEOUT_S, KernelStore
from nbddp.session.session import Session


class Rank0Link:
    """One fit's way to rank 0: ``channel`` is "" for the file, else the fit's token in every store key."""

    def __init__(self, session: Session, channel: str = "", reason: str = "", timeout_s: float = CONNECT_TIMEOUT_S):
        self.session, self.channel, self.reason, self.timeout_s = session, channel, reason, timeout_s
        self._store: KernelStore | None = None
        self.closed = False

    @classmethod
    def open(cls, session: Session, timeout_s: float = CONNECT_TIMEOUT_S) -> Rank0Link:
        """A client of the group's TCPStore; the file on one host (``reason`` set when neither reaches rank 0)."""
        group = getattr(session, "group", None)
        if group is None or not str(getattr(group, "init_method", "")).startswith("tcp://"):
            return cls(session)
        link = cls(session, channel=secrets.token_hex(8), timeout_s=timeout_s)
        try:
            link.store()
        except OSError as e:
            if getattr(session.placements[0], "local", True):
                return cls(session)  # rank 0 shares this host's /dev/shm: the file reaches it
            return cls(session, reason=str(e), timeout_s=timeout_s)
        return link

    @property
    def remote(self) -> bool:
        """Rank 0 is reached through the group's store (not the file)."""
        return bool(self.channel)

    @property
    def reachable(self) -> bool:
        """Rank 0 can be reached at all (through the file or the store)."""
        return not self.reason

    def store(self) -> KernelStore:
        """The client of the current group's store (a new one after the group re-formed: an elastic relaunch).

        Raises:
            OSError: the store did not answer within the connect timeout, the fit ended (``close``), or the
                workers were stopped (no group, no store).
        """
        if self.closed:
            raise OSError("this fit has ended: its link to rank 0's store is closed")
        group = self.session.group
        if group is None:
            raise OSError("the workers were stopped (nbddp.stop()): rank 0's store went with their process group")
        store = self._store
        if store is None or (store.host, store.port, store.generation) != (group.master_addr, group.master_port,
                                                                           group.generation):
            store = self._store = KernelStore(group.master_addr, group.master_port, group.generation,
                                                   self.timeout_s)
        return store

    def close(self) -> None:
        """The fit ended: let go of the client (its connection closes); a later ``store()`` raises."""
        self._store = None
        self.closed = True

    def answer_key(self, seq: int) -> str:
        return store_channel.answer_key(self.channel, self.session.generation, seq)
