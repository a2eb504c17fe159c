"""``nbddp.sweep``: every check first, the groups opened, the schedule waited for, the result built.

Order of a call: the sweep's own arguments and ``space`` are checked against
the running workers, then ``fit.preflight.prepare`` checks and ships the
``dist_fit`` arguments once (the same parcel serves every trial); one task
on every rank opens the trial groups (``worker/tasks/sweep.open_groups``);
the schedule runs in its thread (``scheduler.SweepRun``) while this cell
waits, printing a leaderboard line per finished trial; the groups are
closed on every rank whatever happened, and the best weights come back.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Literal

from nbddp.execution.work import is_interrupt
from nbddp.session.session import get_session
from nbddp.sweeps import resume
from nbddp.sweeps import space as spaces
from nbddp.sweeps.groups import close_trial_groups, open_trial_groups
from nbddp.sweeps.result import SweepResult
from nbddp.sweeps.scheduler import SweepRun
from nbddp.sweeps.view import SweepView
from nbddp.execution.policy import FailurePolicy
from nbddp.protocol.data_forms import DataLike
from nbddp.sweeps.space import Space, SpaceSpec, SweepModel
from nbddp.live.choice import LiveChoice, live_choice

if TYPE_CHECKING:
    import optuna
    from optuna.pruners import BasePruner
    from optuna.samplers import BaseSampler

    from nbddp.fit.preflight import FitPlan
    from nbddp.session.session import Session
    from nbddp.sweeps.handle import SweepHandle


def optuna_module() -> Any:
    try:
        import optuna
    except ImportError:
        raise ImportError('nbddp.sweep samples and prunes trials with Optuna, which is not installed here: '
                          'pip install "nbddp[sweep]" (or pip install optuna)') from None
    return optuna


def make_study(study: optuna.Study | None, mode: str, sampler: BaseSampler | None,
               pruner: BasePruner | None) -> optuna.Study:
    """The person's study (with ``sampler``/``pruner`` put on it when given), or a new one in memory."""
    optuna = optuna_module()
    if study is None:
        return optuna.create_study(direction=spaces.MODES[mode], sampler=sampler, pruner=pruner)
    if not isinstance(study, optuna.Study):
        raise TypeError(f"nbddp.sweep(study=...) must be an optuna.Study, got {type(study).__name__}")
    if study.direction.name.lower() != spaces.MODES[mode]:
        raise ValueError(f"nbddp.sweep(mode={mode!r}) disagrees with the study, which is created to "
                         f"{study.direction.name.lower()}; pass mode={'min' if mode == 'max' else 'max'!r}")
    if sampler is not None:
        study.sampler = sampler
    if pruner is not None:
        study.pruner = pruner
    return study


def trials_left(study: optuna.Study, n_trials: int) -> int:
    """``n_trials`` is the study's total: the trials it completed or pruned before (a resumed sweep) count."""
    from optuna.trial import TrialState

    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
    return max(0, n_trials - len(done))


def run_sweep(model: SweepModel, data: DataLike, *, space: SpaceSpec, n_trials: int, metric: str, mode: str,
              workers_per_trial: int, sampler: BaseSampler | None, pruner: BasePruner | None,
              study: optuna.Study | None, live: LiveChoice | Literal["html"], block: bool,
              fit_kwargs: dict[str, Any]) -> SweepResult | SweepHandle:
    """See ``nbddp.sweep``: a ``SweepResult``, or with ``block=False`` a ``SweepHandle``."""
    optuna = optuna_module()
    if not isinstance(block, bool):
        raise TypeError(f"nbddp.sweep(block=...) must be True or False, got {block!r}")
    verbosity = optuna.logging.get_verbosity()
    if verbosity == optuna.logging.INFO:  # Optuna's default: a line per trial, which the leaderboard says better
        optuna.logging.set_verbosity(optuna.logging.WARNING)
    handed_on = False
    try:
        out = _sweep(model, data, space, n_trials, metric, mode, workers_per_trial, sampler, pruner, study, live,
                     fit_kwargs, block, lambda: optuna.logging.set_verbosity(verbosity))
        handed_on = not block  # a SweepHandle: its thread restores Optuna's verbosity when the sweep ends
        return out
    finally:
        if not handed_on:
            optuna.logging.set_verbosity(verbosity)


def _sweep(model: SweepModel, data: DataLike, space: SpaceSpec, n_trials: int, metric: str, mode: str,
           workers_per_trial: int, sampler: BaseSampler | None, pruner: BasePruner | None, study: optuna.Study | None,
           live: LiveChoice | Literal["html"], fit_kwargs: dict[str, Any], block: bool,
           restore: Callable[[], None]) -> SweepResult | SweepHandle:
    from nbddp.session.start_options import check_stall_timeout
    from nbddp.sweeps.handle import SweepHandle

    s = get_session()
    s.ensure_started()
    stall_timeout = check_stall_timeout(fit_kwargs.pop("stall_timeout", None), "sweep")
    if stall_timeout is None and s.options is not None:
        stall_timeout = s.options.stall_timeout
    spaces.check_run(n_trials, mode, workers_per_trial, s.world_size)
    live = live_choice(live, "nbddp.sweep", stacklevel=6)  # deprecated, live_choice, _sweep, run_sweep, sweep
    spaces.check_strategy(fit_kwargs, workers_per_trial)
    max_restarts, snapshot_every = spaces.pop_restarts(fit_kwargs)
    sweep_space = spaces.build_space(space, model, fit_kwargs.get("step_fn"), fit_kwargs)
    spaces.check_metric(metric, fit_kwargs.get("val_data"), fit_kwargs.get("metrics"), fit_kwargs.get("step_fn"))
    study = make_study(study, mode, sampler, pruner)
    _settle_stale(study)
    left = trials_left(study, n_trials)
    if left == 0:
        result = SweepResult(rows=[], metric=metric, mode=mode, study=study)
        return result if block else SweepHandle(None, lambda: _restored(restore, result))
    groups = [list(range(i, i + workers_per_trial)) for i in range(0, s.world_size, workers_per_trial)]
    policy = FailurePolicy(max_restarts, snapshot_every, stall_timeout=stall_timeout, retry_stalls=False)
    run = _open(s, model, data, sweep_space, study, left, groups, metric, mode, fit_kwargs, policy)
    view = SweepView(live, stop=run.request_stop)
    try:
        with s.lock:
            s.running = run
            run.thread.start()
    except BaseException:
        _close(s, run)
        raise
    if not block:
        return SweepHandle(run, lambda: _finish(s, run, view, model, restore))
    try:
        _wait(run, view)
    finally:
        view.close()
        _close(s, run)
    if run.error is not None:
        raise run.error
    return _result(run, model)


def _restored(restore: Callable[[], None], result: SweepResult) -> SweepResult:
    """A sweep with nothing left to run, in a handle's thread: Optuna's verbosity put back, then the result."""
    restore()
    return result


def _finish(s: Session, run: SweepRun, view: SweepView, model: SweepModel, restore: Callable[[], None]) -> SweepResult:
    """A ``block=False`` sweep's waiting, in the handle's thread: the view drawn, then what a blocking call does."""
    try:
        while not run.wait_done(0.1):
            view.tick(run)
        view.tick(run, final=True)
    finally:
        view.close()
        _close(s, run)
        restore()
    if run.error is not None:
        raise run.error
    return _result(run, model)


def _settle_stale(study: optuna.Study) -> None:
    """Trials a dead kernel left RUNNING: failed through Optuna's heartbeat (and retried by its callback), or,
    without a heartbeat, named in a warning that says how to set one up (``sweeps/stale.py``)."""
    from nbddp.protocol.notices import logger, notify
    from nbddp.sweeps import stale

    failed = stale.fail_stale(study)
    if failed:
        logger.warning("nbddp.sweep: trial(s) %s of study %r were left RUNNING by a process that stopped (no heartbeat "
                       "for the storage's grace period): marked failed, and handed to the storage's "
                       "heartbeat_stale_trial_callback (RetryHeartbeatStaleTrialCallback runs their parameters again)",
                       failed, study.study_name)
    message = stale.stale_warning(study)
    if message is not None:
        notify(message, stacklevel=5)  # notify, _settle_stale, _sweep, run_sweep, sweep: the cell


def _open(s: Session, model: SweepModel, data: DataLike, sweep_space: Space, study: optuna.Study, left: int,
          groups: list[list[int]],
          metric: str, mode: str, fit_kwargs: dict[str, Any], policy: FailurePolicy) -> SweepRun:
    """Check and ship the fit's arguments once, open the groups on every rank: the schedule, ready to start."""
    from nbddp.fit.preflight import prepare

    def ship() -> FitPlan:  # again after a worker was replaced: the new one holds no resident data
        # a trial trains on its group: a model-parallel mesh and the data shards are laid out for that many ranks
        plan = prepare(s, model, data, return_weights=True, world=len(groups[0]), **fit_kwargs)
        plan.launch = replace(plan.launch, returns="state_dict")
        return plan

    with s.lock:
        s.ensure_ready()
        plan = ship()
    try:
        token = open_trial_groups(s, groups)
    except BaseException:
        plan.discard()
        raise
    run = SweepRun(s, plan, sweep_space, study, left, groups, metric, token, mode, policy)
    run.reship = ship
    return run


def _wait(run: SweepRun, view: SweepView) -> None:
    """Wait in the cell, drawing the live view; the first interrupt stops, the second kills."""
    interrupts = 0
    while True:
        try:
            while not run.wait_done(0.1):
                view.tick(run)
            view.tick(run, final=True)
            return
        except BaseException as exc:
            if not is_interrupt(exc):
                raise
            interrupts += 1
            if interrupts == 1:
                run.request_stop()
            else:
                run.hard_stop()


def _close(s: Session, run: SweepRun) -> None:
    """Every rank destroys the sweep's groups; the files shipped go; the workers are free again."""
    try:
        close_trial_groups(s, run.token)
    finally:
        for trial in [*run.resuming, *run.running.values()]:  # held, or cut short by an error: snapshots go
            resume.release(trial)
        run.plan.discard()
        run.release_workers()
    if any(r.state == "complete" for r in run.rows):
        s.resident.mark(run.plan.data_keys)


def _result(run: SweepRun, model: SweepModel) -> SweepResult:
    """The rows, histories and study; the best weights into ``model``, or a module the factory builds."""
    import torch

    best_model = None
    if run.best is not None:
        _, state, params = run.best
        _, bind = run.space.split(params)
        best_model = model if isinstance(model, torch.nn.Module) else model(**bind["model"])
        best_model.load_state_dict(state)
    status = "interrupted" if run.stopping or any(r.state == "stopped" for r in run.rows) else "completed"
    return SweepResult(rows=run.rows, metric=run.metric, mode=run.mode, study=run.study, histories=run.histories,
                       best_model=best_model, status=status)
