"""The folder an elastic fit's snapshots live in: ``/dev/shm``, owned by the session, gone with the fit.

Named after the session's shared-memory prefix, so ``nbddp.stop()`` and the
session's clean-up remove it too if the kernel never reached the fit's end;
created 0700 so that no other user reads a snapshot.
"""

from __future__ import annotations

import os
import secrets
import shutil

from nbddp.shipping.shm_files import shm_dir


def make(prefix: str) -> str:
    """A new, empty, owner-only folder for one fit's snapshots."""
    path = os.path.join(shm_dir(), f"{prefix}-snap-{secrets.token_hex(6)}")
    os.mkdir(path, 0o700)
    return path


def remove(path: str | None) -> None:
    """Whatever happened to the fit: every snapshot goes."""
    if path:
        shutil.rmtree(path, ignore_errors=True)
