"""After a lost rank, inside the same work: retry or not, wait for the heal, relaunch, and say what happened.

The supervisor already replaces the lost workers (``RankTasks.fail`` hands the
dead and the stuck to ``Supervisor.recover``). ``Recovery`` decides whether
the work goes on (the ``FailurePolicy``'s verdict, ``nbddp/execution/policy.py``),
waits for that heal, and has the run launch the same work again on the new
group, from the newest snapshot (``worker/checkpoints/snapshots.py``). When
the relaunched rank 0 says where it resumed, the records of the steps after
that are dropped (their replays take their place), and the live view and
``History.restarts`` say what happened.

A ``dist_fit`` and a sweep's trial go through the same ledger
(``Recovery.lost``, ``Recovery.relaunched``, ``Recovery.resumed``): the fit
heals at once and relaunches itself; a trial is held until the sweep's
other trials end and the sweep heals (``nbddp/sweeps/resume.py``).
"""

from __future__ import annotations

import time
from typing import Any

from nbddp.elastic import fewer_ranks, job_loss
from nbddp.elastic.contracts import Records, Relaunchable
from nbddp.elastic.spare import keep_spare
from nbddp.execution.policy import FailurePolicy, Verdict
from nbddp.protocol.errors import ClusterError, SlurmError, WorkerDied, WorkerError


class Recovery:
    """One piece of work's restarts (``policy.max_restarts`` at most), and what the kernel saw before each."""

    def __init__(self, policy: FailurePolicy):
        self.policy = policy
        self.restarts: list[dict[str, Any]] = []  # History.restarts: the same list
        self.before_resume: Records = []  # records of the steps before the last resume
        self.pending: tuple[dict[str, Any], float] | None = None  # a relaunch not yet resumed

    # ---- the ledger, for a fit and a sweep trial alike ------------------------------------------------
    def lost(self, rank: int | None, cause: str, step_lost_at: int, **more: Any) -> dict[str, Any]:
        """A new restart event (``History.restarts``), not yet relaunched nor resumed."""
        event = {"rank": rank, "cause": cause, "step_lost_at": step_lost_at, "step_resumed_from": None,
                 "replace_s": None, "seconds": None, "time": time.time(), **more}
        self.restarts.append(event)
        return event

    def relaunched(self, event: dict[str, Any], noticed: float) -> None:
        """The healed group is about to run the work again (``noticed``: when the loss was, monotonic clock)."""
        event["replace_s"] = round(time.monotonic() - noticed, 3)
        self.pending = (event, noticed)

    def resumed(self, start_step: int, records: Records) -> dict[str, Any] | None:
        """The relaunched rank 0 restored its state at ``start_step``: the records up to it are kept.

        Returns the completed event (None when no relaunch was pending).
        """
        if self.pending is None:
            return None
        event, noticed = self.pending
        self.pending = None
        event["step_resumed_from"] = start_step
        event["step_lost_at"] = max(event["step_lost_at"], start_step)  # the snapshot's step was reached
        event["seconds"] = round(time.monotonic() - noticed, 3)
        self.before_resume = [(kind, r) for kind, r in records if r.get("step", 0) <= start_step]
        return event

    # ---- a fit ---------------------------------------------------------------------------------
    def should_retry(self, run: Relaunchable, exc: WorkerError | SlurmError) -> bool:
        """Whether the fit goes on after ``exc``; when it does not, the error says why."""
        if not self.policy.restarts or run.stopping:
            return False
        used = len(self.restarts)
        verdict = self.policy.verdict(exc, used)
        lost_job = isinstance(exc, SlurmError)  # the job holding every rank was lost
        why = None
        if isinstance(exc, SlurmError):
            why = job_loss.not_retried(exc, self.policy.max_restarts)
        elif verdict is Verdict.OWN_ERROR:
            why = (f"nbddp: not retried: {exc.exc_type} was raised by the fit's own code, and a bug does the same "
                   f"thing again; to retry it, pass retry_on=[{exc.exc_type}]")
        if why is None and used >= self.policy.max_restarts:
            why = (f"nbddp: the fit was restarted {used} time(s) and max_restarts={self.policy.max_restarts} were all "
                   "used; " + ("this lost job ends it" if lost_job
                               else "this failure ends it (History.restarts on a FitHandle lists them)"))
        if why is None:
            return True
        if isinstance(exc, SlurmError):
            job_loss.add_note(exc, why)
        else:
            exc.with_note(why)
        return False

    def relaunch(self, run: Relaunchable, exc: WorkerError | SlurmError) -> None:
        """Wait for the supervisor's heal, then launch the same fit again from the newest snapshot."""
        noticed = time.monotonic()
        steps = run.steps_reached()
        if isinstance(exc, SlurmError):
            job_loss.relaunch(self, run, exc, steps)
            return
        cause = exc.how if isinstance(exc, WorkerDied) else f"{exc.exc_type}: {exc.message}"
        event = self.lost(exc.rank, cause, max(steps))
        run.show_restart(f"rank {event['rank']} lost at step {event['step_lost_at']} ({event['cause']}); "
                         "replacing it", status="recovering")
        try:
            run.session.wait_healed(raise_error=True)
        except ClusterError as failed:  # no replacement could start: with min_workers, go on with fewer ranks
            if self.policy.min_workers is None:
                raise
            fewer_ranks.go_on(self, run, exc, failed, event)
        self.relaunched(event, noticed)
        run.relaunch()

    def fit_resumed(self, run: Relaunchable, start_step: int) -> None:
        """The relaunched fit's rank 0 restored its state at ``start_step``: keep the records up to it, say so."""
        event = self.resumed(start_step, run.records())
        if event is None:
            return
        run.keep_records(self.before_resume)
        if "world_size" in event:  # went on with fewer ranks
            line = fewer_ranks.going_line(event, run.config.data_world, start_step)
        elif "job" in event:
            line = job_loss.resumed_line(event, start_step)
        else:
            line = (f"rank {event['rank']} lost at step {event['step_lost_at']} ({event['cause']}); replaced in "
                    f"{event['replace_s']:.1f} s; resumed from step {start_step}")
        run.show_restart(line, replace_last=True)
        keep_spare(run.session)  # the next lost rank's replacement, warming while the fit trains again
