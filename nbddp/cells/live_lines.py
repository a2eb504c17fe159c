"""The ranks' progress bars, drawn in place under the cell: one line per rank, redrawn at most every 0.2 s.

A line a rank redraws with ``\\r`` (``nbddp.cells.line_buffer``) is not
printed at every update; it goes into a block of such lines, one per rank
and stream, labelled ``[rank N]``:

* ``"display"`` (a Jupyter kernel): one ``display(..., display_id=True)``
  output, ``update()``-d in place (as fastprogress does); once every line in
  it has ended, it keeps its last state and the next bar opens a new block
  below. So a 200-step loop leaves one line per rank: its final
  ``200/200``.
* ``"terminal"`` (the kernel's stdout is a terminal): the block is redrawn
  at the bottom with ANSI cursor moves, and stays as its final lines.
* ``"plain"`` (a pipe, a log file, a test's capture): nothing in place is
  possible, so only each bar's final line is printed, as an ordinary line.
"""

from __future__ import annotations

import shutil
import sys
import time
from typing import Any, Literal, TextIO

Drawing = Literal["display", "terminal", "plain"]
Key = tuple[int, str]  # (rank, "stdout" or "stderr")
REDRAW_S = 0.2  # the fastest a block is redrawn: what the eye follows, a few IOPub messages a second


def drawing_here(stream: TextIO | None = None) -> Drawing:
    """How bars can be drawn in place here: in the notebook, on a terminal, or not at all."""
    from nbddp.live.choice import in_notebook_kernel

    if in_notebook_kernel():
        return "display"
    stream = stream or sys.stdout
    return "terminal" if getattr(stream, "isatty", lambda: False)() else "plain"


def drawing_for(live: object) -> Drawing | None:
    """``live=`` of ``nbddp.run`` as a drawing: ``"widget"`` a notebook display, ``"text"`` text (in place on a
    terminal), anything else what this kernel allows (None)."""
    if live == "widget":
        return "display"
    if live == "text":
        return "terminal" if getattr(sys.stdout, "isatty", lambda: False)() else "plain"
    return None


class LiveLines:
    """The block of lines being redrawn; ``set`` and ``end`` them, ``draw`` at every tick."""

    def __init__(self, drawing: Drawing, stream: TextIO | None = None, every: float = REDRAW_S):
        self.drawing = drawing
        self.stream = stream
        self.every = every
        self.lines: dict[Key, tuple[str, bool]] = {}  # key -> (text, ended)
        self._dirty = False
        self._last = float("-inf")
        self._handle: Any = None  # the display handle ("display")
        self._rows = 0  # lines drawn at the bottom ("terminal")

    def set(self, key: Key, text: str) -> str | None:
        """``key``'s line is now ``text`` (still being redrawn); returns the ended line it takes the place of, if
        any (a rank's next bar while another rank's first one still runs), for the caller to print."""
        if self.drawing == "plain":
            return None
        old = self.lines.get(key)
        if old == (text, False):
            return None
        self.lines[key] = (text, False)
        self._dirty = True
        return old[0] if old is not None and old[1] else None

    def end(self, key: Key, text: str) -> bool:
        """``key``'s line ended as ``text``: True when the block shows it (so it is not printed again)."""
        if self.drawing == "plain" or key not in self.lines:
            return False
        self.lines[key] = (text, True)
        self._dirty = True
        return True

    def draw(self, force: bool = False) -> None:
        """Redraw if something changed and ``every`` s passed (``force``: now); close the block once all ended."""
        now = time.monotonic()
        if not self._dirty or not self.lines or (not force and now - self._last < self.every):
            return
        self._last, self._dirty = now, False
        text = "\n".join(f"[rank {rank}] {row}" for (rank, _), (line, _) in sorted(self.lines.items())
                         for row in line.split("\n"))  # nested bars: one row each
        if self.drawing == "display":
            self._show(text)
        else:
            self._write(text)
        if all(ended for _, ended in self.lines.values()):
            self.lines.clear()
            self._handle, self._rows = None, 0  # it stays as drawn; the next bar opens a new block below

    def _show(self, text: str) -> None:
        from IPython.display import display

        bundle = {"text/plain": text}
        if self._handle is None:
            self._handle = display(bundle, raw=True, display_id=True)
        else:
            self._handle.update(bundle, raw=True)

    def _write(self, text: str) -> None:
        stream = self.stream or sys.stdout
        width = max(20, shutil.get_terminal_size().columns - 1)  # a wrapped line would break the cursor moves
        rows = [row[:width] for row in text.split("\n")]
        stream.write(self.erase() + "".join(f"{row}\x1b[K\n" for row in rows))
        self._rows = len(rows)
        stream.flush()

    def erase(self) -> str:
        """What moves a terminal's cursor up over the block, so a printed line goes where it was ("" if none)."""
        if self.drawing != "terminal" or not self._rows:
            return ""
        return f"\x1b[{self._rows}F\x1b[J"

    def before_print(self) -> None:
        """Clear a terminal's block before an ordinary line is printed; it is drawn again below at the next tick."""
        cleared = self.erase()
        if cleared:
            stream = self.stream or sys.stdout
            stream.write(cleared)
            stream.flush()
            self._rows, self._dirty = 0, True

    def forget(self) -> None:
        """The notebook's output was cleared (``clear_output`` from a rank): the next draw opens a new block."""
        self._handle = None
        self._dirty = bool(self.lines)

    def finish(self) -> None:
        """The call ended: draw the last state (a bar a rank never ended stays as it was)."""
        self._dirty = self._dirty or any(not ended for _, ended in self.lines.values())
        for key, (line, _) in list(self.lines.items()):
            self.lines[key] = (line, True)
        self.draw(force=True)
