"""``%ddp status`` on a rank: a quick look at the worker, taken as a task between two others."""

from __future__ import annotations

import os
import sys

from nbddp.protocol.messages import Health
from nbddp.worker.engine.rank_state import STATE
from nbddp.worker.tasks.cells import user_names


def health() -> Health:
    """A quick look at this worker for ``%ddp status``: pid, memory, busy, generation, what it keeps."""
    from nbddp.worker.memory.resident_sizes import resident_items
    from nbddp.worker.memory.usage import cuda_memory, rss_bytes

    cuda: dict[str, int] = {}
    if "torch" in sys.modules and STATE.placement is not None and STATE.placement.device.startswith("cuda"):
        import torch

        cuda = cuda_memory(torch.device(STATE.placement.device))
    names = user_names()
    return Health(pid=os.getpid(), rss=rss_bytes(), generation=STATE.generation, busy=STATE.busy,
                  names=len(names), cuda_allocated=cuda.get("cuda_allocated"),
                  cuda_reserved=cuda.get("cuda_reserved"), resident=resident_items(STATE.namespace, names, STATE.dataset_cache))
