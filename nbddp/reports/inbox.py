"""Every ``ReportBatch`` a call's ranks publish, taken as it arrives: none is skipped, none is polled for.

ipyparallel keeps a task's published data as one dict per task, each new
message's keys written over the last (``AsyncResult.data``), so a reader
that polls sees only the latest batch, and each read of ``AsyncResult.data``
waits on the task's futures and parses its dates. So a rank once repeated
the last batch's records in each batch, the kernel's IO thread unpickled
every record twice, and the cell's thread read ``data`` at every tick.
Instead ``ReportInbox`` listens to each task from before it is sent
(``nbddp.execution.listening.Listener``): in the client's IO thread, a
``data_message`` whose keys name a report batch is unpickled once more and
the batch kept (a batch of plain tuples: about 15 us for 70 records); the
cell's thread drains them at each tick. It reads the message, not the
client's metadata, so it depends on no order inside ipyparallel.
"""

from __future__ import annotations

from typing import Any

from ipyparallel.serialize import deserialize_object

from nbddp.execution.listening import Listener
from nbddp.protocol.messages import PUBLISH_KEYS
from nbddp.protocol.reports import ReportBatch

KEY = PUBLISH_KEYS["report"]


class ReportInbox(Listener[ReportBatch]):
    """The report batches of the tasks ``attach``-ed to it, in arrival order, until ``close()``."""

    def pick(self, rank: int, msg_id: str, msg: dict[str, Any]) -> ReportBatch | None:
        if msg["header"]["msg_type"] != "data_message" or KEY not in msg["content"].get("keys", ()):
            return None
        data, _ = deserialize_object(msg["buffers"])
        batch = data.get(KEY) if isinstance(data, dict) else None
        return batch if isinstance(batch, ReportBatch) and batch.rank == rank else None
