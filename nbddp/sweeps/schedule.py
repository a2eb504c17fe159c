"""What a trial's settling and its resume need of the sweep's schedule: a Protocol, so that they do not import
``scheduler.py``, which imports them (``SweepRun`` is the one implementation). A trial itself needs less of it
(``trial_run.Trials``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from nbddp.execution.contracts import SessionLike
from nbddp.execution.policy import FailurePolicy
from nbddp.fit.history import History
from nbddp.protocol.fit_options import FitConfig
from nbddp.shipping.pickling import Parcel
from nbddp.sweeps.trial_run import TrialRun

if TYPE_CHECKING:
    import optuna


class Schedule(Protocol):
    study: optuna.Study
    groups: list[list[int]]
    policy: FailurePolicy
    metric: str
    stopping: bool
    sampler_done: bool
    running: dict[int, TrialRun]  # group index -> its trial
    resuming: list[TrialRun]  # trials held until the heal
    histories: dict[int, History]
    lines: list[str]
    changed: int

    @property
    def session(self) -> SessionLike: ...

    def wake(self) -> None:
        """Look at the trials now (any thread)."""

    def send(self, g: int, run: TrialRun, cfg: FitConfig) -> None:
        """A new attempt of the trial ``run`` on group ``g``."""

    def run_again(self, run: TrialRun, attempt: int) -> None:
        """``run``'s parameters again, as a new trial."""

    def consider(self, run: TrialRun, record: dict[str, Any], prune: bool = True) -> None:
        """A record of the trial, reported to Optuna."""

    def keep_if_best(self, value: float, parcel: Parcel | None, params: dict[str, Any]) -> None:
        """Keep the trial's weights when it is the best so far."""
