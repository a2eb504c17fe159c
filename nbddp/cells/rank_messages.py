"""Every output message of the ranks' tasks, in the order each rank sent it, for the cell to draw.

ipyparallel keeps a task's output on its ``AsyncResult``, but not all of it
and not as it was sent: stream text with ``\\r`` already collapsed (so a
progress bar's text shrinks under a reader), ``display_data`` in
``outputs``, and ``update_display_data`` and ``clear_output`` nowhere. Each
message also passes the task's ``iopub_callbacks`` (what ipyparallel's own
``AsyncResult.stream_output`` listens on): ``RankInbox`` adds one there per
rank that only appends the message to a deque, in the client's IO thread
(about a microsecond); the cell's thread drains it at each tick.

The callback is added in the IO thread itself, together with a copy of what
ipyparallel kept so far, so that no message is lost or seen twice between
the task being sent and the callback being added.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

if TYPE_CHECKING:
    from ipyparallel import AsyncResult

KINDS = frozenset({"stream", "display_data", "update_display_data", "clear_output"})
ATTACH_WAIT_S = 5.0  # for the IO thread to take the callbacks (it answers in well under a millisecond)


class RankMessage(NamedTuple):
    rank: int
    kind: str  # "stream", "display_data", "update_display_data" or "clear_output"
    content: dict[str, Any]


class RankInbox:
    """The output messages of ``ars`` (rank -> its task's ``AsyncResult``), until ``close()``."""

    def __init__(self, ars: dict[int, AsyncResult]):
        self._queue: deque[RankMessage] = deque()
        self._hooks: list[tuple[list[Callable[..., Any]], Callable[..., Any]]] = []
        attached = threading.Event()
        loop = _io_loop(ars)

        def attach() -> None:
            try:
                for rank, ar in sorted(ars.items()):
                    self._attach(rank, ar)
            finally:
                attached.set()

        if loop is None:
            attach()
        else:
            loop.add_callback(attach)
            attached.wait(ATTACH_WAIT_S)

    def _attach(self, rank: int, ar: AsyncResult) -> None:
        for future in getattr(ar, "_children", []):
            md = getattr(getattr(future, "output", None), "metadata", None) or {}
            for name in ("stdout", "stderr"):  # what arrived before this callback: replayed once
                if md.get(name):
                    self._queue.append(RankMessage(rank, "stream", {"name": name, "text": md[name]}))
            for content in md.get("outputs") or []:
                self._queue.append(RankMessage(rank, "display_data", content))
            hook = self._hook(rank)
            future.iopub_callbacks.append(hook)
            self._hooks.append((future.iopub_callbacks, hook))

    def _hook(self, rank: int) -> Callable[[dict[str, Any]], None]:
        queue = self._queue

        def on_message(msg: dict[str, Any]) -> None:  # the client's IO thread: keep it to an append
            try:
                kind = msg["header"]["msg_type"]
                if kind in KINDS:
                    queue.append(RankMessage(rank, kind, msg["content"]))
            except Exception:  # noqa: BLE001 - never raise in the IO thread (nbddp/cluster/iopub_guard.py)
                pass

        return on_message

    def drain(self) -> list[RankMessage]:
        """The messages that arrived since the last call, in arrival order."""
        taken = []
        queue = self._queue
        while queue:
            taken.append(queue.popleft())
        return taken

    def close(self) -> None:
        """Stop listening (the tasks' futures may outlive the call)."""
        for callbacks, hook in self._hooks:
            try:
                callbacks.remove(hook)
            except ValueError:
                pass
        self._hooks.clear()


def _io_loop(ars: dict[int, AsyncResult]) -> Any:
    """The IO loop of the client that sent ``ars`` (None when there is none to run on)."""
    for ar in ars.values():
        client = getattr(ar, "_client", None)
        loop = getattr(client, "_io_loop", None)
        if loop is not None and getattr(client, "_io_thread", None) is not None:
            return loop
    return None
