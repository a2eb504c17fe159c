"""The one failure policy: what the kernel does when a rank of some work fails or stops making progress.

``FailurePolicy`` holds every knob of it in one object: how many times the
work is relaunched after a lost rank (``max_restarts``), which of the
person's own exceptions are worth that too (``retry_on``), the fewest ranks
a fit may go on with when no replacement starts (``min_workers``), how long
a rank may go without progress (``stall_timeout``), and how long the other
ranks get to finish or fail after the first failure before they are taken
for stuck in a collective and killed (``grace_s``), and how often the work
snapshots so that a restart resumes rather than begins again
(``snapshot_every``). A fit, a prediction, a
cell, a call and a sweep trial are each given one; ``nbddp/execution/rank_tasks.py``
applies the grace and the stall timeout to all of them alike, and
``nbddp/elastic/recovery.py`` the restarts.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from nbddp.execution.outcome import is_consequence
from nbddp.protocol.errors import WorkerDied, WorkerError, WorkerStalled

GRACE_S = 1.5
# work that resumes from its snapshots after a lost rank waits longer for the survivors to raise "connection closed" on their own: one
# kept alive is one engine less to replace (seconds of start-up and imports), while a rank that takes longer than that
# is stuck in a collective and is killed as before
RESTART_GRACE_S = 6.0


class Verdict(Enum):
    """Whether a failure is retried, and if not, why (each caller words it for its own call)."""

    RETRY = "retry"
    NOT_RESTARTING = "not restarting"  # the work is being stopped
    OWN_ERROR = "own error"  # the person's code raised, and retry_on does not name it
    STALLED = "stalled"  # a stall, in work whose stalls are not retried (a sweep trial: the same values stall again)
    SPENT = "spent"  # max_restarts were all used (none, with max_restarts=0)
    NOT_A_RANK = "not a rank"  # the controller or the whole Slurm job is gone (elastic/job_loss.py decides those)


@dataclass(frozen=True)
class FailurePolicy:
    """What one piece of work does when a rank fails (the defaults: report it, relaunch nothing)."""

    max_restarts: int = 0
    # for FitConfig: int steps, "epoch", float seconds, "auto"; None: no snapshots (a restart begins again)
    snapshot_every: int | str | float | None = None
    retry_on: tuple[type[BaseException], ...] = ()
    min_workers: int | None = None  # go on with fewer ranks when no replacement can start (elastic/fewer_ranks.py)
    stall_timeout: float | None = None  # seconds without progress that fail the work (WorkerStalled); None: shown only
    retry_stalls: bool = True  # a sweep trial's stall is not retried: the same parameters would stall again

    @property
    def restarts(self) -> bool:
        """Whether a lost rank is replaced and the same work goes on (``max_restarts`` >= 1)."""
        return self.max_restarts > 0

    @property
    def grace_s(self) -> float:
        """After the first failure, how long the other ranks may take to finish or fail before they are killed
        (longer when the work resumes from snapshots: each survivor kept is an engine less to start)."""
        return RESTART_GRACE_S if self.restarts and self.snapshot_every is not None else GRACE_S

    def retries(self, exc: BaseException) -> bool:
        """Whether this kind of failure is worth a restart: a lost process, a broken collective, a stall, or
        ``retry_on``. An exception the person's code raised is not: a bug does the same thing again."""
        return isinstance(exc, WorkerError) and self._kind_retried(exc)

    def verdict(self, exc: BaseException, used: int, stopping: bool = False) -> Verdict:
        """Whether work that has restarted ``used`` times goes on after ``exc`` (``stopping``: a stop was asked).

        ``max_restarts=0`` is spent from the start: a kind of failure that restarts would is ``SPENT``.
        """
        if stopping:
            return Verdict.NOT_RESTARTING
        if not isinstance(exc, WorkerError):
            return Verdict.NOT_A_RANK
        if not self._kind_retried(exc):
            return Verdict.STALLED if isinstance(exc, WorkerStalled) else Verdict.OWN_ERROR
        if used >= self.max_restarts:
            return Verdict.SPENT
        return Verdict.RETRY

    def _kind_retried(self, exc: WorkerError) -> bool:
        if isinstance(exc, WorkerDied):
            return True
        if isinstance(exc, WorkerStalled):
            return self.retry_stalls
        if exc.exc_type in {t.__name__ for t in self.retry_on}:
            return True
        return is_consequence(exc.failure)  # every rank failed only because a peer went away
