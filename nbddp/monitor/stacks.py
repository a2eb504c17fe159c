"""``nbddp.stacks()`` and ``%ddp stacks``: every rank's Python stack now, labelled by rank.

How a rank is asked, even inside a collective, is the execution package's
(``nbddp/execution/rank_stacks.py``); this module checks the call and shows
the answer.
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING

from nbddp.execution.calls import Targets, placements_for
from nbddp.execution.rank_stacks import RankStack, collect
from nbddp.protocol.errors import ClusterError, NotStartedError

if TYPE_CHECKING:
    from ipyparallel import AsyncResult

    from nbddp.session.session import Session

STACKS_TIMEOUT_S = 5.0


class RankStacks:
    """``nbddp.stacks()``'s answer: one ``RankStack`` per rank, shown labelled by rank."""

    def __init__(self, entries: list[RankStack], seconds: float):
        self.entries = sorted(entries, key=lambda e: e.rank)
        self.seconds = seconds

    def __getitem__(self, rank: int) -> RankStack:
        for entry in self.entries:
            if entry.rank == rank:
                return entry
        raise KeyError(f"no rank {rank}; the stacks are of ranks {[e.rank for e in self.entries]}")

    def __iter__(self):
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __repr__(self) -> str:
        blocks = []
        for e in self.entries:
            body = e.text.rstrip("\n") if e.text else ("  (no task running)" if e.state == "idle" else "  (no stack)")
            blocks.append(f"{e.label}\n{body}")
        return "\n\n".join(blocks)

    def _repr_html_(self) -> str:
        parts = [f"<div class='nbddp-stacks'><b>{html.escape(e.label)}</b><pre>{html.escape(e.text or '')}</pre></div>"
                 for e in self.entries]
        return "".join(parts)


def stacks(timeout: float = STACKS_TIMEOUT_S, ranks: Targets = None) -> RankStacks:
    """Every rank's current Python stack, labelled by rank, within ``timeout`` seconds.

    Works while a fit, a ``%%ddp`` cell, ``nbddp.run`` or a script runs, even
    on a rank blocked in a collective or in C code; a rank with nothing
    running says ``idle``. ``ranks``: these only (a list, one rank, or a
    slice of them, as ``run_cell`` takes them).
    """
    from nbddp.session.session import get_session

    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"stacks(timeout=...) is in seconds and must be > 0, got {timeout!r}")
    s = get_session()
    group = s.group
    if not s.started or group is None:
        raise NotStartedError("no workers are running, so there are no stacks; start them with nbddp.start()")
    workers = s.workers
    problem = workers.controller_problem() if workers is not None else None  # (started: there are workers)
    if problem is not None:
        raise ClusterError(f"{problem}, so the workers cannot be asked for their stacks. Run nbddp.restart() to "
                           "start fresh workers.")
    return RankStacks(*collect(s, placements_for(s, ranks), busy_ars(s), timeout))


def busy_ars(session: Session) -> dict[int, AsyncResult]:
    """rank -> the AsyncResult of the task it runs now, for the work that holds the workers."""
    running = session.running
    tasks = getattr(running, "tasks", None)
    if tasks is None or running.finished:
        return {}
    return {rank: tasks.ars[rank] for rank in tasks.pending}
