"""What became of a rank's task, and which failure is the headline: the one place this is decided.

A rank's task ends in one of five ways (``Kind``):

* ``finished``: it returned;
* ``raised``: the person's code (or nbddp's on the rank) raised;
* ``died``: the engine process is gone (killed, a segfault, the OOM
  killer): ipyparallel reports an ``EngineError``, and the engine's exit
  tells how (``Workers.how_died``: the signal, the log's tail);
* ``stuck``: still running after a peer failed and the grace period
  passed: waiting in a gloo/NCCL collective that no signal can break, so it
  is killed;
* ``consequence``: it raised only because a peer failed (nbddp's
  ``PeerFailed``, or gloo's "Connection closed by peer").

When several ranks fail, ``headline`` picks the cause to raise: a death
before any raise, a rank's own error before a peer's broken connection,
then the earliest on the workers' clock; a ``PeerFailed`` is never the
headline while another failure exists.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from nbddp.protocol.errors import RankFailure
from nbddp.protocol.messages import published
from nbddp.protocol.placement import Placement

if TYPE_CHECKING:
    from ipyparallel import AsyncResult

PEER_FAILED = "PeerFailed"
WORKER_DIED = "WorkerDied"
_CONSEQUENCES = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


class Kind(str, Enum):
    """How one rank's task ended (see the module docstring)."""

    FINISHED = "finished"
    RAISED = "raised"
    DIED = "died"
    STUCK = "stuck"
    CONSEQUENCE = "consequence"


@dataclass
class RankOutcome:
    """One rank's end: its kind, its failure record (None when it finished) and when it failed (workers' clock)."""

    rank: int
    kind: Kind
    failure: RankFailure | None = None
    at: float = 0.0

    @property
    def failed(self) -> bool:
        return self.kind is not Kind.FINISHED


def is_consequence(failure: RankFailure) -> bool:
    """A failure caused by another rank's failure (its own work was fine)."""
    return failure.exc_type == PEER_FAILED or any(c in failure.message for c in _CONSEQUENCES)


def engine_died(exc: BaseException) -> bool:
    """Whether ``exc`` (from an ``AsyncResult``) says the engine process is gone.

    The controller reports a dead engine as an ``EngineError``, or as a
    ``RemoteError`` named ``EngineError`` when it relays one.
    """
    from ipyparallel.error import EngineError, RemoteError

    return isinstance(exc, EngineError) or (isinstance(exc, RemoteError) and exc.ename == "EngineError")


def classify(rank: int, exc: BaseException, placement: Placement | None) -> tuple[RankFailure, bool]:
    """(the failure record of ``rank``'s ``exc``, whether the engine process died)."""
    from ipyparallel.error import RemoteError

    pid = placement.pid if placement is not None else None
    host = placement.host if placement is not None else ""
    engine = placement.engine_id if placement is not None else None
    if engine_died(exc):
        return RankFailure(rank, WORKER_DIED, f"the worker process (pid {pid}) died", "", pid, host, engine), True
    if isinstance(exc, RemoteError):
        tb = exc.traceback if isinstance(exc.traceback, str) else "".join(exc.traceback or [])
        return RankFailure(rank, exc.ename, str(exc.evalue), tb, pid, host, engine), False
    return RankFailure(rank, type(exc).__name__, str(exc), "", pid, host, engine), False


def judge(rank: int, exc: BaseException, placement: Placement | None, at: float) -> RankOutcome:
    """The outcome of a task that raised ``exc`` (``at``: when, on the workers' clock)."""
    failure, dead = classify(rank, exc, placement)
    if dead:
        kind = Kind.DIED
    elif is_consequence(failure):
        kind = Kind.CONSEQUENCE
    else:
        kind = Kind.RAISED
    return RankOutcome(rank, kind, failure, at)


def stuck(rank: int) -> RankOutcome:
    """A rank still running after the grace: killed, stuck in a collective."""
    return RankOutcome(rank, Kind.STUCK, None, time.time())


def headline(outcomes: list[RankOutcome]) -> tuple[RankOutcome, list[RankOutcome]]:
    """(the failure to raise, the other failures to list), from the failed outcomes (stuck ones aside).

    The cause first: a death before any raise, an own error before a peer's
    consequence, then the earliest; ``PeerFailed`` ranks are never listed.
    """
    failed = [o for o in outcomes if o.failure is not None]
    ranked = sorted(failed, key=lambda o: (o.kind is not Kind.DIED, o.kind is Kind.CONSEQUENCE, o.at))
    own = [o for o in ranked if o.failure is not None and o.failure.exc_type != PEER_FAILED] or ranked
    head = own[0]
    others = [o for o in ranked if o is not head and o.failure is not None and o.failure.exc_type != PEER_FAILED]
    return head, others


def raised_at(ar: AsyncResult, finished: float) -> float:
    """When the rank raised, as it published before its reply (read now: the reply may overtake it), else ``finished``.

    The task's end as the engine reports it comes after ipyparallel formatted
    the traceback, which on a loaded machine reordered ranks that raised half
    a second apart.
    """
    raised = published(ar, "raised")
    return float(raised) if isinstance(raised, (int, float)) and not isinstance(raised, bool) else finished


def finished_at(ar: AsyncResult) -> float:
    """When the task ended on the engine (wall clock), else now."""
    try:
        done = ar.metadata.get("completed")
        if done is not None:
            return float(done.timestamp())
    except Exception:  # noqa: BLE001 - metadata is best effort
        pass
    return time.time()
