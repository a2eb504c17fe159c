"""This host, as both sides see it: the address towards a peer, a free port, whether a pid lives.

The kernel uses them locally (a Slurm request, a rendezvous on one host) and
sends ``free_port`` to a rank (a rendezvous across hosts); the workers use
them in their probe, the reaper ``pid_alive``; both ``catches_signal``. No dependencies.
"""

from __future__ import annotations

import os
import socket


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


def catches_signal(pid: int, signum: int) -> bool | None:
    """Whether process ``pid`` has a handler for ``signum`` now (Linux's ``SigCgt`` in ``/proc``); None if unknown.

    A signal a process does not catch may end it (SIGUSR1's default action is
    to terminate), so a sender that only means to ask something checks first.
    """
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError, IndexError):
        return None
    return None


def address_towards(host: str) -> str:
    """The local address used to reach ``host`` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def free_port(address: str) -> int:
    """A TCP port free on ``address`` now (for a multi-host rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return s.getsockname()[1]
