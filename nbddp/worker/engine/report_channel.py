"""A rank's ``nbddp.report`` records, kept on the rank and streamed to the kernel off the training thread.

While a ``%%ddp`` cell, an ``nbddp.run`` call or a script runs, one
``ReportChannel`` is open (``worker/tasks/user_task.py``). ``report`` only
checks its values and appends them to a list: no collective, no I/O, no
``.item()`` on a device tensor. A publisher thread (``nbddp-report``) sends
the new records with ``publish_data`` every ``PUBLISH_S`` (a device tensor
is read there, so the sync waits in that thread, not in the person's step),
and reads the kernel's stop note once the code asked ``should_stop()``. The
kernel reduces each step over the ranks (``nbddp/reports/``). At the task's
end every record is published once more, whole (data published after a task
returns is lost), so the kernel's History misses nothing.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any, Callable, Iterator

from nbddp.protocol.messages import PUBLISH_KEYS
from nbddp.protocol.notes import read_note
from nbddp.worker.engine.heartbeat import engine_publisher
from nbddp.protocol.reports import (WINDOW, ReportBatch, ReportRecord, check_reduce, check_step, is_tensor,
                                    metric_value)

PUBLISH_S = 0.1  # how often new records go to the kernel (the live view's latency is about this plus its poll)


class ReportChannel:
    """One task's reports on this rank (see the module docstring)."""

    def __init__(self, rank: int, publish: Callable[[dict[str, Any]], None] | None, stop_path: str | None):
        self.rank = rank
        self.publish = publish
        self.stop_path = stop_path
        if stop_path is not None:  # a note left by a kernel that died mid-call must not stop this task
            with contextlib.suppress(OSError):
                os.unlink(stop_path)
        self.records: list[ReportRecord] = []
        self.checks_stop = False
        self.stop_at: int | None = None
        self.stopped_at: int | None = None
        self.position = 0  # the furthest step should_stop(step) was told
        self._lock = threading.Lock()  # the list and its last record, between report() and the publisher
        self._sent = 0  # records published (or published with changes since: a step's later report)
        self._sent_before = 0  # ... as of the batch before: each batch repeats the last one's records, so a
        # kernel that skipped one batch (it keeps only the latest) still gets every record
        self._dirty = False
        self._done = threading.Event()
        self._thread: threading.Thread | None = None  # started by the first report or should_stop

    def _start(self) -> None:
        if self._thread is None and self.publish is not None:
            self._thread = threading.Thread(target=self._serve, name="nbddp-report", daemon=True)
            self._thread.start()

    # ---- the person's thread ------------------------------------------------------
    def report(self, step: int | None, reduce: object, metrics: dict[str, Any]) -> None:
        if self._thread is None:
            self._start()
        names = list(metrics)
        if not names:
            raise TypeError("nbddp.report() was given no metric: name each value, e.g. report(loss=loss)")
        how = check_reduce(reduce, names)
        values = {name: metric_value(name, value) for name, value in metrics.items()}  # all checked before any kept
        last = self.records[-1] if self.records else None
        step = (last.step + 1 if last is not None else 1) if step is None else \
            check_step(step, last.step if last is not None else None, names)
        now = time.time()
        with self._lock:
            if last is not None and last.step == step:  # another report at the same step adds to its record
                last.values.update(values)
                last.reduce.update(dict.fromkeys(values, how))
                last.time = now
                self._sent = min(self._sent, len(self.records) - 1)
                self._sent_before = min(self._sent_before, self._sent)
            else:
                self.records.append(ReportRecord(step, now, values, dict.fromkeys(values, how)))
            self._dirty = True

    def should_stop(self, step: int | None = None) -> bool:
        """True once the kernel's agreed stop step is reached (``step``: this rank's own, default its last report)."""
        if not self.checks_stop:
            self.checks_stop = True
            self._dirty = True
            self._start()
        if step is not None and step > self.position:
            self.position = step
            self._dirty = True
        if self.stop_at is None:
            return False
        at = step if step is not None else (self.records[-1].step if self.records else 0)
        if at >= self.stop_at:
            if self.stopped_at is None:
                self.stopped_at = at
                self._dirty = True
            return True
        return False

    # ---- the publisher thread ------------------------------------------------------
    def _serve(self) -> None:
        while not self._done.wait(PUBLISH_S):
            try:
                self._read_stop()
                if self._dirty:
                    self._send(final=False)
            except Exception:  # noqa: BLE001 - the stream is best effort; the final batch carries every record
                pass

    def _read_stop(self) -> None:
        if self.checks_stop and self.stop_at is None and self.stop_path is not None:
            note = read_note(self.stop_path)
            if isinstance(note, dict) and isinstance(note.get("stop_at"), int):
                self.stop_at = note["stop_at"]
                self._dirty = True  # the kernel learns that the stop arrived

    def _send(self, final: bool) -> None:
        if self.publish is None:
            return
        with self._lock:
            self._dirty = False
            first = 0 if final else max(self._sent_before, len(self.records) - WINDOW, 0)
            picked = [(seq, self.records[seq]) for seq in range(first, len(self.records))]
            self._sent_before, self._sent = self._sent, len(self.records)
        window = [(seq, _readable(record)) for seq, record in picked]
        self.publish({PUBLISH_KEYS["report"]: ReportBatch(self.rank, len(self.records), window, final,
                                                          self.checks_stop, self.stopped_at,
                                                          self.position)})

    def close(self) -> None:
        """End the publisher; publish every record once more (before the task returns, or it is lost)."""
        self._done.set()
        if self._thread is not None:
            self._thread.join(5.0)
        if self.records or self.checks_stop:
            try:
                self._send(final=True)
            except Exception:  # noqa: BLE001 - the kernel keeps what the stream brought
                pass


def _readable(record: ReportRecord) -> ReportRecord:
    """A copy with device tensors read into floats (here, in the publisher thread: the sync waits here)."""
    values = {k: float(v.item()) if is_tensor(v) else v for k, v in record.values.items()}
    return ReportRecord(record.step, record.time, values, dict(record.reduce))


OPEN: list[ReportChannel] = []  # the channel of the task running now: none outside nbddp's tasks


@contextlib.contextmanager
def reporting(rank: int, stop_path: str | None) -> Iterator[ReportChannel]:
    """A channel open while the block runs (``nbddp.report`` finds it in ``OPEN``), closed and flushed after."""
    channel = ReportChannel(rank, engine_publisher(), stop_path)
    OPEN.append(channel)
    try:
        yield channel
    finally:
        OPEN.remove(channel)
        channel.close()
