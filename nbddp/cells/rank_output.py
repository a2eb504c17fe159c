"""Each rank's output in the notebook, labelled ``[rank N]``, and the calls that print it.

Engine output reaches the kernel in batches (a 0.2 s flush interval). Every
message is taken in order (``nbddp.cells.rank_messages.RankInbox``) and
drained while a cell, call or script waits:

* stream text becomes lines as a terminal shows them
  (``nbddp.cells.line_buffer``): complete lines are printed labelled, a
  line redrawn with ``\\r`` (a tqdm bar) is drawn in place, one line per rank
  (``nbddp.cells.live_lines``), and ends as one readable line;
* rich output (figures, HTML, widgets' snapshots) of the ranks chosen by
  ``displays=`` is published under the cell (``nbddp.cells.rank_displays``).
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Collection
from typing import TYPE_CHECKING, Any, Callable

from nbddp.cells.line_buffer import LineBuffer
from nbddp.cells.live_lines import Drawing, LiveLines, drawing_here
from nbddp.cells.rank_displays import Displays, RankDisplays, shown_ranks
from nbddp.cells.rank_messages import RankInbox
from nbddp.execution.listening import Listener
from nbddp.execution.calls import RankCall, Targets, call_on_ranks, chosen_ranks
from nbddp.execution.contracts import SessionLike
from nbddp.execution.rank_tasks import RankTasks
from nbddp.protocol.placement import Placement

if TYPE_CHECKING:
    from ipyparallel import AsyncResult

OUTPUT_WAIT_S = 2.0


class RankOutput:
    """Each rank's engine output, shown as it arrives (``live``) or, grouped by rank, when the call ends.

    ``shown``: the ranks whose rich output is published (None: all);
    ``drawing``: how bars are drawn in place (``nbddp.cells.live_lines``; by default what this kernel allows).
    """

    def __init__(self, ars: dict[int, AsyncResult], inbox: RankInbox, live: bool = True,
                 shown: Collection[int] | None = (), drawing: Drawing | None = None):
        """``inbox``: the ranks' messages, attached to each task before it was sent (``run_on_ranks``)."""
        self.ars = ars
        self.live = live
        drawing = drawing or drawing_here()
        self.inbox = inbox
        self.buffers = {(r, k): LineBuffer() for r in ars for k in ("stdout", "stderr")}
        self.bars = LiveLines(drawing if live else "plain")
        chosen = None if shown is None else set(shown)
        several = len(ars) > 1 if chosen is None else len(chosen & set(ars)) > 1
        self.displays = RankDisplays(chosen, notebook=drawing == "display", live=live, label=several,
                                     before_print=self.bars.before_print)
        self.lines: list[tuple[int, str, str]] = []  # (rank, stream, line) held back when not live

    def tick(self) -> None:
        for message in self.inbox.drain():
            if message.kind == "stream":
                self._take(message.rank, message.content.get("name", ""), message.content.get("text", ""))
            else:
                self.displays.take(message)
        self.displays.flush()
        if self.displays.cleared:
            self.displays.cleared = False
            self.bars.forget()
        self.bars.draw()

    def _take(self, rank: int, kind: str, text: str) -> None:
        key = (rank, kind)
        buffer = self.buffers.get(key)
        if buffer is None or not isinstance(text, str):
            return
        for line, rewritten in buffer.feed(text):
            if not (rewritten and self.bars.end(key, line)):
                self._emit(rank, kind, line)
        if buffer.live:
            replaced = self.bars.set(key, buffer.current)
            if replaced is not None:
                self._emit(rank, kind, replaced)

    def _emit(self, rank: int, kind: str, line: str) -> None:
        if self.live:
            self.bars.before_print()
            write(kind, f"[rank {rank}] {line}\n")
        else:
            self.lines.append((rank, kind, line))

    def finish(self, tasks: RankTasks) -> None:
        """Wait briefly for the last output of ranks that ended, then show the rest."""
        deadline = time.monotonic() + OUTPUT_WAIT_S
        for rank, ar in self.ars.items():
            if rank in tasks.results or rank in tasks.failures:
                try:
                    ar.wait_for_output(max(0.01, deadline - time.monotonic()))
                except Exception:  # noqa: BLE001 - output is best effort
                    pass
        try:
            self.tick()
            for (rank, kind), buffer in self.buffers.items():
                for line, redrawn in buffer.rest():
                    if not (redrawn and self.bars.end((rank, kind), line)):
                        self._emit(rank, kind, line)
            self.bars.finish()
            for rank, kind, line in sorted(self.lines, key=lambda item: item[0]):
                write(kind, f"[rank {rank}] {line}\n")
            self.lines.clear()
            self.displays.flush(final=True)
        finally:
            self.inbox.close()
            sys.stdout.flush()
            sys.stderr.flush()


def output_of(ar: AsyncResult, key: str) -> str:
    """What the task of ``ar`` printed so far on ``key`` (``"stdout"`` or ``"stderr"``)."""
    try:
        value = ar[key]
    except Exception:  # noqa: BLE001 - a dead engine's task may have none
        return ""
    return value if isinstance(value, str) else ""


def write(kind: str, text: str) -> None:
    """Print ``text`` on the kernel's stdout or stderr, as the rank printed it (tests watch this)."""
    (sys.stderr if kind == "stderr" else sys.stdout).write(text)


def shown_for(session: SessionLike, displays: Displays, ranks: Targets, what: str) -> set[int] | None:
    """The ranks whose rich output ``displays=`` asks for (None: every rank), checked before any rank starts."""
    session.ensure_started()
    world = session.world_size
    return shown_ranks(displays, chosen_ranks(ranks, world) or list(range(world)), world, what)


def run_on_ranks(session: SessionLike, what: str, fn: Callable[..., Any],
                 args_for: Callable[[Placement], tuple[Any, ...]], ranks: Targets = None,
                 output: bool | None = None, shown: Collection[int] | None = (),
                 drawing: Drawing | None = None) -> dict[int, Any]:
    """Start the default workers if needed, run ``fn(*args_for(p))`` on ``ranks``, wait: results by rank.

    ``output``: show what the ranks print, labelled ``[rank N]``, as it
    arrives (True) or grouped by rank at the end (False); None shows nothing.
    ``shown``: the ranks whose rich output is shown (None: all; ``shown_for``); ``drawing``: how bars are drawn
    in place (default: what this kernel allows).
    """
    call, printer = call_with_output(session, what, fn, args_for, ranks, output, shown, drawing)
    if printer is None:
        return call.wait()
    try:
        return call.wait(on_tick=printer.tick)
    finally:
        printer.finish(call.tasks)


def call_with_output(session: SessionLike, what: str, fn: Callable[..., Any],
                     args_for: Callable[[Placement], tuple[Any, ...]], ranks: Targets = None,
                     output: bool | None = None, shown: Collection[int] | None = (),
                     drawing: Drawing | None = None,
                     also: Listener[Any] | None = None) -> tuple[RankCall, RankOutput | None]:
    """Launch the call with its output listened to from before it is sent (``output`` None: no printer); the
    caller waits, ticking the printer, and finishes it (``run_on_ranks``, ``cells/reported_call.py``).

    ``also``: another listener attached to each task before it is sent (the call's report batches).
    """
    inbox = RankInbox() if output is not None else None
    listeners = [each for each in (inbox, also) if each is not None]
    try:
        call = call_on_ranks(session, what, fn, args_for, ranks,
                             listen=functools.partial(_attach, listeners) if listeners else None)
    except BaseException:
        for each in listeners:
            each.close()
        raise
    if inbox is None:
        return call, None
    return call, RankOutput(call.tasks.ars, inbox, live=bool(output), shown=shown, drawing=drawing)


def _attach(listeners: list[Listener[Any]], rank: int, future: Any) -> None:
    for each in listeners:
        each.attach(rank, future)
