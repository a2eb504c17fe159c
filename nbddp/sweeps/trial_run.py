"""One trial of a sweep on its group of workers: a piece of work like any other, watched like any other.

A ``TrialRun`` is ``nbddp.execution.work.Work``: its tasks are one
``RankTasks`` per attempt (``nbddp/execution/rank_tasks.py``), so a trial's
rank that raises, dies or stalls is judged, and its stuck peers killed after
the grace, exactly as in a ``dist_fit``. What differs is what happens to the
engines it loses: the sweep replaces them once no other trial runs
(``SweepRun.lose``), not at once. Its restarts are the elastic fit's
ledger (``nbddp.elastic.recovery.Recovery``): a trial whose worker died
resumes from its snapshot the way a fit does (``nbddp/sweeps/resume.py``).
"""

from __future__ import annotations

import signal
import time
from typing import TYPE_CHECKING, Any, Protocol

from nbddp.elastic.recovery import Recovery, Records
from nbddp.execution.contracts import SessionLike
from nbddp.execution.policy import FailurePolicy
from nbddp.execution.rank_tasks import RankTasks
from nbddp.execution.work import Work
from nbddp.protocol.errors import WorkerStalled
from nbddp.protocol.fit_options import FitConfig
from nbddp.sweeps.result import TrialRow

if TYPE_CHECKING:
    import optuna
    from ipyparallel import AsyncResult


class Trials(Protocol):
    """What a trial reads of its sweep (``scheduler.py``'s ``SweepRun``): its session, its failure policy, its
    groups of ranks, and how to wake its schedule."""

    policy: FailurePolicy
    groups: list[list[int]]

    @property
    def session(self) -> SessionLike: ...

    def wake(self) -> None: ...


class TrialRun(Work):
    """One trial on its group: Optuna's trial, its tasks, what the kernel has seen of it."""

    def __init__(self, sweep: Trials, trial: optuna.trial.Trial, row: TrialRow, cfg: FitConfig,
                 bind: dict[str, dict[str, Any]], walls: dict[str, float]):
        super().__init__(sweep.session, f"trial {row.trial} of an nbddp.sweep")
        self.sweep = sweep
        self.trial = trial  # Optuna's
        self.row = row
        self.cfg = cfg
        self.bind = bind  # its values for the factory and step_fn
        self.walls = walls  # the kernel's moments of this trial (History.timings)
        self.started = time.perf_counter()
        self.reported: set[int] = set()  # steps whose metric Optuna was told
        self.recovery = Recovery(sweep.policy)  # History.restarts, and the records kept across resumes
        self.lost_records: Records = []  # a lost attempt's records: cut at the next resume
        self.tasks: RankTasks | None = None
        self.engines: list[int] = []
        self.seen = 0  # the attempt's records taken so far (rank 0's published window)
        self.records: Records = []  # (kind, record) seen of this attempt
        self.signalled = False
        self.signal_sent: Any = None  # the signal request's reply: done once the engines' nannies sent the SIGINT
        self.stall: WorkerStalled | None = None  # a rank made no progress for stall_timeout: its ranks were killed
        self.noticed = 0.0  # when its worker was lost (monotonic clock), for History.restarts' replace_s

    def begin(self, tasks: RankTasks, engines: list[int], cfg: FitConfig) -> None:
        """A new attempt of the trial: its first, or a resume after a lost worker."""
        self.tasks, self.engines, self.cfg = tasks, engines, cfg
        self.seen, self.records = 0, []
        self.signalled, self.signal_sent, self.stall = False, None, None
        self.row.state, self.row.error = "running", ""

    @property
    def restarts(self) -> list[dict[str, Any]]:
        return self.recovery.restarts

    @property
    def attempt(self) -> RankTasks:
        """The tasks of the trial's current attempt."""
        if self.tasks is None:
            raise RuntimeError(f"{self.description} was not sent")
        return self.tasks

    def first_rank_task(self) -> AsyncResult:
        """The ``AsyncResult`` of the group's first rank: it publishes the trial's records."""
        return self.attempt.ars[self.sweep.groups[self.row.group][0]]

    # ---- the work protocol -------------------------------------------------------------
    def request_stop(self) -> None:
        """SIGINT to the trial's engines once: the coordinated stop, as a pruner asks it (the schedule wakes
        when the nannies confirm it was sent)."""
        if self.signalled:
            return
        self.signalled = True
        workers = self.session.workers
        self.signal_sent = workers.signal(self.engines, signal.SIGINT) if workers is not None else None
        if self.signal_sent is not None:
            self.signal_sent.add_done_callback(lambda _f: self.sweep.wake())

    def hard_stop(self, reason: str = "a second interrupt") -> None:
        """Kill the trial's ranks still running; the sweep replaces their engines."""
        if self.tasks is not None:
            self.tasks.lose(self.session.supervisor.kill_ranks(self.tasks.pending))

    # ---- watching ------------------------------------------------------------------------
    def watch(self) -> bool:
        """One look at the attempt: stalls and the controller; whether its outcome is decided."""
        if self.stall is None:
            try:
                self.attempt.watch()
            except WorkerStalled as exc:  # its ranks were killed: the trial fails once their tasks report it
                self.stall = exc
        return self.attempt.poll()
