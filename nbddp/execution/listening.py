"""Messages of a call's tasks taken as the client's IO thread reads them, for the cell's thread to drain.

ipyparallel keeps only part of what a task sends on its ``AsyncResult``,
and reading it there costs (each read waits on the task's futures). Every
message also passes the task's ``iopub_callbacks`` (what ipyparallel's own
``AsyncResult.stream_output`` listens on). A ``Listener`` adds one there per
rank, before the task is sent (``listen`` of ``nbddp.execution.send.to_ranks``:
added once the call had returned, it lost a short cell's first messages on
a loaded machine, the IO thread having read them already). The callback
only picks what its subclass wants and appends it to a deque, in the IO
thread (about a microsecond); the cell's thread drains it at each tick.
Subclasses: ``nbddp/cells/rank_messages.py`` (output), ``nbddp/reports/inbox.py``
(``nbddp.report``'s batches).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Generic, TypeVar

T = TypeVar("T")


class Listener(Generic[T]):
    """What ``pick`` takes of the messages of the tasks ``attach``-ed to it, in arrival order, until ``close()``."""

    def __init__(self) -> None:
        self._queue: deque[T] = deque()
        self._hooks: list[tuple[list[Callable[..., Any]], Callable[..., Any]]] = []

    def pick(self, rank: int, msg_id: str, msg: dict[str, Any]) -> T | None:
        """What to keep of ``msg`` from ``rank``'s task ``msg_id`` (None: nothing); runs in the IO thread."""
        raise NotImplementedError

    def attach(self, rank: int, future: Any) -> None:
        """Listen to ``rank``'s task through its ipyparallel ``MessageFuture``, given before the task is sent."""
        hook = self._hook(rank, str(future.msg_id))
        future.iopub_callbacks.append(hook)
        self._hooks.append((future.iopub_callbacks, hook))

    def _hook(self, rank: int, msg_id: str) -> Callable[[dict[str, Any]], None]:
        queue, pick = self._queue, self.pick

        def on_message(msg: dict[str, Any]) -> None:  # the client's IO thread: keep it to a pick and an append
            try:
                item = pick(rank, msg_id, msg)
                if item is not None:
                    queue.append(item)
            except Exception:  # noqa: BLE001 - never raise in the IO thread (nbddp/cluster/iopub_guard.py)
                pass

        return on_message

    def drain(self) -> list[T]:
        """What arrived since the last call, in arrival order."""
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
