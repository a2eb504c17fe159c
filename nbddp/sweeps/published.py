"""What a trial's first rank publishes, read without polling: its arrival wakes the sweep's schedule.

A rank publishes its records with ipyparallel's ``publish_data``; the
client's IO thread puts each message into the task's metadata
(``client.metadata[msg_id]["data"]``, updated in place). The schedule used
to poll that through ``AsyncResult.data`` every 50 ms, and each read waits
on the result's futures and parses its dates (about 0.25 ms): with a worker
training on each of 2 cores, the kernel's polling is CPU taken from the
trials. ``wake_on_publish`` swaps the task's data dict for one that sets the
schedule's event when the IO thread adds to it, so a validation record
reaches the pruner as soon as it lands (not at the next poll), and the
schedule's tick can be long; ``latest`` reads it with one dict lookup.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from nbddp.protocol.messages import PUBLISH_KEYS

if TYPE_CHECKING:
    from ipyparallel import AsyncResult, Client


class WakingData(dict):
    """A task's published data that sets ``event`` whenever the client's IO thread adds to it."""

    def __init__(self, data: dict[str, Any], event: threading.Event):
        super().__init__(data)
        self.event = event

    def update(self, *args: Any, **kwargs: Any) -> None:
        super().update(*args, **kwargs)
        self.event.set()


def wake_on_publish(client: Client, ar: AsyncResult, event: threading.Event) -> None:
    """Set ``event`` each time the task ``ar`` publishes (call it right after ``apply_async``).

    The swap follows the send by microseconds, long before the task can
    have started on its engine and published; what the old dict already
    holds is copied, and a message landing in between would be carried
    again by the next one (each carries a window of recent records) and by
    the task's result.
    """
    md = client.metadata.get(ar.msg_ids[0])
    if md is not None and not isinstance(md.get("data"), WakingData):
        md["data"] = WakingData(md.get("data") or {}, event)


def latest(client: Client, ar: AsyncResult, kind: str) -> Any:
    """The latest value the task ``ar`` published under ``PUBLISH_KEYS[kind]``, or None: one dict lookup."""
    md = client.metadata.get(ar.msg_ids[0])
    data = md.get("data") if md is not None else None
    return data.get(PUBLISH_KEYS[kind]) if isinstance(data, dict) else None
