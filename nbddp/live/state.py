"""What a view shows of a running fit: the state the kernel's watcher keeps up to date.

Plain data, written by the watcher thread (``nbddp.fit.fit_run.FitRun``) and read by
the views; a field is replaced whole, never mutated in place, so a view
drawing from another moment sees one consistent value per field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class LiveState:
    status: str = "starting"  # starting, training, validating, stopping, completed, interrupted, failed
    world_size: int = 0
    backend: str = ""
    epochs: int = 0
    placements: list[Any] = field(default_factory=list)  # messages.RankInfo, in rank order
    plan: Any = None  # messages.FitPlanInfo once the workers sent it
    ranks: list[dict[str, Any]] = field(default_factory=list)  # each rank's latest figures
    restarts: list[str] = field(default_factory=list)  # "rank 1 lost at step 12 (...); replaced in 2.1 s; ..."
    missed: int = 0  # records the stream skipped (the final result fills them in)
    stalled: list[dict[str, Any]] = field(default_factory=list)  # ranks that stopped advancing, with their stacks
    # every rank's latest heartbeat: {rank, phase, step, micro, idle_s} (stalls.StallWatch.positions)
    positions: list[dict[str, Any]] = field(default_factory=list)
    paused: list[dict[str, Any]] = field(default_factory=list)  # ranks at a debugger prompt: {rank, where, function}

    @property
    def total_steps(self) -> int:
        """0 until the workers said, and for a stream without ``max_steps`` (its length shows at its end)."""
        return (self.plan.total_steps or 0) if self.plan is not None else 0

    @property
    def start_step(self) -> int:
        return self.plan.start_step if self.plan is not None else 0
