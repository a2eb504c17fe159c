"""What the packages below the session need of it: small Protocols instead of reaching into its parts.

The session (``nbddp/session/session.py``) satisfies them; tests pass fakes
that do (``tests/test_execution.py``), so the decisions here are tested
without engines. The engines themselves are ``cluster/engines.py``'s
``Workers``, which these packages may import; the session, its supervisor
and its options they may not (``session/`` imports them).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from nbddp.protocol.errors import ClusterError, SlurmError
from nbddp.protocol.placement import Placement

if TYPE_CHECKING:
    from ipyparallel import Client

    from nbddp.cluster.engines import Workers
    from nbddp.cluster.slurm.queue import JobState
    from nbddp.cluster.slurm.request import SlurmRequest


class WorkLike(Protocol):
    """The work that holds the workers (``execution/work.py``'s ``Work``, which imports this module)."""

    @property
    def finished(self) -> bool: ...

    def describe(self) -> str: ...


class GroupLike(Protocol):
    """The current process group: who holds which rank."""

    @property
    def placements(self) -> Sequence[Placement]: ...

    def by_rank(self) -> dict[int, Placement]: ...


class SpareLike(Protocol):
    """An elastic fit's warm spare engine (``elastic/spare.py``'s ``Spare``), which a heal takes as a replacement."""

    def take(self) -> int | None: ...

    def wait(self, timeout: float = ...) -> None: ...

    def ensure(self) -> None: ...


class SupervisorLike(Protocol):
    """The one owner of killing and replacing ranks (``nbddp/session/supervisor.py``).

    ``closing``: the session is stopping (nothing is started); ``spare``: the warm spare engine, once an
    elastic fit asked for one; ``await_engines_s``: how long a heal waits for an engine it cannot start
    (``elastic/replacements.py``); ``regrow_to``: the size the next call's heal brings the workers back to.
    """

    closing: bool
    spare: SpareLike | None
    await_engines_s: float
    regrow_to: int | None

    def kill_ranks(self, ranks: list[int]) -> list[int]: ...

    def replace_ranks(self, ranks: list[int]) -> None: ...

    def recover(self, killed: list[int], job_wait: dict[str, Any] | None = None) -> None: ...

    def controller_lost(self, problem: str, what: str) -> ClusterError: ...

    def job_lost(self, job: JobState, what: str | None = None) -> SlurmError: ...


class DebuggerLike(Protocol):
    """Ranks paused at a debugger prompt: no stall is counted while one is."""

    def paused(self) -> list[dict[str, Any]]: ...

    def let_go(self, work: WorkLike, reason: str) -> None: ...


class OptionsLike(Protocol):
    """What ``start()`` was asked for (``session/start_options.py``'s ``StartOptions``)."""

    @property
    def timeout(self) -> float: ...

    @property
    def slurm(self) -> SlurmRequest | None: ...


class SessionLike(Protocol):
    """The session, as the packages below it see it (``execution/``, ``elastic/``, ``debugging/``, ``profiling/``)."""

    @property
    def client(self) -> Client: ...

    @property
    def workers(self) -> Workers | None: ...

    @property
    def options(self) -> OptionsLike | None: ...

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
    def generation(self) -> int: ...

    @property
    def token(self) -> str: ...

    @property
    def lock(self) -> threading.RLock: ...

    running: Any

    def attend(self, work: WorkLike) -> None: ...

    def ensure_started(self) -> None: ...

    def ensure_ready(self) -> None: ...

    def follow_kernel_paths(self) -> None: ...

    def wait_healed(self, raise_error: bool = True) -> None: ...

    def form_group(self, reprobe: bool, engines: list[int] | None = None) -> None: ...

