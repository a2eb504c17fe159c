"""Each rank's output in the notebook, line by line, labelled ``[rank N]``, and the calls that print it.

Engine output reaches the kernel in batches (a 0.2 s flush interval); it is
polled while a cell, call or script waits, and printed as complete lines.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any, Callable

from nbddp.execution.calls import Targets, call_on_ranks
from nbddp.execution.contracts import SessionLike
from nbddp.execution.rank_tasks import RankTasks
from nbddp.protocol.placement import Placement

if TYPE_CHECKING:
    from ipyparallel import AsyncResult

OUTPUT_WAIT_S = 2.0


class RankOutput:
    """Each rank's engine stdout/stderr, printed as complete lines with a ``[rank N]`` label.

    ``live``: print as it arrives (polled at every tick); otherwise print
    everything, grouped by rank, when the cell ends.
    """

    def __init__(self, ars: dict[int, AsyncResult], live: bool = True):
        self.ars = ars
        self.live = live
        self.seen = {(r, k): 0 for r in ars for k in ("stdout", "stderr")}
        self.partial = {key: "" for key in self.seen}
        self.lines: list[tuple[int, str, str]] = []  # (rank, stream, line) held back when not live

    def tick(self) -> None:
        for rank, ar in self.ars.items():
            for kind in ("stdout", "stderr"):
                self._take(rank, kind, output_of(ar, kind))

    def _take(self, rank: int, kind: str, text: str) -> None:
        key = (rank, kind)
        new = text[self.seen[key]:]
        if not new:
            return
        self.seen[key] = len(text)
        *complete, rest = (self.partial[key] + new).split("\n")
        self.partial[key] = rest
        for line in complete:
            self._emit(rank, kind, line)

    def _emit(self, rank: int, kind: str, line: str) -> None:
        if self.live:
            write(kind, f"[rank {rank}] {line}\n")
        else:
            self.lines.append((rank, kind, line))

    def finish(self, tasks: RankTasks) -> None:
        """Wait briefly for the last output of ranks that ended, then print the rest."""
        deadline = time.monotonic() + OUTPUT_WAIT_S
        for rank, ar in self.ars.items():
            if rank in tasks.results or rank in tasks.failures:
                try:
                    ar.wait_for_output(max(0.01, deadline - time.monotonic()))
                except Exception:  # noqa: BLE001 - output is best effort
                    pass
        self.tick()
        for (rank, kind), rest in self.partial.items():
            if rest:
                self._emit(rank, kind, rest)
                self.partial[(rank, kind)] = ""
        for rank, kind, line in sorted(self.lines, key=lambda item: item[0]):
            write(kind, f"[rank {rank}] {line}\n")
        self.lines.clear()
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


def run_on_ranks(session: SessionLike, what: str, fn: Callable[..., Any],
                 args_for: Callable[[Placement], tuple[Any, ...]], ranks: Targets = None,
                 output: bool | None = None) -> dict[int, Any]:
    """Start the default workers if needed, run ``fn(*args_for(p))`` on ``ranks``, wait: results by rank.

    ``output``: print what the ranks print, labelled ``[rank N]``, as it
    arrives (True) or grouped by rank at the end (False); None prints nothing.
    """
    call = call_on_ranks(session, what, fn, args_for, ranks)
    if output is None:
        return call.wait()
    printer = RankOutput(call.tasks.ars, live=output)
    try:
        return call.wait(on_tick=printer.tick)
    finally:
        printer.finish(call.tasks)
