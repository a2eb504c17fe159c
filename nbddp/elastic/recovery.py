"""After a lost rank, inside the same fit: retry or not, wait for the heal, relaunch, and say what happened.

The supervisor already replaces the lost workers (``RankTasks.fail`` hands the
dead and the stuck to ``Supervisor.recover``). ``Recovery`` decides whether
the fit goes on (``ElasticPolicy.retries`` and ``max_restarts``), waits for
that heal, and has the ``FitRun`` launch the same fit again on the new
group, from the newest snapshot (``worker/checkpoints/snapshots.py``). When
the relaunched rank 0 says where it resumed, the records of the steps after
that are dropped (their replays take their place), and the live view and
``History.restarts`` say what happened.
"""

from __future__ import annotations

import time
from typing import Any

from nbddp.elastic import fewer_ranks, job_loss
from nbddp.elastic.policy import ElasticPolicy
from nbddp.elastic.spare import keep_spare
from nbddp.protocol.errors import ClusterError, SlurmError, WorkerDied, WorkerError

KINDS = (("step", "steps"), ("epoch", "epochs"), ("val", "validations"))


class Recovery:
    """One fit's restarts (``policy.max_restarts`` at most)."""

    def __init__(self, policy: ElasticPolicy):
        self.policy = policy
        self.restarts: list[dict[str, Any]] = []  # History.restarts: the same list
        self.kept: list[tuple[str, dict[str, Any]]] = []  # records of the steps before the last resume
        self.pending: tuple[dict[str, Any], float] | None = None  # a relaunch not yet resumed

    def should_retry(self, run: Any, exc: WorkerError | SlurmError) -> bool:
        """Whether the fit goes on after ``exc``; when it does not, the error says why."""
        if not self.policy.enabled or run.stop_requested or run.hard_stopped:
            return False
        lost_job = isinstance(exc, SlurmError)  # the job holding every rank was lost
        if lost_job:
            why = job_loss.not_retried(exc, self.policy.max_restarts)
        elif not self.policy.retries(exc):
            why = (f"nbddp: not retried: {exc.exc_type} was raised by the fit's own code, and a bug does the same "
                   f"thing again; to retry it, pass retry_on=[{exc.exc_type}]")
        else:
            why = None
        used = len(self.restarts)
        if why is None and used >= self.policy.max_restarts:
            why = (f"nbddp: the fit was restarted {used} time(s) and max_restarts={self.policy.max_restarts} were all "
                   "used; " + ("this lost job ends it" if lost_job
                               else "this failure ends it (History.restarts on a FitHandle lists them)"))
        if why is None:
            return True
        if lost_job:
            job_loss.add_note(exc, why)
        else:
            exc.with_note(why)
        return False

    def relaunch(self, run: Any, exc: WorkerError | SlurmError) -> None:
        """Wait for the supervisor's heal, then launch the same fit again from the newest snapshot."""
        noticed = time.monotonic()
        # the ranks' last heartbeats, read once more as the failure was built (they come about once a second)
        steps = [p.get("step") or 0 for p in run.tasks.stalls.watch.positions() + run.live_state.positions]
        if isinstance(exc, SlurmError):
            job_loss.relaunch(self, run, exc, steps + [run.history.last_step])
            return
        cause = exc.how if isinstance(exc, WorkerDied) else f"{exc.exc_type}: {exc.message}"
        event = {"rank": exc.rank, "cause": cause,
                 "step_lost_at": max(steps + [run.history.last_step]), "step_resumed_from": None,
                 "replace_s": None, "seconds": None, "time": time.time()}
        self.restarts.append(event)
        run.live_state.restarts.append(f"rank {event['rank']} lost at step {event['step_lost_at']} "
                                       f"({event['cause']}); replacing it")
        run.live_state.status = "recovering"
        run.view.update(run)
        try:
            run.session.wait_healed(raise_error=True)
        except ClusterError as failed:  # no replacement could start: with min_workers, go on with fewer ranks
            if self.policy.min_workers is None:
                raise
            fewer_ranks.go_on(self, run, exc, failed, event)
        event["replace_s"] = round(time.monotonic() - noticed, 3)
        self.pending = (event, noticed)
        run.relaunch()

    def resumed(self, run: Any, start_step: int) -> None:
        """The relaunched rank 0 restored its state at ``start_step``: keep the records up to it, say so."""
        if self.pending is None:
            return
        event, noticed = self.pending
        self.pending = None
        event["step_resumed_from"] = start_step
        event["step_lost_at"] = max(event["step_lost_at"], start_step)  # the snapshot's step was reached
        event["seconds"] = round(time.monotonic() - noticed, 3)
        self.kept = kept_records(run.history, start_step)
        run.history = run.new_history(self.kept)
        if "world_size" in event:  # went on with fewer ranks
            run.live_state.restarts[-1] = fewer_ranks.going_line(event, run.plan.cfg.data_world, start_step)
        else:
            run.live_state.restarts[-1] = (f"rank {event['rank']} lost at step {event['step_lost_at']} "
                                           f"({event['cause']}); replaced in {event['replace_s']:.1f} s; resumed "
                                           f"from step {start_step}" if "job" not in event
                                           else job_loss.resumed_line(event, start_step))
        keep_spare(run.session)  # the next lost rank's replacement, warming while the fit trains again


def kept_records(history: Any, start_step: int) -> list[tuple[str, dict[str, Any]]]:
    """The records of ``history`` up to ``start_step``, as ``(kind, record)``: later ones are replayed."""
    kept = []
    for kind, name in KINDS:
        kept += [(kind, r) for r in getattr(history, name) if r.get("step", 0) <= start_step]
    return kept
