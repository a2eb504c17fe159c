"""Which kernel drives a detached session, and a session taken over from (or by) another kernel.

A detached session (``nbddp/detached/``) is driven by one kernel at a time:
the one its record names. ``attach(take_over=True)`` moves it; the kernel it
left is then refused work (``check_owner``) and its ``stop()`` only lets go,
never ending the workers the other kernel now drives.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Protocol

from nbddp.cluster.engines import Workers
from nbddp.protocol.errors import ClusterError, SessionError
from nbddp.protocol.host import pid_alive
from nbddp.protocol.session_record import read as read_record
from nbddp.session.process_group import GroupState
from nbddp.session.start_options import StartOptions
from nbddp.shipping.shm_files import BufferPool


class Session(Protocol):
    """What this module reads and sets of ``nbddp.session.session.Session`` (which imports this module)."""

    record_path: str | None
    lock: threading.RLock
    workers: Workers | None
    group: GroupState | None
    options: StartOptions | None
    running: Any
    stopped_explicitly: bool
    token: str
    file_prefix: str
    send_pool: BufferPool
    started_wall: float
    supervisor: Any
    resident: Any
    debugger: Any

    @property
    def started(self) -> bool: ...

    @property
    def world_size(self) -> int: ...

    @property
    def backend(self) -> str: ...

    def forget_group_state(self, generation: int) -> None: ...


def check_owner(session: Session) -> None:
    """Raise ``SessionError`` naming the kernel a detached session was moved to (``attach(take_over=True)``)."""
    record = read_record(session.record_path) if session.record_path else None
    if record is not None and record.kernel_pid not in (0, os.getpid()) and pid_alive(record.kernel_pid):
        raise SessionError(f"session {record.id} was moved to the kernel with pid {record.kernel_pid} "
                           "(attach(take_over=True)): drive it from there, or take it back here with "
                           f"nbddp.attach({record.id!r}, take_over=True)")


def let_go_if_moved(session: Session) -> bool:
    """If another kernel drives the session now, forget its workers without touching them; whether it did."""
    try:
        check_owner(session)
        return False
    except SessionError:
        pass
    with session.lock:
        if session.workers is not None:
            try:
                session.workers.client.close()
            except Exception:  # noqa: BLE001 - already closed
                pass
        session.workers, session.group, session.running, session.record_path = None, None, None, None
        session.stopped_explicitly = True
    return True


def take_over(session: Session, workers: Workers, group: GroupState, options: StartOptions, token: str,
              file_prefix: str, resident: list[str], started: float, busy: bool = False) -> None:
    """Use the workers of a detached session as they are (``nbddp.attach``): no probe, no new group.

    The ranks keep their group, their datasets, kept models and ``%%ddp``
    names; this kernel learns them instead of making them anew. ``busy``: a
    fit still runs on the ranks, so nothing is sent to them now (a task would
    wait behind the fit): the debugger's address is told them when it ends.

    Raises:
        ClusterError: this kernel runs workers of its own already.
    """
    with session.lock:
        if session.started:
            raise ClusterError(f"this kernel already has workers ({session.world_size} x {session.backend}); "
                               "call nbddp.stop() before attaching to a detached session")
        session.token, session.file_prefix = token, file_prefix
        session.send_pool.close()
        session.send_pool = BufferPool(prefix=f"{file_prefix}-k")
        session.workers, session.group, session.options = workers, group, options
        session.forget_group_state(group.generation)
        session.started_wall, session.stopped_explicitly = started, False
        session.supervisor.closing = False
        session.resident.mark(resident)
        if not busy:
            session.debugger.announce(workers.client, list(group.placements), workers.controller_host)
