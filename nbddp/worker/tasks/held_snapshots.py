"""What one host still holds of an elastic fit after its Slurm job was lost: snapshots, checkpoints.

A job lost with its nodes (``NODE_FAIL``, a preemption, a requeue) takes the
ranks' processes; what may outlive them is a node's ``/dev/shm`` snapshot
folder (when the new job lands on a node that survived) and the fit's
``checkpoint_dir`` (when it is on a file system the nodes share). The kernel
asks one engine per host of the new job (``elastic/job_loss.py``) and
resumes only from a step every rank can read. The same task removes the
fit's snapshot folder on that host when the fit ends: only a process there
can.
"""

from __future__ import annotations

import os
import shutil
import socket

from nbddp.worker.checkpoints import files as ckpt


def held(snapshot_dir: str | None, checkpoint_dir: str | None) -> dict[str, object]:
    """This host's name, its whole snapshots as ``{step: path}`` and checkpoints as ``{step: (path, mtime)}``.

    The mtime tells the kernel which checkpoints this fit wrote (``checkpoint_dir`` may hold older ones).
    """
    return {"host": socket.gethostname(), "snapshots": _complete(snapshot_dir),
            "checkpoints": {k: (p, os.path.getmtime(p)) for k, p in _complete(checkpoint_dir).items()}}


def remove_folder(path: str) -> bool:
    """Remove an ended fit's snapshot folder on this host; whether there was one."""
    there = os.path.isdir(path)
    shutil.rmtree(path, ignore_errors=True)
    return there


def _complete(directory: str | None) -> dict[int, str]:
    if not directory or not os.path.isdir(directory):
        return {}
    found = {}
    for path in ckpt.list_checkpoints(directory):
        if ckpt.is_complete(path):
            found[int(os.path.basename(path).split("-")[1].split(".")[0])] = path
    return found
