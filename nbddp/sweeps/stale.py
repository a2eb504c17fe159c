"""Trials a dead kernel left RUNNING in a stored study, and the heartbeats that let a later sweep tell.

A sweep that dies with its kernel (a restart, ``kill -9``, the machine going
down) cannot tell the study that its running trials ended: they stay
``RUNNING`` in the storage. Optuna's own answer is the heartbeat of
``RDBStorage(url, heartbeat_interval=..., grace_period=...,
heartbeat_stale_trial_callback=...)``: whoever runs a trial records a
heartbeat for it now and then, and ``optuna.storages.fail_stale_trials``
marks a ``RUNNING`` trial whose heartbeat is older than the grace period as
failed, then calls the storage's callback (``RetryHeartbeatStaleTrialCallback``
queues the same parameters again). ``study.optimize`` does both; a sweep
asks and tells trials itself, so it does them here: ``fail_stale`` when the
sweep starts (and once per heartbeat interval while it runs, for a study that
other processes share), ``Heartbeats.beat`` for the trials it runs.

A storage without a heartbeat cannot tell a dead trial from one another
process is running; the sweep leaves those rows alone and says how to set
the heartbeat up (``stale_warning``).
"""

from __future__ import annotations

import time
import warnings
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import optuna
    from optuna.distributions import BaseDistribution
    from optuna.storages._heartbeat import BaseHeartbeat

SETUP_HINT = ("create the study's storage with a heartbeat, e.g. optuna.storages.RDBStorage('sqlite:///sweep.db', "
              "heartbeat_interval=60, grace_period=120, heartbeat_stale_trial_callback="
              "optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=1)), so that a later sweep fails such trials "
              "and runs their parameters again")


def heartbeat_storage(study: optuna.Study) -> BaseHeartbeat | None:
    """The study's storage when it records heartbeats, else None (in memory, journal, plain URL)."""
    from optuna.storages._heartbeat import BaseHeartbeat  # Optuna's own test of the same thing (fail_stale_trials)

    storage = study._storage  # noqa: SLF001 - Optuna exposes a study's storage only here
    return storage if isinstance(storage, BaseHeartbeat) else None


def interval(study: optuna.Study) -> float | None:
    """The storage's heartbeat interval in seconds, or None when it has no heartbeat (in memory, journal, plain URL)."""
    storage = heartbeat_storage(study)
    return storage.get_heartbeat_interval() if storage is not None else None


def fail_stale(study: optuna.Study) -> list[int]:
    """Fail the study's trials whose heartbeat stopped (Optuna's ``fail_stale_trials``); their numbers, for the
    person. The storage's ``heartbeat_stale_trial_callback`` runs for each (a retry queues its parameters again)."""
    from optuna.exceptions import ExperimentalWarning
    from optuna.storages import fail_stale_trials
    from optuna.trial import TrialState

    if interval(study) is None:
        return []
    before = {t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExperimentalWarning)  # experimental since Optuna 2.9, and study.optimize's own
        fail_stale_trials(study)
    still = {t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))}
    return sorted(before - still)


def stale_warning(study: optuna.Study) -> str | None:
    """A message when a stored study without a heartbeat holds RUNNING trials (perhaps left by a dead kernel)."""
    from optuna.storages import InMemoryStorage
    from optuna.trial import TrialState

    if interval(study) is not None or isinstance(study._storage, InMemoryStorage):  # noqa: SLF001
        return None
    running = [t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))]
    if not running:
        return None
    return (f"nbddp.sweep: the study {study.study_name!r} holds {len(running)} trial(s) still RUNNING ({running}); "
            "if a kernel that died left them, they stay RUNNING and their parameters are not run again, because this "
            f"storage has no heartbeat to tell a dead trial from a live one. To have them failed and retried, {SETUP_HINT}")


def ask(study: optuna.Study, distributions: dict[str, BaseDistribution]) -> optuna.trial.Trial:
    """``study.ask``, without Optuna's warning that a heartbeat storage "is supposed to be used with Study.optimize":
    the sweep records the heartbeats itself (``Heartbeats``), which is what that warning is about."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")
        return study.ask(distributions)


class Heartbeats:
    """Records a heartbeat for each trial the sweep runs, at most once per the storage's interval."""

    def __init__(self, study: optuna.Study):
        self.study = study
        self.storage = heartbeat_storage(study)
        self.every = interval(study)
        self.last = 0.0

    def start(self, trial: optuna.trial.Trial) -> None:
        """A trial was just asked: its first heartbeat (a trial with none is never found stale)."""
        if self.every is not None and self.storage is not None:  # (an interval: a heartbeat storage)
            self.storage.record_heartbeat(trial._trial_id)  # noqa: SLF001 - what study.optimize's thread does

    def beat(self, trials: list[optuna.trial.Trial]) -> None:
        """Called every tick: once an interval has passed, every running trial's heartbeat, and other processes'
        stale trials failed (what ``study.optimize`` does before each trial)."""
        if self.every is None or self.storage is None or time.monotonic() - self.last < self.every:
            return
        self.last = time.monotonic()
        for trial in trials:
            self.storage.record_heartbeat(trial._trial_id)  # noqa: SLF001
        fail_stale(self.study)
