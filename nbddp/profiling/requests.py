"""``handle.profile(steps=10)``: a profile of a fit that is already running, asked from the notebook.

An engine runs its fit in its main thread and takes no other task meanwhile,
so the request travels as a small owner-only file next to the session's
other files (``<prefix>-w0-profile-request``: ``{"id": n, "steps": k}``). Rank
0 looks for it at each record's reduction (one ``stat`` a record) and puts
the request in that same reduction, so every rank learns it at the same step
and traces the same steps (``worker/training/report.py``). Each rank
publishes its trace when its steps are done; the kernel's watcher collects
them (``collect``), merges them into one file, and the waiting call returns.

When the ranks met at a TCPStore (across hosts: SSH, MPI, Slurm), it goes under
a key of rank 0's torch store instead (``protocol/store_channel.py``: the
request's key, then a counter rank 0 reads with one non-blocking round
trip, at most every 50 ms). Only if that store could not be reached when the fit
started is ``handle.profile`` refused, saying why; ``dist_fit(profile=...)``
traces from the start instead.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any, Protocol

from nbddp.execution.contracts import SessionLike
from nbddp.profiling.trace_merge import profile_summary, write_trace
from nbddp.protocol import store_channel
from nbddp.protocol.messages import published
from nbddp.protocol.profile_spec import request_path
from nbddp.protocol.notes import write_note
from nbddp.protocol.store_channel import KernelStore

if TYPE_CHECKING:
    from ipyparallel import AsyncResult


class Rank0Reach(Protocol):
    """How a request reaches rank 0 (``nbddp/fit/rank0_store.py``'s ``Rank0Link``, which imports this package):
    the file on its host, or the group's store (``remote``) under the fit's ``channel``."""

    channel: str
    reason: str  # why rank 0 cannot be reached ("": it can)

    @property
    def remote(self) -> bool: ...

    @property
    def reachable(self) -> bool: ...

    def store(self) -> KernelStore: ...


class ProfileRequests:
    """The profiles asked of one running fit: the request file, and the traces as the ranks publish them."""

    def __init__(self, session: SessionLike, link: Rank0Reach | None = None):
        self.session = session
        self.link = link  # fit/rank0_store.Rank0Link: the file (None, or not remote) or rank 0's store
        self.keys: list[str] = []  # the store keys this fit set (removed when it ends)
        self.path = ""  # set by the first request: rank 0's files are named "<session prefix>-w0"
        self.asked = 0
        self.results: dict[int, dict[str, Any]] = {}
        self.folders: dict[int, str | None] = {}  # where each request's trace goes (None: a new temporary folder)
        self.arrived = threading.Condition()
        self.closed = False  # the fit ended

    def ask(self, steps: int, folder: str | None = None) -> int:
        """Write the request (atomically, 0600); return its id. Its trace will go into ``folder``."""
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"handle.profile(steps=...) must be a whole number of steps >= 1, got {steps!r}")
        link = self.link
        if link is not None and not link.reachable:
            raise RuntimeError(f"handle.profile() could not reach rank 0 on {self.session.placements[0].host}: "
                               f"{link.reason}. Check that this machine can reach that host on the group's port, or "
                               "profile the fit from its start with dist_fit(..., profile=True)")
        with self.arrived:
            self.asked += 1
            self.folders[self.asked] = folder
            request = {"id": self.asked, "steps": steps}
            if link is not None and link.remote:
                link.store().ask(link.channel, self.asked, request)
                self.keys = [*(self.keys or [store_channel.asked_key(link.channel)]),
                             store_channel.request_key(link.channel, self.asked)]
                return self.asked
            self.path = request_path(f"{self.session.file_prefix}-w0")
            write_note(self.path, request)
            return self.asked

    def collect(self, ars: dict[int, AsyncResult]) -> None:
        """From the watcher thread: when every rank published the trace of the last request, merge them."""
        with self.arrived:
            if not self.asked or self.asked in self.results:
                return
            traces = {r: published(ar, "profile") for r, ar in ars.items()}
            if not all(t is not None and t[0] == self.asked for t in traces.values()):
                return
            got = {r: t[1] for r, t in traces.items() if t[1]}
            if got:
                self.results[self.asked] = profile_summary(write_trace(got, self.folders.get(self.asked)), got,
                                                            len(ars))
            else:
                self.results[self.asked] = {"path": None, "ranks": [], "top_ops": {}, "breakdown": {}, "hta": None,
                                            "rank_traces": None,
                                            "summary": "no trace: the fit ended before a traced step"}
            self._remove()
            self.arrived.notify_all()

    def wait(self, request: int, timeout: float | None) -> dict[str, Any] | None:
        """The merged profile of ``request``, or None if the fit ended first or ``timeout`` passed."""
        with self.arrived:
            self.arrived.wait_for(lambda: request in self.results or self.closed, timeout)
            return self.results.get(request)

    def close(self) -> None:
        """The fit ended: no rank will read a request any more; wake a waiting call."""
        with self.arrived:
            self.closed = True
            self._remove()
            # the counter, and a request rank 0 never took (the fit ended first): keys are set only through a link
            if self.keys and self.link is not None:
                try:
                    store = self.link.store()
                    for key in self.keys:
                        store.delete(key)
                except OSError:  # the group's store is gone, and its keys with it
                    pass
                self.keys = []
            self.arrived.notify_all()

    def _remove(self) -> None:
        if not self.path:
            return
        try:
            os.remove(self.path)
        except FileNotFoundError:
            pass
