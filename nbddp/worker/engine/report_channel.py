"""A rank's ``nbddp.report`` records, kept on the rank and streamed to the kernel off the training thread.

While a ``%%ddp`` cell, an ``nbddp.run`` call or a script runs, one
``ReportChannel`` is open (``worker/tasks/user_task.py``). ``report`` only
checks its values and appends one tuple to a list: no collective, no I/O,
no lock, no ``.item()`` on a device tensor. A publisher thread
(``nbddp-report``) sends the records made or changed since its last batch
with ``publish_data`` every ``PUBLISH_S`` (a device tensor is read there, so
the sync waits in that thread, not in the person's step), and reads the
kernel's stop note once the code asked ``should_stop()``. The kernel hears
every batch (``nbddp/reports/inbox.py``) and reduces each step over the
ranks (``nbddp/reports/``). At the task's end every record is published once
more, whole (data published after a task returns is lost), so the kernel's
History misses nothing.

What the person's step pays is kept small on purpose (``benchmarks/bench_report.py``):
right after a training step the CPU's caches hold the step's data, and each
line of Python here costs microseconds, not nanoseconds. So the common
values (a Python number, a CPU tensor) take a fast path, a record is a
tuple, and the two threads share no lock: a record is never changed once
appended (a later report at its step replaces it, and names its index in
``_revised`` for the next batch), and a list's ``append``, item assignment
and slicing are each atomic under the GIL. A lock here once cost the step
a 5 ms GIL switch interval whenever the publisher held it.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from typing import Any, Callable, Iterator

from nbddp.protocol.messages import PUBLISH_KEYS
from nbddp.protocol.notes import read_note
from nbddp.worker.engine.heartbeat import engine_publisher
from nbddp.protocol.reports import ReportBatch, check_reduce, check_step, is_tensor, metric_value, reduce_of

PUBLISH_S = 0.25  # how often new records go to the kernel: each message costs the kernel's IO thread about
# 0.2 ms beside ranks that fill the cores; the live view's latency is about half this plus its poll (goal 250 ms)
Record = tuple[int, float, dict[str, Any], Any]  # (step, time, values, reduce): a ReportRecord's fields


class ReportChannel:
    """One task's reports on this rank (see the module docstring)."""

    def __init__(self, rank: int, publish: Callable[[dict[str, Any]], None] | None, stop_path: str | None):
        self.rank = rank
        self.publish = publish
        self.stop_path = stop_path
        if stop_path is not None:  # a note left by a kernel that died mid-call must not stop this task
            with contextlib.suppress(OSError):
                os.unlink(stop_path)
        self.records: list[Record] = []
        self.checks_stop = False
        self.stop_at: int | None = None
        self.stopped_at: int | None = None
        self.position = 0  # the furthest step should_stop(step) was told
        self._sent = 0  # records published
        self._revised: deque[int] = deque()  # indices of published records a later report replaced
        self._device = False  # a record holds a device tensor: the publisher reads it into a float
        self._tensor: type | None = None  # torch.Tensor, once one was reported (torch is not imported here)
        self._dirty = False
        self._done = threading.Event()
        self._thread: threading.Thread | None = None  # started by the first report or should_stop

    def _start(self) -> None:
        if self._thread is None and self.publish is not None:
            self._thread = threading.Thread(target=self._serve, name="nbddp-report", daemon=True)
            self._thread.start()

    @property
    def last_step(self) -> int | None:
        """This rank's latest reported step (None before the first report)."""
        return self.records[-1][0] if self.records else None

    # ---- the person's thread ------------------------------------------------------
    def report(self, step: int | None, reduce: object, metrics: dict[str, Any]) -> None:
        if self._thread is None:
            self._start()
        if not metrics:
            raise TypeError("nbddp.report() was given no metric: name each value, e.g. report(loss=loss)")
        how = "mean" if type(reduce) is str and reduce == "mean" else check_reduce(reduce, list(metrics))
        values = {}
        for name, value in metrics.items():  # all checked before any is kept
            kind = type(value)
            if kind is float or kind is int:
                values[name] = float(value)
            elif kind is self._tensor and value.is_cpu:  # a CPU tensor: float() reads one element, refuses more
                try:
                    values[name] = float(value)
                except (RuntimeError, TypeError, ValueError):
                    values[name] = metric_value(name, value)  # raises, naming the metric
            else:
                read = values[name] = metric_value(name, value)
                if is_tensor(value):
                    self._tensor = kind  # torch.Tensor: the fast path above from now on
                    self._device = self._device or type(read) is not float  # kept on its device: read later
        records = self.records
        last = records[-1] if records else None
        if step is None:
            step = last[0] + 1 if last is not None else 1
        elif type(step) is not int or step < 0 or (last is not None and step < last[0]):
            step = check_step(step, last[0] if last is not None else None, list(metrics))
        if last is not None and last[0] == step:  # another report at the same step: a new record in its place
            records[-1] = (step, time.time(), {**last[2], **values}, {**reduce_of(last), **dict.fromkeys(values, how)})
            self._revised.append(len(records) - 1)
        else:  # one reduction for all its values: the record holds it as is, not a dict (see ReportRecord)
            records.append((step, time.time(), values, how))
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
        at = step if step is not None else (self.records[-1][0] if self.records else 0)
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
        self._dirty = False
        revised = set()
        while self._revised:  # first, so a record replaced from now on is named for the next batch
            revised.add(self._revised.popleft())
        records = self.records[:]  # one atomic copy of the list (the records themselves never change)
        first = 0 if final else self._sent
        self._sent = len(records)
        picked = [(seq, records[seq]) for seq in sorted(s for s in revised if s < first)]
        picked += [(seq, records[seq]) for seq in range(first, len(records))]
        if self._device:
            picked = [(seq, _readable(record)) for seq, record in picked]
        self.publish({PUBLISH_KEYS["report"]: ReportBatch(self.rank, len(records), picked, final,
                                                          self.checks_stop, self.stopped_at, self.position)})

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


def _readable(record: Record) -> Record:
    """The record with device tensors read into floats (here, in the publisher thread: the sync waits here)."""
    step, at, values, reduce = record
    return step, at, {k: float(v.item()) if is_tensor(v) else v for k, v in values.items()}, reduce


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
