"""What the execution package needs of the session: small Protocols instead of reaching into its parts.

The session (``nbddp/session/session.py``) satisfies them; tests pass fakes
that do (``tests/test_execution.py``), so the decisions here are tested
without engines.
"""

from __future__ import annotations

from typing import Any, Protocol

from nbddp.protocol.placement import Placement


class GroupLike(Protocol):
    """The current process group: who holds which rank."""

    @property
    def placements(self) -> Any: ...

    def by_rank(self) -> dict[int, Placement]: ...


class WorkersLike(Protocol):
    """The engines: how one died, whether more can start, signals, the controller and a Slurm job."""

    @property
    def can_add_engines(self) -> bool: ...

    def how_died(self, pid: int | None) -> tuple[str, str]: ...

    def signal(self, engine_ids: list[int], signum: int) -> Any: ...

    def controller_problem(self) -> str | None: ...

    def job_problem(self) -> Any: ...


class SupervisorLike(Protocol):
    """The one owner of killing and replacing ranks (``nbddp/session/supervisor.py``)."""

    def kill_ranks(self, ranks: list[int]) -> list[int]: ...

    def replace_ranks(self, ranks: list[int]) -> None: ...

    def recover(self, killed: list[int], job_wait: dict[str, Any] | None = None) -> None: ...

    def controller_lost(self, problem: str, what: str) -> BaseException: ...

    def job_lost(self, job: Any, what: str | None = None) -> BaseException: ...


class DebuggerLike(Protocol):
    """Ranks paused at a debugger prompt: no stall is counted while one is."""

    def paused(self) -> list[dict[str, Any]]: ...

    def let_go(self, work: Any, reason: str) -> None: ...


class SessionLike(Protocol):
    """The session, as the execution package sees it."""

    @property
    def client(self) -> Any: ...

    @property
    def workers(self) -> WorkersLike | None: ...

    @property
    def group(self) -> GroupLike | None: ...

    @property
    def supervisor(self) -> SupervisorLike: ...

    @property
    def debugger(self) -> DebuggerLike: ...

    @property
    def placements(self) -> list[Placement]: ...

    @property
    def world_size(self) -> int: ...

    @property
    def file_prefix(self) -> str: ...

    @property
    def lock(self) -> Any: ...

    running: Any

    def attend(self, work: Any) -> None: ...

    def ensure_started(self) -> None: ...

    def ensure_ready(self) -> None: ...

    def follow_kernel_paths(self) -> None: ...

