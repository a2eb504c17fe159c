"""What an engine reports about itself, and joining the process group."""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import Any

from nbddp._proc import pid_alive
from nbddp.worker.memory import tune_allocator
from nbddp.worker.state import STATE


def probe(controller_host: str, token_path: str, token: str, kernel_pid: int, kernel_host: str) -> dict[str, Any]:
    """Describe this engine: host, pid, reachable address, GPUs, same host as the kernel.

    ``same_host_as_kernel`` is decided by reading a token file the kernel just
    wrote (same file system, so shared-memory shipping works), not by
    comparing host names, which containers and clusters make unreliable.
    """
    import psutil
    import torch

    try:
        with open(token_path) as f:
            same = f.read() == token
    except OSError:
        same = False
    address = _address_towards(controller_host)
    interfaces = {}
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family == socket.AF_INET:
                interfaces[name] = a.address
    hints = {k: v for k, v in os.environ.items() if k.startswith(("SLURM_", "OMPI_", "PMI_", "CUDA_VISIBLE"))}
    if same and kernel_pid > 0:  # 0: an attached cluster's engines, which outlive the kernel
        _watch_kernel(kernel_pid)
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "address": address,
        "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "same_host_as_kernel": same,
        "python": sys.version.split()[0],
        "torch_version": torch.__version__,
        "hints": hints,
        "interfaces": interfaces,
    }


def _address_towards(host: str) -> str:
    """The local address used to reach ``host`` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def free_port(address: str) -> int:
    """A TCP port free on ``address`` now (for a multi-host rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def _watch_kernel(kernel_pid: int, interval: float = 0.5) -> None:
    """Exit this engine when the kernel that started it dies (no orphans).

    Only for engines on the kernel's host, where its pid means something.
    A daemon thread: it costs one wake-up every ``interval`` seconds.
    """
    if STATE.watchdog is not None and STATE.watchdog.is_alive():
        return

    def _watch() -> None:
        while True:
            time.sleep(interval)
            if not pid_alive(kernel_pid):
                os._exit(0)

    STATE.watchdog = threading.Thread(target=_watch, name="nbddp-kernel-watchdog", daemon=True)
    STATE.watchdog.start()


def join_process_group(
    placement: Any,
    backend: str,
    init_method: str,
    generation: int,
    timeout_s: float,
    threads: int,
    ifname: str | None,
    file_prefix: str = "",
) -> dict[str, Any]:
    """(Re)join the process group as ``placement.rank`` of generation ``generation``.

    ``file_prefix`` names this worker's shared-memory files after the kernel's
    session, so the kernel can remove them even if this process is killed.

    A failed process group cannot be reused (see the facts file), so every
    new generation destroys the old group first, then joins on a fresh
    store (a new file or port).
    """
    import torch
    import torch.distributed as dist

    t0 = time.perf_counter()
    _drop_dead_references()  # a failed fit's traceback keeps its DDP module and the old group alive
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a broken group may fail to tear down; we replace it anyway
            pass
    _drop_dead_references()  # frees the old group's gloo threads and sockets now, not at some later gc
    if ifname:
        os.environ["GLOO_SOCKET_IFNAME"] = ifname
        os.environ["NCCL_SOCKET_IFNAME"] = ifname
    if threads > 0:
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)
    allocator = tune_allocator()
    if placement.device.startswith("cuda"):
        torch.cuda.set_device(placement.local_rank)
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        kwargs["device_id"] = torch.device(placement.device)
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=placement.rank,
        world_size=placement.world_size,
        timeout=timedelta(seconds=timeout_s),
        **kwargs,
    )
    STATE.placement = placement
    STATE.backend = backend
    STATE.generation = generation
    STATE.dataset_cache.clear()  # the kernel starts each generation with nothing resident
    if file_prefix and STATE.file_prefix != f"{file_prefix}-w{placement.rank}":
        from nbddp.shipping import BufferPool

        if STATE.return_pool is not None:
            STATE.return_pool.close()
        STATE.file_prefix = f"{file_prefix}-w{placement.rank}"
        STATE.return_pool = BufferPool(prefix=f"{STATE.file_prefix}-r", keep=1)
    STATE.namespace.update(
        rank=placement.rank,
        local_rank=placement.local_rank,
        world_size=placement.world_size,
        device=torch.device(placement.device),
    )
    return {"rank": placement.rank, "seconds": time.perf_counter() - t0, "threads": torch.get_num_threads(),
            "allocator": allocator}


def _drop_dead_references() -> None:
    """Break the cycles (exception -> traceback -> frames -> DDP -> process group) of failed tasks."""
    import gc

    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            setattr(sys, name, None)
    gc.collect()


def leave_process_group() -> None:
    """Tear the group down (before the engines are stopped)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    STATE.generation = -1
