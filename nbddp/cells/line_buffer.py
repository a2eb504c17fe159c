"""One rank's stream as a terminal would show it: complete lines, and the lines being redrawn in place.

A progress bar (tqdm, ``print(..., end="\\r")``) writes ``\\r`` and the
whole bar again at every update, with no newline until it ends. Read as
lines, that is one line of every state the bar ever had; read as ipyparallel
keeps it (``AsyncResult.stderr``, where ``\\r`` is already collapsed), the
text shrinks under a reader that remembers how much it read. Fed the raw
chunks in order, ``LineBuffer`` keeps what a terminal shows instead:

* ``\\r`` moves back to the start of the row and later text overwrites it;
  ``\\n`` (or ``\\r\\n``) moves to the next row;
* ``ESC[nA`` / ``ESC[nB`` move the cursor up or down and ``ESC[K`` clears
  the rest of the row: nested tqdm bars (an epoch bar over a batch bar) go
  down a row to draw the inner bar and come back up; other escape codes
  (colours) are dropped.

A row is complete once the cursor left it for good: at once for plain
lines; for rows the cursor went back up to (nested bars), once it is more
rows below them than it ever went up, or a plain line follows. Chunks may
split anywhere, ``\\r\\n`` included.
"""

from __future__ import annotations

import re

_CONTROLS = re.compile(r"(\r\n|\r|\n|\x1b\[[0-9;?]*[A-Za-z])")
_CUT_ESCAPE = re.compile(r"\x1b(\[[0-9;?]*)?$")  # an escape code the chunk ends in the middle of


class LineBuffer:
    """The lines of one stream, fed in the order the rank wrote them."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._rows = [""]  # the rows not yet complete, top first
        self._redrawn = [False]  # each row had a \r or the cursor came back to it: a row drawn in place (a bar)
        self._row = self._col = 0
        self._depth = 0  # the most rows the cursor went back up: the rows kept open above it
        self._cr_last = False  # the last piece was \r: a \n right after it makes it \r\n
        self._redrawn_before_cr = False
        self._held = ""  # the start of an escape code cut by the chunk's end

    def feed(self, text: str) -> list[tuple[str, bool]]:
        """The lines that ``text`` completes: ``(line, redrawn)``, ``redrawn`` when drawn in place (a bar)."""
        done: list[tuple[str, bool]] = []
        text, self._held = self._held + text, ""
        cut = _CUT_ESCAPE.search(text)
        if cut:
            text, self._held = text[:cut.start()], cut.group()
        for piece in _CONTROLS.split(text):
            if piece:
                self._take(piece, done)
                self._cr_last = piece == "\r"
        return done

    def _take(self, piece: str, done: list[tuple[str, bool]]) -> None:
        if piece in ("\n", "\r\n"):
            if piece == "\n" and self._cr_last:  # "\r" + "\n" split over two chunks is one line end
                self._redrawn[self._row] = self._redrawn_before_cr
            self._down(1, done, newline=True)
        elif piece == "\r":
            self._redrawn_before_cr = self._redrawn[self._row]
            self._col, self._redrawn[self._row] = 0, True
        elif piece.startswith("\x1b["):
            self._escape(piece, done)
        else:
            line, end = self._rows[self._row], self._col + len(piece)
            self._rows[self._row] = line[:self._col] + piece + line[end:]
            self._col = end

    def _escape(self, code: str, done: list[tuple[str, bool]]) -> None:
        count = int(code[2:-1]) if code[2:-1].isdigit() else 1
        if code.endswith("A"):  # up: a bar above is redrawn
            self._row = max(0, self._row - count)
            self._depth = max(self._depth, len(self._rows) - 1 - self._row)
            self._redrawn[self._row] = True
        elif code.endswith("B"):
            self._down(count, done, newline=False)
        elif code.endswith("K"):
            self._rows[self._row] = self._rows[self._row][:self._col]

    def _down(self, count: int, done: list[tuple[str, bool]], newline: bool) -> None:
        left = self._row
        for _ in range(count):
            self._row += 1
            if self._row == len(self._rows):
                self._rows.append("")
                self._redrawn.append(False)
        if not newline:
            return
        self._col = 0
        if not self._rows[self._row].strip():  # a blank row (a bar that cleared itself) is a fresh line
            self._rows[self._row], self._redrawn[self._row] = "", False
        if not self._redrawn[left]:
            self._depth = 0  # a plain line: nothing above it is redrawn any more
            while self._row > 0:
                self._complete(done)
        # a bar's row stays open while the cursor may come back to it: as many rows as it ever went up, plus one
        while self._row > self._depth + 1 or (self._row > 0 and not self._redrawn[0]):
            self._complete(done)

    def _complete(self, done: list[tuple[str, bool]]) -> None:
        line, redrawn = self._rows.pop(0), self._redrawn.pop(0)
        self._row -= 1
        if redrawn:
            line = line.rstrip()
            if not line:
                return  # a bar that cleared itself (tqdm's leave=False): nothing to keep
        done.append((line, redrawn))

    @property
    def current(self) -> str:
        """The rows being redrawn now, as a terminal shows them (one line per bar, blanks dropped)."""
        return "\n".join(row.rstrip() for row, redrawn in zip(self._rows, self._redrawn)
                         if redrawn and row.strip())

    @property
    def live(self) -> bool:
        """Whether a row is being redrawn in place (a bar) with something to show."""
        return bool(self.current)

    def rest(self) -> list[tuple[str, bool]]:
        """The rows not complete yet, taken (the stream ended): ``(line, redrawn)``, blank bars dropped."""
        done = [(row.rstrip() if redrawn else row, redrawn) for row, redrawn in zip(self._rows, self._redrawn)
                if (row.strip() if redrawn else row)]
        self._reset()
        return done
