"""The one per-process state of a worker (engine).

An engine outlives many fits, so what must persist between calls (the
process group's generation, this rank's placement, datasets kept resident,
the namespace of ``%%ddp`` cells, the stop flag) lives in one object,
``STATE``, instead of scattered module globals.
"""

from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator


@dataclass
class WorkerState:
    placement: Any = None  # nbddp.protocol.placement.Placement of this rank
    backend: str = ""
    generation: int = -1  # process-group generation this engine joined
    stop_requested: bool = False
    busy: bool = False
    namespace: dict[str, Any] = field(default_factory=dict)  # %%ddp cells' names
    dataset_cache: dict[str, Any] = field(default_factory=dict)
    watchdog: threading.Thread | None = None
    file_prefix: str = ""  # names of this worker's shared-memory files (set by the kernel's session)
    session_prefix: str = ""  # the session's, which this worker's extends with -w<rank>
    master: tuple[str, int] = ("127.0.0.1", 0)  # MASTER_ADDR/MASTER_PORT of the current generation
    stack_file: Any = None  # the open file SIGUSR1 writes every thread's stack to (heartbeat.py)
    # the kernel's debugger: host, port, token (worker/debugging/rank_pdb.py)
    debug_address: tuple[str, int, str] | None = None
    debugger: Any = None  # the nbddp.worker.debugging.rank_pdb.RankPdb holding this rank now
    failure: Any = None  # the nbddp.worker.debugging.postmortem.Failure kept for %ddp debug
    mesh_groups: dict[tuple[int, ...], Any] = field(default_factory=dict)  # this generation's mesh groups (device_mesh.py)
    kept_by: dict[str, Any] = field(default_factory=dict)  # keep= name -> worker.inference.kept.KeptFit
    fit_id: str = ""  # the fit running now (FitLaunch.fit_id): rank 0's journal names it
    fit_results: dict[str, Any] = field(default_factory=dict)  # a detached session's last fit: its id -> this rank's
    # FitResult (or the error), kept until a kernel takes it (worker/training/journal.py)


STATE = WorkerState()


@contextmanager
def stop_on_sigint() -> Iterator[WorkerState]:
    """While a task runs, SIGINT sets ``STATE.stop_requested`` instead of raising.

    A rank must never leave mid-collective, so the kernel's stop request (a
    SIGINT relayed by the engine's nanny) becomes a flag that the ranks agree
    on at the next synchronisation point. Engine tasks run in the main
    thread, so installing a handler here is allowed.

    The kernel signals every rank at once, but each signal travels on its own
    (controller, then that engine's nanny): once the first rank's flag has
    stopped the group, another rank's signal may land after it left the loop,
    while it packs the weights or notes modules. So on leaving, the handler
    stays a flag instead of going back to ``KeyboardInterrupt``. The engine
    puts back its idle handler (which ignores SIGINT) when the task returns,
    and installs ``KeyboardInterrupt`` again for the next task. Measured in
    CI: a late signal raised ``KeyboardInterrupt`` in rank 0 after a stop.
    """
    STATE.stop_requested = False

    def _handler(signum: int, frame: Any) -> None:
        STATE.stop_requested = True

    signal.signal(signal.SIGINT, _handler)
    STATE.busy = True
    try:
        yield STATE
    finally:
        STATE.busy = False


@contextmanager
def exit_on_sigterm() -> Iterator[None]:
    """While a task runs, SIGTERM ends this engine at once (exit status 143).

    The engine's own SIGTERM handler stops its event loop, which a running
    task blocks: the engine would live on until the task ended or SIGKILL
    came. Slurm cancelling a job (``scancel``, the time limit) sends SIGTERM
    and waits ``KillWait`` (30 s by default) before SIGKILL, and until then
    the job only says ``COMPLETING``; a task cannot finish once its job is
    going, so leaving now lets the kernel learn the job's final state within
    seconds. Only in the main thread (where engine tasks run).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(128 + signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def check_generation(generation: int | None) -> None:
    """Refuse a task sent for another process-group generation than the one this engine joined."""
    if generation is not None and generation != STATE.generation:
        raise RuntimeError(
            f"this engine joined process-group generation {STATE.generation}, the kernel expected {generation}; "
            "run nbddp.restart() to rebuild the workers"
        )
