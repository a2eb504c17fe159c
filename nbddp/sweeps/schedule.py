"""What a trial, its settling and its resume need of the sweep's schedule: a Protocol, so that they do not import
``scheduler.py``, which imports them (``SweepRun`` is the one implementation)."""

from __future__ import annotations

from typing import Any, Protocol

from nbddp.execution.contracts import SessionLike
from nbddp.execution.policy import FailurePolicy
from nbddp.fit.history import History
from nbddp.protocol.fit_options import FitConfig


class Schedule(Protocol):
    session: SessionLike
    study: Any  # Optuna's
    groups: list[list[int]]
    policy: FailurePolicy
    metric: str
    stopping: bool
    sampler_done: bool
    running: dict[int, Any]  # group index -> its TrialRun
    resuming: list[Any]  # TrialRuns held until the heal
    histories: dict[int, History]
    lines: list[str]
    changed: int

    def wake(self) -> None:
        """Look at the trials now (any thread)."""

    def send(self, g: int, run: Any, cfg: FitConfig) -> None:
        """A new attempt of the trial ``run`` on group ``g``."""

    def run_again(self, run: Any, attempt: int) -> None:
        """``run``'s parameters again, as a new trial."""

    def consider(self, run: Any, record: dict[str, Any], prune: bool = True) -> None:
        """A record of the trial, reported to Optuna."""

    def keep_if_best(self, value: float, parcel: Any, params: dict[str, Any]) -> None:
        """Keep the trial's weights when it is the best so far."""
