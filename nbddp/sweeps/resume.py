"""A trial whose worker died: run again as a new trial, or resumed from its newest snapshot.

What is retried, and how often, is the trial's ``FailurePolicy``
(``nbddp/execution/policy.py``: ``nbddp.sweep(max_restarts=N, snapshot_every=...)``,
a stall never). Without ``snapshot_every`` a dead worker's trial runs again
from its start, as a new trial with the same parameters
(``SweepRun.run_again``). With it, each trial gets a folder of its own in
``/dev/shm`` (owner-only, ``elastic/snapshot_folder.py``) and its group
snapshots into it as an elastic ``dist_fit`` does
(``worker/checkpoints/snapshots.py``). When a worker of the trial dies, the
trial is not told to Optuna: it is held, RUNNING, until the other running
trials have ended and the lost engines are replaced (``SweepRun._heal``),
then it runs again on its own group, healed, from the newest snapshot
(``FitConfig.from_snapshot``), before any new trial takes that group. Its
History keeps the records the kernel saw up to the step it resumed from,
then the relaunch's, and ``History.restarts`` says what happened: the same
ledger as a ``dist_fit``'s (``nbddp.elastic.recovery.Recovery``).
"""

from __future__ import annotations

import time
from dataclasses import replace

from nbddp.elastic import snapshot_folder
from nbddp.elastic.recovery import Records
from nbddp.execution.policy import Verdict
from nbddp.protocol.errors import WorkerError
from nbddp.protocol.fit_options import FitConfig
from nbddp.protocol.messages import FitResult, published
from nbddp.sweeps.schedule import Schedule
from nbddp.sweeps.trial_run import TrialRun


def with_snapshots(sweep: Schedule, cfg: FitConfig) -> FitConfig:
    """A new trial's config: with a snapshot folder of its own when the sweep snapshots, else unchanged."""
    if sweep.policy.snapshot_every is None:
        return cfg
    return replace(cfg, snapshot_every=sweep.policy.snapshot_every,
                   snapshot_dir=snapshot_folder.make(sweep.session.file_prefix))


def go_on(sweep: Schedule, run: TrialRun, error: WorkerError) -> bool:
    """``run`` failed with ``error``: held to resume (True), or told failed (False), run again as a new trial
    when its worker died and ``max_restarts`` allows; its row says which."""
    policy = sweep.policy
    snapshots = policy.snapshot_every is not None
    used = len(run.restarts) if snapshots else run.trial.user_attrs.get("nbddp_attempt", 0)
    verdict = policy.verdict(error, used, stopping=sweep.stopping)
    more = f"nbddp.sweep(..., max_restarts={policy.max_restarts + 1}) or more"
    if verdict is Verdict.SPENT and snapshots:
        run.row.error += (f"\n(its worker died, and max_restarts={policy.max_restarts} is spent: this trial resumed "
                          f"{used} time(s) from its snapshots and is not resumed again; pass {more} to resume "
                          "further)")
    elif verdict is Verdict.SPENT:
        run.row.error += (f"\n(its worker died, and max_restarts={policy.max_restarts} is spent: this trial's "
                          f"parameters ran {used + 1} time(s) and are not run again; pass {more} to retry further)")
    elif verdict is Verdict.RETRY and snapshots:
        hold(sweep, run, error)
        return True
    elif verdict is Verdict.RETRY:
        sweep.run_again(run, used)
        run.row.error += (f"\n(its worker died: the trial is run again as a new trial, retry {used + 1} of "
                          f"max_restarts={policy.max_restarts})")
    return False


def hold(sweep: Schedule, run: TrialRun, error: WorkerError) -> None:
    """``run``'s worker died: held, RUNNING in the study, to resume from its snapshot once the sweep healed."""
    if run.restarts:  # this attempt was itself a resume: the attempt before it counts up to where this one began
        plan = published(run.first_rank_task(), "plan")
        if plan is not None:
            cut(run, plan.start_step)
    run.lost_records += run.records
    steps = [r.get("step", 0) for _, r in run.lost_records + run.recovery.before_resume]
    run.recovery.lost(error.rank, f"{error.exc_type}: {error.message}", max(steps, default=0))
    run.noticed = time.monotonic()
    run.row.state = "resuming"
    sweep.resuming.append(run)


def cut(run: TrialRun, start_step: int) -> None:
    """The attempt after a death resumed at ``start_step``: the records up to it are kept (the ledger's rule)."""
    run.recovery.resumed(start_step, run.recovery.before_resume + run.lost_records)
    run.lost_records = []


def held_for(sweep: Schedule, g: int) -> TrialRun | None:
    """The held trial that resumes on group ``g`` (its own), or None."""
    return next((run for run in sweep.resuming if run.row.group == g), None)


def relaunch(sweep: Schedule, g: int, run: TrialRun) -> None:
    """Run the held trial ``run`` again on its healed group ``g``, from its newest snapshot."""
    sweep.resuming.remove(run)
    run.recovery.relaunched(run.restarts[-1], run.noticed)
    run.walls = {"sent_wall": time.time()}
    # the same trial, row, values and records so far; a new attempt's tasks
    sweep.send(g, run, replace(run.cfg, from_snapshot=True))
    sweep.running[g] = run
    sweep.changed += 1


def records_of(run: TrialRun, head: FitResult) -> Records:
    """A finished trial's records, as ``(kind, record)``: those kept across its resumes, then its last attempt's."""
    if run.restarts:
        cut(run, head.plan.start_step if head.plan is not None else 0)
        if "train_start_wall" in head.timings:  # from the loss to training again, on the workers' clock
            run.restarts[-1]["seconds"] = round(head.timings["train_start_wall"] - run.restarts[-1]["time"], 3)
    return run.recovery.before_resume + [(kind, record) for _, kind, record in head.records]


def release(run: TrialRun) -> None:
    """The trial's snapshots go (it ended, or will not resume)."""
    snapshot_folder.remove(getattr(run.cfg, "snapshot_dir", None))
