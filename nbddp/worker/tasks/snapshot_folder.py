"""An elastic fit's snapshot folder removed on this engine's host (the kernel reaches other hosts' ``/dev/shm`` so).

On the kernel's host the kernel removes the folder itself; on another host
only an engine there can (``nbddp/elastic/snapshot_folder.py`` sends this
after the fit, whatever its outcome). Only a folder of the fit's own name in
this host's shared memory is removed.
"""

from __future__ import annotations

import os
import shutil

from nbddp.protocol.notes import shm_dir


def remove_snapshot_folder(path: str) -> bool:
    """Remove ``path`` if it is an nbddp snapshot folder in ``/dev/shm``; whether one was there."""
    if os.path.dirname(path) != shm_dir() or "-snap-" not in os.path.basename(path):
        raise ValueError(f"remove_snapshot_folder({path!r}): not an elastic fit's snapshot folder in {shm_dir()}")
    found = os.path.isdir(path)
    shutil.rmtree(path, ignore_errors=True)
    return found
