"""One rank's stream as a terminal would show it: complete lines, and the line being rewritten with ``\\r``.

A progress bar (tqdm, ``print(..., end="\\r")``) writes ``\\r`` and the
whole bar again at every update, with no newline until it ends. Read as
lines, that is one line of every state the bar ever had; read as ipyparallel
keeps it (``AsyncResult.stderr``, where ``\\r`` is already collapsed), the
text shrinks under a reader that remembers how much it read. Fed the raw
chunks in order, ``LineBuffer`` keeps what a terminal shows instead: ``\\r``
moves back to the start of the line and later text overwrites it, ``\\n``
(or ``\\r\\n``) ends it. Chunks may split anywhere, ``\\r\\n`` included.
"""

from __future__ import annotations

import re

_CONTROLS = re.compile(r"(\r\n|\r|\n)")


class LineBuffer:
    """The lines of one stream, fed in the order the rank wrote them."""

    def __init__(self) -> None:
        self._line = ""
        self._col = 0
        self._rewritten = False  # a \r came in this line: it is a line drawn in place (a bar)
        self._cr_pending = False  # the last piece was \r: a \n right after it makes it \r\n
        self._was_rewritten = False  # whether the line had been redrawn before that \r

    def feed(self, text: str) -> list[tuple[str, bool]]:
        """The lines that ``text`` completes: ``(line, rewritten)``, ``rewritten`` when ``\\r`` redrew it."""
        done: list[tuple[str, bool]] = []
        for piece in _CONTROLS.split(text):
            if not piece:
                continue
            if piece in ("\n", "\r\n"):
                if piece == "\n" and self._cr_pending and self._line and self._col == 0:
                    self._rewritten = self._was_rewritten  # "\r" + "\n" split over two chunks is one line end
                done.append((self._line.rstrip() if self._rewritten else self._line, self._rewritten))
                self._line, self._col, self._rewritten = "", 0, False
            elif piece == "\r":
                self._was_rewritten = self._rewritten
                self._col, self._rewritten = 0, True
            else:
                end = self._col + len(piece)
                self._line = self._line[:self._col] + piece + self._line[end:]
                self._col = end
            self._cr_pending = piece == "\r"
        return done

    @property
    def current(self) -> str:
        """The unfinished line as a terminal shows it now (trailing blanks dropped)."""
        return self._line.rstrip()

    @property
    def live(self) -> bool:
        """Whether the unfinished line is one being redrawn in place (a bar), with something to show."""
        return self._rewritten and bool(self.current)

    def rest(self) -> str:
        """The unfinished line, taken (the stream ended without a newline)."""
        line = self.current
        self._line, self._col, self._rewritten, self._cr_pending = "", 0, False, False
        return line
