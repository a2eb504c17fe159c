"""The settings of ``nbddp.start``, checked before any process starts.

A wrong ``n``, backend or timeout costs an error message here instead of
seven seconds of starting engines that then cannot form a group.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nbddp.cluster.slurm.request import SlurmRequest
from nbddp.protocol.cpus import usable_cpus

if TYPE_CHECKING:
    from ipyparallel import Cluster

__all__ = ["StartOptions", "threads_per_worker", "validate_start"]

DEFAULT_PG_TIMEOUT_S = 300.0
BACKENDS = ("gloo", "nccl")


@dataclass
class StartOptions:
    """What ``start()`` was asked for; ``restart()`` asks for the same again."""

    n: int | None
    backend: str | None
    cluster: Cluster | None
    profile: str | None
    cluster_id: str | None
    timeout: float
    threads: int | None
    interface: str | None
    stall_timeout: float | None = None
    slurm: SlurmRequest | None = None  # the engines are a Slurm job (start(slurm=...))

    @property
    def attach(self) -> bool:
        return self.profile is not None or self.cluster_id is not None


def local_gpu_count() -> int:
    """Visible GPUs, without initialising CUDA in the kernel (fork-safe)."""
    import torch

    try:
        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - a broken driver counts as no GPU
        return 0


def check_stall_timeout(value: float | None, where: str) -> float | None:
    """``stall_timeout`` is seconds > 0, or None (stalls are shown, never fatal)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or value != value:
        raise TypeError(f"{where}(stall_timeout=...) must be a number of seconds or None, got "
                        f"{type(value).__name__} {value!r}")
    if value <= 0:
        raise ValueError(f"{where}(stall_timeout=...) must be > 0 seconds (or None to only show stalls), got {value}")
    return float(value)


def validate_start(n: int | None, backend: str | None, timeout: float | None, threads: int | None, gpus: int,
                   attach: bool) -> tuple[int | None, str | None]:
    """Check ``start()``'s arguments before any process starts; fill in the defaults."""
    if n is not None and (isinstance(n, bool) or not isinstance(n, int)):
        raise TypeError(f"start(n=...) must be an int, got {type(n).__name__} {n!r}")
    if n is not None and n < 1:
        raise ValueError(f"start(n=...) must be >= 1, got {n}")
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"start(backend=...) must be one of {BACKENDS}, got {backend!r}")
    if timeout is not None and (not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0):
        raise ValueError(f"start(timeout=...) is the process-group timeout in seconds and must be > 0, got {timeout!r}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"start(threads=...) must be a positive int (CPU threads per worker), got {threads!r}")
    if attach:
        return n, backend
    if backend == "nccl" and gpus == 0:
        raise ValueError(
            "start(backend='nccl') needs CUDA GPUs, and this machine has none visible. "
            "Use backend='gloo' (the default without GPUs) to train on CPU workers."
        )
    if gpus and n is not None and n > gpus and backend != "gloo":
        raise ValueError(
            f"start(n={n}) asks for more workers than the {gpus} visible GPU(s); nccl allows one rank per GPU. "
            f"Use n<={gpus}, or backend='gloo' to share the GPUs between workers (for testing)."
        )
    if n is None:
        n = gpus or 2
    if backend is None:
        backend = "nccl" if gpus else "gloo"
    return n, backend


def threads_per_worker(workers_on_host: int) -> int:
    """CPU threads per worker: the CPUs this process may use, shared among the host's workers (torchrun uses 1).

    For engines this kernel starts on its own host, set in their environment
    before torch is imported; once the ranks are known each engine counts
    again on its own host (``protocol/cpus.py``, ``join_process_group``).
    """
    return max(1, usable_cpus() // workers_on_host)
