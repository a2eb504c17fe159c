"""What a view shows of a running fit: the state the kernel's watcher keeps up to date.

Plain data, written by the watcher thread (``nbddp.fit.fit_run.FitRun``) and read by
the views; a field is replaced whole, never mutated in place, so a view
drawing from another moment sees one consistent value per field. ``ViewedFit``
is what a view reads of the fit besides (its records, its end).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from nbddp.protocol.messages import FitPlanInfo, RankInfo

if TYPE_CHECKING:
    from nbddp.profiling.requests import ProfileRequests


@dataclass
class LiveState:
    status: str = "starting"  # starting, training, validating, stopping, completed, interrupted, failed
    world_size: int = 0
    backend: str = ""
    epochs: int = 0
    placements: list[RankInfo] = field(default_factory=list)  # in rank order
    plan: FitPlanInfo | None = None  # once the workers sent it
    ranks: list[dict[str, Any]] = field(default_factory=list)  # each rank's latest figures
    restarts: list[str] = field(default_factory=list)  # "rank 1 lost at step 12 (...); replaced in 2.1 s; ..."
    missed: int = 0  # records the stream skipped (the final result fills them in)
    stalled: list[dict[str, Any]] = field(default_factory=list)  # ranks that stopped advancing, with their stacks
    # every rank's latest heartbeat: {rank, phase, step, micro, idle_s} (stalls.StallWatch.positions)
    positions: list[dict[str, Any]] = field(default_factory=list)
    paused: list[dict[str, Any]] = field(default_factory=list)  # ranks at a debugger prompt: {rank, where, function}
    batch_size: int = 0  # per data-parallel rank (0: not known)
    kind: str = "fit"  # "fit": dist_fit's records; "report": nbddp.report's (any metrics, no epochs or total)
    global_batch: int = 0  # one optimizer step over every data-parallel rank: batch_size x those ranks x grad_accum

    def batch_text(self) -> str:
        """``batch 16/rank, 64 global`` ("" when not known), beside the world in the views' headers."""
        return f"batch {self.batch_size}/rank, {self.global_batch} global" if self.batch_size else ""

    @property
    def total_steps(self) -> int:
        """0 until the workers said, and for a stream without ``max_steps`` (its length shows at its end)."""
        return (self.plan.total_steps or 0) if self.plan is not None else 0

    @property
    def start_step(self) -> int:
        return self.plan.start_step if self.plan is not None else 0


class FitRecords(Protocol):
    """The records a view draws: ``fit.history.History`` (``fit/`` imports ``live/``, so it is named by its parts)."""

    @property
    def steps(self) -> list[dict[str, Any]]: ...

    @property
    def epochs(self) -> list[dict[str, Any]]: ...

    @property
    def validations(self) -> list[dict[str, Any]]: ...

    @property
    def ranks(self) -> list[dict[str, Any]]: ...

    @property
    def timings(self) -> dict[str, float]: ...


class ViewedFit(Protocol):
    """A fit as its view reads it and its buttons act on it: ``fit.fit_run.FitRun``."""

    @property
    def live_state(self) -> LiveState: ...

    @property
    def history(self) -> FitRecords: ...

    @property
    def finished(self) -> bool: ...

    @property
    def error(self) -> BaseException | None: ...

    @property
    def started_at(self) -> float: ...

    @property
    def requests(self) -> ProfileRequests: ...  # the Profile button's handle.profile

    def request_stop(self, reason: str | None = None) -> None: ...
