"""A spare engine's warm-up: an elastic fit's replacement rank, ready before any rank is lost.

A fresh engine spends most of a recovery importing: torch, then nbddp's
training code and, for sharded fits, ``torch.distributed.checkpoint`` (13 s,
0.9 s and 7 s on the loaded 2-core test machine). A spare pays that while
the fit trains, in a thread of its own at a lower CPU priority, so it takes
as little as it can from the ranks training beside it. It joins no group
until the kernel makes it a rank (``nbddp/elastic/spare.py``).
"""

from __future__ import annotations

import importlib
import os
import threading
import time

from nbddp.protocol.placement import Probe
from nbddp.worker.memory.release import begin_task
from nbddp.worker.tasks.probe import probe

# what a relaunched fit imports on its first step, whatever the strategy (the sharded ones restore through DCP)
WARM_MODULES = ("torch", "torch.distributed", "nbddp.worker.tasks.entry", "nbddp.worker.training.loop",
                "nbddp.worker.training.setup", "nbddp.worker.checkpoints.files", "nbddp.worker.checkpoints.sharded",
                "nbddp.worker.tasks.process_group", "torch.distributed.checkpoint", "torch.distributed.tensor",
                "torch.distributed.fsdp", "torch.distributed.pipelining")
NICE = 10  # the warm-up thread's niceness: below the training ranks, which keep theirs


def warm_spare(engine_id: int, controller_host: str, token_path: str, token: str, kernel_pid: int,
               file_prefix: str = "") -> tuple[Probe, float]:
    """Probe this engine (it watches the kernel from now on), then import what a relaunched fit needs.

    Returns the probe and the seconds the imports took.
    """
    t0 = time.perf_counter()
    failed: list[BaseException] = []

    def imports() -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)  # this thread only (Linux)
        except (OSError, AttributeError):
            pass
        try:
            for name in WARM_MODULES:
                importlib.import_module(name)
        except BaseException as exc:  # noqa: BLE001 - raised in the task's own thread below
            failed.append(exc)

    thread = threading.Thread(target=imports, name="nbddp-spare-warmup", daemon=True)
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    begin_task()  # its objects frozen out of the collector now, as before any task, not on the recovery's path
    return probe(engine_id, controller_host, token_path, token, kernel_pid, file_prefix), time.perf_counter() - t0
