"""Process liveness, shared by the kernel's reaper and the workers (no dependencies)."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs on this machine; a zombie (exited, not yet reaped) counts as dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True
