"""A detached session's end: the reaper waits here while no kernel is attached, until ``keep_alive`` passes idle.

When the kernel that started a detached session dies (or exits), the
reaper (``nbddp/cluster/reaper.py``) does not end the workers. It watches
the session record instead (``nbddp/protocol/session_record.py``): while a
kernel is attached (the record names its live pid) or a fit runs on the
ranks (rank 0's fit note says "running"), the session is in use. Once it
has been unused for the record's ``keep_alive_s``, the reaper ends it as the
kernel's death would have: every process, the Slurm job, the /dev/shm files,
and the record itself. A Slurm job that ended by itself (its time limit,
``scancel``) ends the session at once: its workers are gone with it.

While no kernel is attached and an elastic fit (``max_restarts``) runs, the
reaper also keeps a caretaker running (``Caretakers``): the process that
replaces a lost rank and relaunches that fit (``nbddp/detached/caretaker.py``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from nbddp.protocol.host import pid_alive
from nbddp.protocol.notes import read_note
from nbddp.protocol.session_record import SessionRecord, fit_note_path, read

RECORD_PREFIX = "record:"  # a PIDFILE line naming the session record (the session is detached)
JOB_CHECK_TICKS = 20  # a detached session's Slurm job is asked after every this many ticks (10 s: squeue costs)
CARETAKER_AGAIN_S = 10.0  # a caretaker that exited while its fit still runs is started again after this long


def wants_caretaker(record: SessionRecord | None) -> bool:
    """Whether the fit the record names needs a caretaker now: it is elastic, and no kernel nor other caretaker
    drives it (the one asking is never counted: a caretaker asks whether it should go on)."""
    if record is None or not (record.running or {}).get("care"):
        return False
    others = [pid for pid in (record.kernel_pid, record.caretaker_pid) if pid and pid != os.getpid()]
    return not any(pid_alive(pid) for pid in others)


class Caretakers:
    """The reaper's side: start the caretaker of a detached elastic fit while no kernel is attached, end it last."""

    def __init__(self, record_path: str, file_prefix: str):
        self.record_path, self.file_prefix = record_path, file_prefix
        self.process: subprocess.Popen | None = None
        self.started_at = -CARETAKER_AGAIN_S

    def tick(self, record: SessionRecord) -> None:
        if self.process is not None and self.process.poll() is None:
            return
        if not wants_caretaker(record) or not fit_running(self.file_prefix):
            return
        if time.monotonic() - self.started_at < CARETAKER_AGAIN_S:
            return
        self.started_at = time.monotonic()
        log = f"{self.record_path[:-len('.json')]}-caretaker.log"  # (beside the record: it goes with the session)
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            self.process = subprocess.Popen([sys.executable, "-m", "nbddp.detached.caretaker", self.record_path],
                                            stdin=subprocess.DEVNULL, stdout=fd, stderr=fd, start_new_session=True)
        finally:
            os.close(fd)

    def end(self) -> None:
        """The session ends: a caretaker still running goes first (it would heal what is being ended)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def record_line(pidfile: str) -> str | None:
    """The session record the pid file names (None: the session is not detached)."""
    try:
        with open(pidfile) as f:
            for line in f:
                if line.startswith(RECORD_PREFIX):
                    return line[len(RECORD_PREFIX):].strip()
    except OSError:
        return None
    return None


def fit_running(file_prefix: str) -> bool:
    """Whether rank 0 says a fit of this session is running (its note, written while no kernel may watch)."""
    note = read_note(fit_note_path(file_prefix)) if file_prefix else None
    return isinstance(note, dict) and note.get("status") == "running"


def jobs_ended(job_ids: list[str]) -> bool:
    """Whether every Slurm job of the session has ended (its time limit, a cancel): the session has no workers left."""
    if not job_ids:
        return False
    from nbddp.cluster.slurm.queue import query

    states = query(job_ids)
    return len(states) == len(job_ids) and all(state.ended for state in states.values())


def wait_unused(pidfile: str, record_path: str, file_prefix: str, interval: float = 0.5) -> bool:
    """Wait while the session is in use or idle for less than its keep_alive.

    Returns False on a clean stop (the pid file removed by an attached
    kernel's ``nbddp.stop()``), True when the session must end now.
    """
    caretakers = Caretakers(record_path, file_prefix)
    try:
        return _wait_unused(pidfile, record_path, file_prefix, interval, caretakers)
    finally:
        caretakers.end()


def _wait_unused(pidfile: str, record_path: str, file_prefix: str, interval: float, caretakers: Caretakers) -> bool:
    idle_since, ticks = time.monotonic(), 0
    while os.path.exists(pidfile):
        try:
            record = read(record_path)
        except PermissionError:
            record = None
        if record is None:
            return True  # the record was removed (its controller was found gone): end what is left
        now, ticks = time.monotonic(), ticks + 1
        if ticks % JOB_CHECK_TICKS == 0 and jobs_ended(record.slurm_job_ids):
            return True
        caretakers.tick(record)
        if (record.kernel_pid and pid_alive(record.kernel_pid)) or fit_running(file_prefix):
            idle_since = now
        elif now - idle_since >= record.keep_alive_s:
            return True
        time.sleep(interval)
    return False
