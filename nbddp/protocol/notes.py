"""Where the session's files live on a host, and the small notes the kernel leaves there for a rank.

Both sides must name the same files: the kernel writes ``<prefix>-...`` files
that a rank on its host reads, and removes a killed rank's by the same prefix,
so ``shm_dir`` is an agreement, like a message. A note is a small JSON file
the kernel replaces while a rank reads it (a profile request,
``profile_spec.py``; a callback's answer, ``epoch_answer.py``). The tensor files
and their pool are ``shipping/shm_files.py``'s, built on this.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any


def shm_dir() -> str:
    """Where tensor files go: RAM-backed ``/dev/shm`` when it is writable."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        return "/dev/shm"
    return tempfile.gettempdir()


def write_note(path: str, value: object) -> None:
    """Replace the note at ``path`` with ``value`` as JSON, atomically and owner-only: a reader sees old or new."""
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(value, f)
    os.replace(tmp, path)


def read_note(path: str) -> Any:
    """The note at ``path``, or None when there is none (or it is being replaced on a file system without rename)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, ValueError):
        return None
