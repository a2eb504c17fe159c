"""What one host still holds of an elastic fit after its Slurm job was lost: snapshots, checkpoints.

A job lost with its nodes (``NODE_FAIL``, a preemption, a requeue) takes the
ranks' processes; what may outlive them is a node's ``/dev/shm`` snapshot
folder (when the new job lands on a node that survived) and the fit's
``checkpoint_dir`` (when it is on a file system the nodes share). The kernel
asks one engine per host of the new job (``elastic/job_loss.py``) and
resumes only from a step every rank can read: a snapshot whose files the
hosts hold together (the relaunch copies them where they lack), or a
checkpoint every host reads. (The folder's removal at the
fit's end is ``snapshot_folder.py``'s task, next to this one.)
"""

from __future__ import annotations

import os
import socket

from nbddp.worker.checkpoints import files as ckpt, shard_copies


def held(snapshot_dir: str | None, checkpoint_dir: str | None) -> dict[str, object]:
    """This host's name, what it holds of each snapshot, whole or in part (``pieces``: ``shard_copies.listing``),
    and its whole checkpoints as ``{step: (path, mtime)}``.

    The mtime tells the kernel which checkpoints this fit wrote (``checkpoint_dir`` may hold older ones).
    """
    return {"host": socket.gethostname(), "pieces": shard_copies.listing(snapshot_dir),
            "checkpoints": {k: (p, os.path.getmtime(p)) for k, p in ckpt.whole(checkpoint_dir).items()}}

