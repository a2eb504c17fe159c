"""The folder an elastic fit's snapshots live in: ``/dev/shm``, owned by the session, gone with the fit.

Named after the session's shared-memory prefix, so ``nbddp.stop()`` and the
session's clean-up remove it too if the kernel never reached the fit's end;
created 0700 so that no other user reads a snapshot. Ranks on other hosts
keep a folder of the same path in their host's ``/dev/shm``; their engines
remove it when the fit ends (``remove``).
"""

from __future__ import annotations

import os
import secrets
import shutil
from typing import Any

from nbddp.shipping.shm_files import shm_dir


def make(prefix: str) -> str:
    """A new, empty, owner-only folder for one fit's snapshots."""
    path = os.path.join(shm_dir(), f"{prefix}-snap-{secrets.token_hex(6)}")
    os.mkdir(path, 0o700)
    return path


def remove(path: str | None, session: Any = None) -> list[Any]:
    """Whatever happened to the fit: every snapshot goes, here and on the hosts of ``session``'s other ranks.

    A rank on another host (``Placement.local`` false) keeps its host's folder, and the copy of a peer's
    snapshot, in that host's ``/dev/shm`` (``worker/checkpoints/peer_copies.py``): its engine removes it,
    as its next task. Returns those tasks' results (``AsyncResult``), for a caller that waits.
    """
    if not path:
        return []
    shutil.rmtree(path, ignore_errors=True)
    workers = getattr(session, "workers", None)
    if workers is None:
        return []
    from nbddp.worker.tasks.snapshot_folder import remove_snapshot_folder

    sent = []
    for p in session.placements:
        if not p.local:
            try:
                sent.append(workers.client[p.engine_id].apply_async(remove_snapshot_folder, path))
            except Exception:  # noqa: BLE001 - an engine gone with its host: nothing of it to remove
                pass
    return sent
