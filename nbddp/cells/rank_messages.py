"""Every output message of the ranks' tasks, in the order each rank sent it, for the cell to draw.

ipyparallel keeps a task's output on its ``AsyncResult``, but not all of it
and not as it was sent: stream text with ``\\r`` already collapsed (so a
progress bar's text shrinks under a reader), ``display_data`` in
``outputs``, and ``update_display_data`` and ``clear_output`` nowhere. Each
message also passes the task's ``iopub_callbacks`` (what ipyparallel's own
``AsyncResult.stream_output`` listens on): ``RankInbox`` adds one there per
rank that only appends the message to a deque, in the client's IO thread
(about a microsecond); the cell's thread drains it at each tick.

The callback is added as each task is handed to the client, in the IO
thread itself (which sends the task, then runs it, before it reads any
reply), together with a copy of anything ipyparallel kept already: no
message is lost or seen twice. Added after the call returned, it lost the
first messages of a short cell (a ``clear_output`` among them) on a loaded
machine.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

if TYPE_CHECKING:
    from ipyparallel import AsyncResult

KINDS = frozenset({"stream", "display_data", "update_display_data", "clear_output"})


class RankMessage(NamedTuple):
    rank: int
    kind: str  # "stream", "display_data", "update_display_data" or "clear_output"
    content: dict[str, Any]


class RankInbox:
    """The output messages of the tasks ``attach``-ed to it (one per rank), until ``close()``."""

    def __init__(self) -> None:
        self._queue: deque[RankMessage] = deque()
        self._hooks: list[tuple[list[Callable[..., Any]], Callable[..., Any]]] = []
        self._loop: Any = None  # the client's IO loop, once a task is attached

    def attach(self, rank: int, ar: AsyncResult) -> None:
        """Listen to ``rank``'s task ``ar``: call it as soon as the task is handed to the client (``on_sent`` of
        ``nbddp.execution.send.to_ranks``). The listening starts in the client's IO thread, which runs it right
        after sending the task, before it reads any message of the reply."""
        self._loop = loop = _io_loop(ar)
        if loop is None:
            self._listen(rank, ar)
        else:
            loop.add_callback(self._listen, rank, ar)

    def _listen(self, rank: int, ar: AsyncResult) -> None:
        for future in getattr(ar, "_children", []):
            md = getattr(getattr(future, "output", None), "metadata", None) or {}
            for name in ("stdout", "stderr"):  # anything that came before: replayed once
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
        """Stop listening (the tasks' futures may outlive the call): in the IO thread, after any pending ``attach``."""
        if self._loop is not None:
            self._loop.add_callback(self._unhook)
        else:
            self._unhook()

    def _unhook(self) -> None:
        hooks, self._hooks = self._hooks, []
        for callbacks, hook in hooks:
            try:
                callbacks.remove(hook)
            except ValueError:
                pass


def _io_loop(ar: AsyncResult) -> Any:
    """The IO loop of the client that sent ``ar`` (None when it has none running)."""
    client = getattr(ar, "_client", None)
    loop = getattr(client, "_io_loop", None)
    return loop if loop is not None and getattr(client, "_io_thread", None) is not None else None
