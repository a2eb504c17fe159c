"""Every output message of the ranks' tasks, in the order each rank sent it, for the cell to draw.

ipyparallel keeps a task's output on its ``AsyncResult``, but not all of it
and not as it was sent: stream text with ``\\r`` already collapsed (so a
progress bar's text shrinks under a reader), ``display_data`` in
``outputs``, and ``update_display_data`` and ``clear_output`` nowhere. So
``RankInbox`` takes each output message as the client's IO thread reads it
(``nbddp.execution.listening.Listener``), from before the task is sent: no
message is missed (added later, it lost a short cell's ``clear_output``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from nbddp.execution.listening import Listener

KINDS = frozenset({"stream", "display_data", "update_display_data", "clear_output"})


class RankMessage(NamedTuple):
    rank: int
    kind: str  # "stream", "display_data", "update_display_data" or "clear_output"
    content: dict[str, Any]


class RankInbox(Listener[RankMessage]):
    """The output messages of the tasks ``attach``-ed to it (one per rank), until ``close()``."""

    def pick(self, rank: int, msg_id: str, msg: dict[str, Any]) -> RankMessage | None:
        kind = msg["header"]["msg_type"]
        return RankMessage(rank, kind, msg["content"]) if kind in KINDS else None
