"""A detached session's end: the reaper waits here while no kernel is attached, until ``keep_alive`` passes idle.

When the kernel that started a detached session dies (or exits), the
reaper (``nbddp/cluster/reaper.py``) does not end the workers. It watches
the session record instead (``nbddp/protocol/session_record.py``): while a
kernel is attached (the record names its live pid) or a fit runs on the
ranks (rank 0's fit note says "running"), the session is in use. Once it
has been unused for the record's ``keep_alive_s``, the reaper ends it as the
kernel's death would have: every process, the Slurm job, the /dev/shm files,
and the record itself.
"""

from __future__ import annotations

import os
import time

from nbddp.protocol.host import pid_alive
from nbddp.protocol.notes import read_note
from nbddp.protocol.session_record import fit_note_path, read

RECORD_PREFIX = "record:"  # a PIDFILE line naming the session record (the session is detached)


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


def in_use(record_path: str, file_prefix: str) -> bool | None:
    """True while a kernel is attached or a fit runs; None once the record is gone (the session was ended)."""
    try:
        record = read(record_path)
    except PermissionError:
        return None
    if record is None:
        return None
    return bool(record.kernel_pid and pid_alive(record.kernel_pid)) or fit_running(file_prefix)


def wait_unused(pidfile: str, record_path: str, file_prefix: str, interval: float = 0.5) -> bool:
    """Wait while the session is in use or idle for less than its keep_alive.

    Returns False on a clean stop (the pid file removed by an attached
    kernel's ``nbddp.stop()``), True when the session must end now.
    """
    idle_since = time.monotonic()
    while os.path.exists(pidfile):
        used = in_use(record_path, file_prefix)
        if used is None:
            return True
        record = read(record_path)
        if used or record is None:
            idle_since = time.monotonic()
        elif time.monotonic() - idle_since >= record.keep_alive_s:
            return True
        time.sleep(interval)
    return False
