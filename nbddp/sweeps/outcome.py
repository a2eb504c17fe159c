"""How a finished trial is settled: its state told to Optuna, its History kept, its weights kept or let go.

A trial's tasks all returned (or raised) when this runs. The states:

* ``complete``: the fit ended on its own; the metric's last value is told
  to the study;
* ``pruned``: the pruner stopped it (the kernel signalled its engines);
* ``stopped``: the person stopped the sweep while it ran (told as failed,
  so a resumed study runs it again);
* ``failed``: a rank raised or died; the row keeps the rank and the remote
  traceback, and the sweep goes on.
"""

from __future__ import annotations

import math
from typing import Any

from nbddp.fit.history import History
from nbddp.jobs.rank_tasks import classify, is_consequence
from nbddp.sweeps import resume


def tell(sweep: Any, trial: Any, value: float | None = None, state: Any = None) -> None:
    """``study.tell``; a sampler that says the study is done (Optuna's ``GridSampler`` once its grid is run)
    calls ``study.stop()``, which outside ``study.optimize`` raises: here it ends the hand-out instead.
    The trial's state is stored either way (Optuna stores it in a ``finally``)."""
    try:
        sweep.study.tell(trial, value, state=state)
    except RuntimeError as exc:
        if "Study.stop" not in str(exc):
            raise
        sweep.sampler_done = True


def settle(sweep: Any, run: Any) -> None:
    """Settle ``run`` (a ``scheduler.Running``) for ``sweep`` (the ``SweepRun``)."""
    from optuna.trial import TrialState

    results, failure = _collect(sweep, run)
    row = run.row
    if failure is not None and sweep.stopping and failure.exc_type == "KeyboardInterrupt":
        # the stop's signal reached a rank before its trial had put up its own handler: stopped, not failed
        row.state = "stopped"
        _discard(results)
        tell(sweep, run.trial, state=TrialState.FAIL)
        return
    if failure is not None:
        row.state, row.rank, row.error = "failed", failure.rank, f"{failure.exc_type}: {failure.message}\n{failure.remote_traceback}"
        _discard(results)
        if run.stalled:
            row.error = run.stalled
        died = [r for r, ar in run.ars.items() if r not in results and _died(ar)]
        # killed stuck, or dead: the engines are replaced; only a death is worth another try
        retry = bool(died) and failure.exc_type == "WorkerDied" and not run.stalled
        if retry and resume.hold(sweep, run, died, failure):
            return  # RUNNING in the study: it resumes from its snapshot once the workers are healed
        tell(sweep, run.trial, state=TrialState.FAIL)
        if died:
            sweep.lost(run, died, retry=retry and sweep.snapshot_every is None)
        return
    head = results[sweep.groups[row.group][0]]
    history = History(world_size=len(results), batch_size=run.cfg.batch_size, restarts=run.restarts)
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


def _collect(sweep: Any, run: Any) -> tuple[dict[int, Any], Any]:
    """Every rank's result, and the first rank's own failure (a peer's consequence is never the headline)."""
    by_rank = {p.rank: p for p in sweep.session.placements}
    results, failures = {}, []
    for rank, ar in run.ars.items():
        try:
            results[rank] = ar.get(0)
        except BaseException as exc:  # noqa: BLE001 - recorded on the trial's row
            failures.append(classify(rank, exc, by_rank.get(rank))[0])
    if not failures:
        return results, None
    # the cause first: a rank's own error, then a death (a peer killed stuck after an own error is one too), and
    # last a peer's consequence: PeerFailed, or gloo's "Connection closed by peer" in a group of two whose other
    # rank died (that trial resumes or is retried, as a death)
    failures.sort(key=lambda f: (is_consequence(f), f.exc_type == "WorkerDied"))
    return results, failures[0]


def _died(ar: Any) -> bool:
    """The rank's engine is gone (it died, or was killed stuck in a collective)."""
    from ipyparallel.error import EngineError, RemoteError

    try:
        ar.get(0)
    except EngineError:
        return True
    except RemoteError as exc:
        return exc.ename == "EngineError"
    except BaseException:  # noqa: BLE001 - its own error: the engine lives
        return False
    return False


def _last_value(records: list[Any], metric: str) -> float | None:
    values = [r[metric] for _, kind, r in records if kind in ("epoch", "val") and metric in r]
    if not values or not math.isfinite(values[-1]):
        return None
    return float(values[-1])


def _discard(results: dict[int, Any]) -> None:
    for result in results.values():
        if getattr(result, "weights", None) is not None:
            result.weights.discard()


def drop_held(sweep: Any) -> None:
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
