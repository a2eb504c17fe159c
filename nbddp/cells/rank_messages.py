"""Every output message of the ranks' tasks, in the order each rank sent it, for the cell to draw.

ipyparallel keeps a task's output on its ``AsyncResult``, but not all of it
and not as it was sent: stream text with ``\\r`` already collapsed (so a
progress bar's text shrinks under a reader), ``display_data`` in
``outputs``, and ``update_display_data`` and ``clear_output`` nowhere. Each
message also passes the task's ``iopub_callbacks`` (what ipyparallel's own
``AsyncResult.stream_output`` listens on): ``RankInbox`` adds one there per
rank that only appends the message to a deque, in the client's IO thread
(about a microsecond); the cell's thread drains it at each tick.

The callback is added to each task's future before the task is sent
(``nbddp.execution.send.to_ranks``), so no message is missed: added once
the call had returned, it lost the first messages of a short cell (a
``clear_output`` among them) on a loaded machine, the client's IO thread
having read them already.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, NamedTuple

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

    def attach(self, rank: int, future: Any) -> None:
        """Listen to ``rank``'s task through its ipyparallel ``MessageFuture``, given before the task is sent
        (``listen`` of ``nbddp.execution.send.to_ranks``), so that no message of its reply is missed."""
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
        hooks, self._hooks = self._hooks, []
        for callbacks, hook in hooks:
            try:
                callbacks.remove(hook)
            except ValueError:
                pass
