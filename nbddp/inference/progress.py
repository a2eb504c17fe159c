"""The live progress line of ``predict``/``evaluate``: batches done on every rank, from their heartbeats.

Each rank's heartbeat (about once a second, ``worker/engine/heartbeat.py``)
carries how many batches it has fetched; the line shows the sum against the
total, throttled: on one line rewritten in place (``\\r``), or in a Jupyter
kernel (``live=True`` or ``"widget"``) as a progress bar in one output
updated in place; it ends with a summary line.
"""

from __future__ import annotations

import html
import sys
import time
from typing import TYPE_CHECKING, Any

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
    """The progress of one call: ``mode`` ``"text"`` (a line rewritten in place), ``"widget"`` (a progress bar in
    the notebook, one output updated in place) or ``"off"``."""

    def __init__(self, what: str, total: int | None, mode: str):
        self.what, self.total, self.mode = what, total, mode
        self.live = mode != "off"
        self.started = time.perf_counter()
        self._next = 0.0
        self.width = 0
        self.shown: Any = None  # the notebook output (a DisplayHandle), once drawn

    def tick(self, ars: dict[int, AsyncResult]) -> None:
        now = time.perf_counter()
        if not self.live or now < self._next:
            return
        self._next = now + EVERY_S
        done = sum(getattr(published(ar, "beat"), "micro", 0) for ar in ars.values())
        if not done:
            return
        total = str(self.total) if self.total else "?"
        text = f"{self.what}: {done}/{total} batches on {len(ars)} ranks [{now - self.started:.1f} s]"
        if self.mode == "widget":
            self._show(text, done)
            return
        self._write(text)
        sys.stdout.flush()

    def finish(self, status: str) -> None:
        if not self.live:
            return
        text = f"{self.what}: {status} in {time.perf_counter() - self.started:.1f} s"
        if self.mode == "widget":
            self._show(text, self.total or 1, final=True)
            return
        self._write(text, end="\n")

    def _write(self, text: str, end: str = "") -> None:
        """Over the last line (``\r``), padded so that no longer line's tail is left showing."""
        sys.stdout.write(f"\r{text.ljust(self.width)}{end}")
        sys.stdout.flush()
        self.width = len(text)

    def _show(self, text: str, done: int, final: bool = False) -> None:
        """The bar and the line, in one notebook output updated in place (``display_id``)."""
        from IPython.display import HTML, display

        bar = "" if final else (f"<progress value='{done}' max='{self.total}' style='width:16em'></progress> "
                                if self.total else "")
        page = HTML(f"<div class='nbddp-progress'>{bar}<code>{html.escape(text)}</code></div>")
        if self.shown is None:
            self.shown = display(page, display_id=True)
        else:
            self.shown.update(page)
