"""``nbddp.export_checkpoint``: a sharded checkpoint made one file, in whichever process calls it.

The kernel calls it in its own process (no workers needed); it reads the
format that ``worker/checkpoints/sharded.py`` writes, so it lives with it.
"""

from __future__ import annotations

from nbddp.worker.checkpoints.sharded import export

__all__ = ["export"]
