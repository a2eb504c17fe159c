"""What a relaunch needs of the work it relaunches, and what a lost job or a smaller group records in.

``recovery.py``'s ``Recovery`` drives a restart; ``fewer_ranks.py`` (going
on with the ranks left) and ``job_loss.py`` (a new Slurm job) carry out two
kinds of it, and ``recovery.py`` imports them: so the fit they relaunch
(``Relaunchable``: ``nbddp/fit/fit_run.py``'s ``FitRun``) and the ledger they
record in (``RestartLedger``: ``Recovery`` itself) are Protocols here, which
all three import.
"""

from __future__ import annotations

from typing import Any, Protocol

from nbddp.execution.contracts import SessionLike
from nbddp.execution.policy import FailurePolicy
from nbddp.protocol.fit_options import FitConfig

Records = list[tuple[str, dict[str, Any]]]


class Relaunchable(Protocol):
    """What ``Recovery`` needs of a fit it relaunches (``nbddp/fit/fit_run.py``'s ``FitRun``)."""

    policy: FailurePolicy
    started_at: float

    @property
    def session(self) -> SessionLike:
        """The session it runs on (read-only here, so that a fit may hold the whole ``Session``)."""

    @property
    def stopping(self) -> bool:
        """A stop was asked (Kernel > Interrupt, ``handle.stop()``): nothing is relaunched."""

    @property
    def config(self) -> FitConfig:
        """The fit's configuration, as the next launch sends it."""

    def reconfigure(self, cfg: FitConfig, world_size: int) -> None:
        """The next launch sends ``cfg`` to ``world_size`` ranks (going on with fewer: ``fewer_ranks.py``)."""

    def steps_reached(self) -> list[int]:
        """The steps the ranks were last seen at, and the last recorded one."""

    def show_restart(self, line: str, replace_last: bool = False, status: str | None = None) -> None:
        """The live view's restart line (a new one, or the last one replaced), drawn now."""

    def records(self) -> Records:
        """Every record the kernel has of this fit, as ``(kind, record)``."""

    def keep_records(self, records: Records) -> None:
        """The fit's History from now on holds ``records`` (and the relaunch's)."""

    def relaunch(self, resume: bool | str | None = None) -> None:
        """The same work again on the healed group (``resume``: a checkpoint chosen instead of the snapshot)."""


class RestartLedger(Protocol):
    """The restarts of one piece of work (``recovery.py``'s ``Recovery``), as a lost job or a smaller group
    records them: the policy that allows them, a new event, and its relaunch."""

    policy: FailurePolicy

    def lost(self, rank: int | None, cause: str, step_lost_at: int, **more: Any) -> dict[str, Any]: ...

    def relaunched(self, event: dict[str, Any], noticed: float) -> None: ...
