"""The folder an elastic fit's snapshots live in: ``/dev/shm``, owned by the session, gone with the fit.

Named after the session's shared-memory prefix, so ``nbddp.stop()`` and the
session's clean-up remove it too if the kernel never reached the fit's end;
created 0700 so that no other user reads a snapshot. Ranks on other hosts
(a Slurm job's nodes, an SSH cluster's hosts) keep a folder of the same
path in their host's ``/dev/shm``, with their snapshots and the copy of a
peer's (``worker/checkpoints/peer_copies.py``); at the fit's end one engine
per such host removes it, as only a process there can (bounded: a host whose
engine is gone keeps its folder until the node's ``/dev/shm`` is cleared).
"""

from __future__ import annotations

import os
import secrets
import shutil
from nbddp.execution.contracts import SessionLike
from nbddp.execution.send import once_per_other_host
from nbddp.protocol.notes import shm_dir

REMOTE_REMOVE_S = 5.0  # the fit's end waits at most this long for the other hosts


def make(prefix: str) -> str:
    """A new, empty, owner-only folder for one fit's snapshots."""
    path = os.path.join(shm_dir(), f"{prefix}-snap-{secrets.token_hex(6)}")
    os.mkdir(path, 0o700)
    return path


def remove(path: str | None, session: SessionLike | None = None) -> list[str]:
    """Whatever happened to the fit: every snapshot goes, here and (``session``) on the group's other hosts.

    Returns the other hosts asked.
    """
    if not path:
        return []
    shutil.rmtree(path, ignore_errors=True)
    if session is None:
        return []
    group = session.group
    placements = list(group.placements) if group else []
    workers = session.workers if any(not p.local for p in placements) else None
    if workers is None or workers.job_problem() is not None:  # (a lost job's engines are gone with their folders)
        return []
    from nbddp.worker.tasks.snapshot_folder import remove_snapshot_folder

    # best effort: a host whose engine is gone keeps its folder until its /dev/shm is cleared
    return once_per_other_host(session.client, placements, remove_snapshot_folder, path, timeout=REMOTE_REMOVE_S)
