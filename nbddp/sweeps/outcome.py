"""How a finished trial is settled: its state told to Optuna, its History kept, its weights kept or let go.

A trial's tasks all returned (or raised) when this runs. The states:

* ``complete``: the fit ended on its own; the metric's last value is told
  to the study;
* ``pruned``: the pruner stopped it (the kernel signalled its engines);
* ``stopped``: the person stopped the sweep while it ran (told as failed,
  so a resumed study runs it again);
* ``failed``: a rank raised, died or stalled (judged as for any work on the
  ranks: ``nbddp/execution/outcome.py``); the row keeps the rank and the
  remote traceback, and the sweep goes on (a dead worker's trial may run
  again: ``resume.go_on``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from nbddp.execution.rank_tasks import RankTasks
from nbddp.fit.history import History
from nbddp.protocol.errors import WorkerError, WorkerStalled
from nbddp.sweeps import resume
from nbddp.sweeps.schedule import Schedule
from nbddp.sweeps.trial_run import TrialRun

if TYPE_CHECKING:
    import optuna
    from optuna.trial import TrialState


def tell(sweep: Schedule, trial: optuna.trial.Trial, value: float | None = None,
         state: TrialState | None = None) -> None:
    """``study.tell``; a sampler that says the study is done (Optuna's ``GridSampler`` once its grid is run)
    calls ``study.stop()``, which outside ``study.optimize`` raises: here it ends the hand-out instead.
    The trial's state is stored either way (Optuna stores it in a ``finally``)."""
    try:
        sweep.study.tell(trial, value, state=state)
    except RuntimeError as exc:
        if "Study.stop" not in str(exc):
            raise
        sweep.sampler_done = True


def settle(sweep: Schedule, run: TrialRun) -> None:
    """Settle ``run`` for ``sweep``: its tasks' outcome is decided (``TrialRun.watch``)."""
    from optuna.trial import TrialState

    tasks = run.attempt
    results = tasks.results
    error = run.stall or (_failed(tasks) if tasks.failures else None)
    row = run.row
    if error is not None and sweep.stopping and error.exc_type == "KeyboardInterrupt":
        # the stop's signal reached a rank before its trial had put up its own handler: stopped, not failed
        row.state = "stopped"
        _discard(results)
        tell(sweep, run.trial, state=TrialState.FAIL)
        return
    if error is not None:
        row.state, row.rank, row.error = "failed", error.rank, f"{error.exc_type}: {error.message}\n{error.remote_traceback}"
        _discard(results)
        if run.stall is not None:
            row.error = stall_words(run.stall)
        if resume.go_on(sweep, run, error):
            return  # RUNNING in the study: it resumes from its snapshot once the workers are healed
        tell(sweep, run.trial, state=TrialState.FAIL)
        return
    head = results[sweep.groups[row.group][0]]
    history = History(world_size=len(results), batch_size=run.cfg.batch_size,
                      global_batch_size=run.cfg.global_batch_size(len(results)), restarts=run.restarts)
    for seq, kind, record in head.records:
        if seq >= run.seen and row.state == "running":  # the records the published window skipped
            sweep.consider(run, record, prune=False)
    for kind, record in resume.records_of(run, head):
        history.add(kind, record)
    history.status = head.status
    history.timings = dict(head.timings)  # end_wall, setup_s, train_s: where a trial's time went
    sweep.histories[row.trial] = history
    value = _last_value(head.records, sweep.metric)
    row.value = value
    if head.status == "interrupted":
        row.state = "pruned" if row.state == "pruning" else "stopped"
        tell(sweep, run.trial, state=TrialState.PRUNED if row.state == "pruned" else TrialState.FAIL)
    elif value is None:
        row.state, row.error = "failed", f"the fit reported no {sweep.metric}"
        tell(sweep, run.trial, state=TrialState.FAIL)
    else:
        row.state = "complete"
        tell(sweep, run.trial, value)
        sweep.keep_if_best(value, head.weights, dict(run.trial.params))
    _discard(results)


def _failed(tasks: RankTasks) -> WorkerError:
    """The trial's error, as ``RankTasks`` decides it for any work (its stuck ranks killed, the lost engines handed
    to the sweep); a lost controller or Slurm job ends the sweep."""
    error = tasks.fail()
    if not isinstance(error, WorkerError):
        raise error
    return error


def stall_words(stall: WorkerStalled) -> str:
    """A stalled trial's row: which rank, how long, where, and its stack."""
    return (f"WorkerStalled: rank {stall.rank} {stall.message}; its ranks were killed and replaced\n"
            f"{stall.remote_traceback}")


def _last_value(records: list[tuple[int, str, dict[str, Any]]], metric: str) -> float | None:
    values = [r[metric] for _, kind, r in records if kind in ("epoch", "val") and metric in r]
    if not values or not math.isfinite(values[-1]):
        return None
    return float(values[-1])


def _discard(results: dict[int, Any]) -> None:
    for result in results.values():
        if getattr(result, "weights", None) is not None:
            result.weights.discard()


def drop_held(sweep: Schedule) -> None:
    """The sweep stops: the trials held to resume are stopped (told failed, so a resumed study runs them again)."""
    from optuna.trial import TrialState

    from nbddp.sweeps.result import line

    for run in list(sweep.resuming):
        sweep.resuming.remove(run)
        run.row.state = "stopped"
        tell(sweep, run.trial, state=TrialState.FAIL)
        resume.release(run)
        sweep.lines.append(line(run.row, sweep.metric))
        sweep.changed += 1
