"""The live progress line of ``predict``/``evaluate``: batches done on every rank, from their heartbeats.

Each rank's heartbeat (about once a second, ``worker/engine/heartbeat.py``)
carries how many batches it has fetched; the line shows the sum against the
total, throttled, on one line rewritten in place (``\\r``), and ends with a
summary line.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

from nbddp.protocol.messages import published

if TYPE_CHECKING:
    from ipyparallel import AsyncResult

EVERY_S = 0.5


def total_batches(n: int | None, world: int, batch_size: int) -> int | None:
    """Batches over every rank's block (``worker/inference/shards.py``), or None when the length is unknown here."""
    if n is None:
        return None
    return sum(-(-((r + 1) * n // world - r * n // world) // batch_size) for r in range(world))


class ProgressLine:
    def __init__(self, what: str, total: int | None, live: bool):
        self.what, self.total, self.live = what, total, live
        self.started = time.perf_counter()
        self._next = 0.0
        self.width = 0

    def tick(self, ars: dict[int, AsyncResult]) -> None:
        now = time.perf_counter()
        if not self.live or now < self._next:
            return
        self._next = now + EVERY_S
        done = sum(getattr(published(ar, "beat"), "micro", 0) for ar in ars.values())
        if not done:
            return
        total = str(self.total) if self.total else "?"
        self._write(f"{self.what}: {done}/{total} batches on {len(ars)} ranks [{now - self.started:.1f} s]")
        sys.stdout.flush()

    def finish(self, status: str) -> None:
        if not self.live:
            return
        self._write(f"{self.what}: {status} in {time.perf_counter() - self.started:.1f} s", end="\n")

    def _write(self, text: str, end: str = "") -> None:
        """Over the last line (``\r``), padded so that no longer line's tail is left showing."""
        sys.stdout.write(f"\r{text.ljust(self.width)}{end}")
        sys.stdout.flush()
        self.width = len(text)
