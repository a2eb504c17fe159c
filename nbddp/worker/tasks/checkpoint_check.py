"""``dist_fit(resume=...)`` read in the kernel, as the workers will read it, before any worker works.

The kernel calls ``check_resume`` in its own process (no task is sent): a checkpoint that only a full unpickle
could read is refused there with ``UntrustedCheckpointError`` (``worker/checkpoints/trust.py``), and no rank
starts. Tensors are mapped, not read (``mmap``), so a large file costs little. A path the kernel cannot see
(another host's disk) or a format it cannot map is left to the ranks, which read it the same safe way.
"""

from __future__ import annotations

import os

from nbddp.protocol.errors import UntrustedCheckpointError
from nbddp.worker.checkpoints import files as ckpt, trust


def check_resume(resume: bool | str, checkpoint_dir: str | None, trust_checkpoint: bool) -> None:
    """Raise ``UntrustedCheckpointError`` when the checkpoint ``resume`` names needs a full unpickle."""
    if trust_checkpoint or resume is False:
        return
    with trust.trusting(False):
        try:
            path = ckpt.resolve(resume, checkpoint_dir)
        except UntrustedCheckpointError:  # a folder's .metadata (a ValueError too)
            raise
        except (FileNotFoundError, ValueError):
            return  # the ranks say what is wrong with the path, as before
        if path is None:
            return
        try:
            trust.load_file(os.path.join(path, ckpt.SHARDED_LOOP_FILE) if os.path.isdir(path) else path, mmap=True)
        except UntrustedCheckpointError:  # (a RuntimeError too, as every NbddpError)
            raise
        except (OSError, RuntimeError):
            return  # not mappable here (an old format, a damaged file): the ranks read it and say so
