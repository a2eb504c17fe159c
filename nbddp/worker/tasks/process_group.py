"""Joining (and leaving) one generation of the process group, on a worker.

A failed process group cannot be reused (``docs/ipyparallel-notes.md``,
"Process groups"), so every new
generation destroys the old group first, then joins on a fresh store (a new
file or port). Joining also sets what the rest of the worker reads: this
rank's placement in ``STATE``, the names ``%%ddp`` cells see, CPU threads,
the socket interface, and the allocator settings. The groups made beyond the
world group end through ``worker/engine/group_lifetime.py``.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

from nbddp.protocol.cpus import threads_for
from nbddp.protocol.messages import JoinReply
from nbddp.protocol.placement import Placement
from nbddp.worker.engine import torchrun
from nbddp.worker.engine.group_lifetime import forget_meshes
from nbddp.worker.memory.allocator import tune_allocator
from nbddp.worker.memory.release import drop_failed_frames
from nbddp.worker.engine.rank_state import STATE


def join_process_group(
    placement: Placement,
    backend: str,
    init_method: str,
    generation: int,
    timeout_s: float,
    threads: int,
    ifname: str | None,
    file_prefix: str = "",
    master_addr: str = "127.0.0.1",
    master_port: int = 0,
) -> JoinReply:
    """(Re)join the process group as ``placement.rank`` of generation ``generation``.

    ``file_prefix`` names this worker's shared-memory files after the kernel's
    session, so the kernel can remove them even if this process is killed.
    """
    import torch
    import torch.distributed as dist

    t0 = time.perf_counter()
    _leave_broken_group()
    allocator = _configure_process(placement, threads, ifname)
    kwargs: dict[str, Any] = {"device_id": torch.device(placement.device)} if backend == "nccl" else {}
    dist.init_process_group(backend, init_method=init_method, rank=placement.rank, world_size=placement.world_size,
                            timeout=timedelta(seconds=timeout_s), **kwargs)
    _adopt(placement, backend, generation, file_prefix, (master_addr, master_port))
    return JoinReply(rank=placement.rank, seconds=time.perf_counter() - t0, threads=torch.get_num_threads(),
                     allocator=allocator)


def _leave_broken_group() -> None:
    import torch.distributed as dist

    if STATE.generation == -1 and STATE.failure is None and not (dist.is_available() and dist.is_initialized()):
        return  # a fresh engine (or an elastic fit's spare): no old group, nothing of one to collect (a second or
        # more of full collections on a loaded machine, on the path of a recovery)
    drop_failed_frames()  # a failed fit's traceback keeps its DDP module and the old group alive
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a broken group may fail to tear down; we replace it anyway
            pass
        forget_meshes()
    STATE.mesh_groups.clear()  # destroyed with the world group (worker/engine/device_mesh.py)
    # the old generation's datasets go in the same collection: let go after it, the next task would find them
    # "let go but alive" and pay a full collection of its own (1.4 s of a loaded recovery)
    STATE.dataset_cache.clear()
    # frees the old group's gloo threads and sockets now, not at some later gc: a full collection, since what
    # referred to the old group may have been frozen with the engine's objects (worker/memory/release.py)
    drop_failed_frames(everything=True)


def _configure_process(placement: Placement, threads: int, ifname: str | None) -> str:
    """Socket interface, CPU threads (``threads``, or 0: from this host's CPUs), allocator, CUDA device; return the
    allocator's setting."""
    import torch

    if ifname:
        os.environ["GLOO_SOCKET_IFNAME"] = ifname
        os.environ["NCCL_SOCKET_IFNAME"] = ifname
    if threads <= 0:  # start(threads=None): this host's usable CPUs (affinity, cgroup quota) over its ranks
        threads = threads_for(placement.local_world_size)
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    if placement.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(placement.device))
    return tune_allocator()


def _adopt(placement: Placement, backend: str, generation: int, file_prefix: str, master: tuple[str, int]) -> None:
    """Record the new generation in ``STATE`` and refresh what cells see."""
    import torch

    STATE.placement = placement
    STATE.backend = backend
    STATE.generation = generation
    STATE.master = master
    STATE.dataset_cache.clear()  # the kernel starts each generation with nothing resident
    if file_prefix and STATE.file_prefix != f"{file_prefix}-w{placement.rank}":
        STATE.file_prefix = f"{file_prefix}-w{placement.rank}"
    STATE.session_prefix = file_prefix or STATE.session_prefix  # the session's own files (a detached one's journal)
    if STATE.file_prefix:  # SIGUSR1 -> every thread's stack, for nbddp.stacks(); removed with the session's files
        from nbddp.protocol.notes import shm_dir
        from nbddp.worker.engine.heartbeat import enable_stack_dumps

        enable_stack_dumps(os.path.join(shm_dir(), f"{STATE.file_prefix}-stacks"))
    STATE.namespace.update(rank=placement.rank, local_rank=placement.local_rank, world_size=placement.world_size,
                           device=torch.device(placement.device))
    torchrun.apply_environment(placement, master)
    torchrun.install_group_guard()


def leave_process_group() -> None:
    """Tear the group down (before the engines are stopped)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        forget_meshes()
    STATE.mesh_groups.clear()
    STATE.generation = -1
