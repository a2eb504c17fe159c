"""The C allocator of a worker: keep training's buffers instead of re-faulting them.

PyTorch's CPU allocator takes every tensor from ``malloc`` and frees it at
once. With glibc's defaults, a block above the (dynamic) mmap threshold is
an ``mmap`` of its own and is unmapped on free, and free memory at the top
of the heap is given back past 128 KiB; the next step then page-faults the
same memory in again. A fresh ``torchrun`` process and a long-lived engine
both pay this, but unevenly: measured on 2 CPU ranks with a small CNN, an
engine's rank 0 took ~120k minor faults (0.3 s of system time) in every 2 s
fit, the rank that gates the step. PyTorch's CPU tuning guide recommends
jemalloc/tcmalloc for the same reason; those need ``LD_PRELOAD`` at process
start, which nbddp cannot do for engines it attaches to.

So each worker sets two glibc parameters when it joins the process group:
blocks up to 32 MiB (glibc's largest mmap threshold) come from the heap, and
the heap keeps up to 256 MiB of free memory at its top. The steady state of
a training loop then allocates from memory it already touched: no page
faults after the first steps. The cost is that an idle worker keeps what
its last fit used, up to those bounds.

It is left alone where a person chose otherwise: ``NBDDP_MALLOC=default`` in
the engine's environment, glibc's own ``MALLOC_MMAP_THRESHOLD_`` /
``MALLOC_TRIM_THRESHOLD_`` variables, or another allocator in ``LD_PRELOAD``.
On other C libraries (macOS, musl) there is nothing to set.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

MMAP_THRESHOLD = 32 << 20  # glibc's maximum (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
TRIM_THRESHOLD = 256 << 20
_M_TRIM_THRESHOLD = -1  # mallopt parameter numbers, from glibc's malloc.h
_M_MMAP_THRESHOLD = -3
OPT_OUT = "NBDDP_MALLOC"
_USER_KNOBS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")


def reason_to_leave_alone(environ: os._Environ | dict[str, str] = os.environ) -> str | None:
    """Why this process's allocator should not be tuned, or None."""
    choice = environ.get(OPT_OUT, "").strip().lower()
    if choice in ("default", "off", "0", "no", "false"):
        return f"{OPT_OUT}={environ[OPT_OUT]}"
    if choice not in ("", "tuned", "on", "1", "yes", "true"):
        raise ValueError(
            f"{OPT_OUT}={environ[OPT_OUT]!r} is not understood; set it to 'default' to leave the C allocator "
            "as it is, or unset it to let nbddp tune it"
        )
    for knob in _USER_KNOBS:
        if knob in environ and (knob != "GLIBC_TUNABLES" or "malloc" in environ[knob]):
            return f"{knob} is set"
    preload = environ.get("LD_PRELOAD", "")
    if any(name in preload for name in ("jemalloc", "tcmalloc", "mimalloc")):
        return f"another allocator is preloaded ({preload})"
    libc, _ = platform.libc_ver()
    if libc != "glibc":
        return f"not glibc ({libc or 'unknown C library'})"
    return None


def tune_allocator(environ: os._Environ | dict[str, str] = os.environ) -> str:
    """Set glibc's mmap and trim thresholds for training (once per process is enough).

    Returns what was done, for ``nbddp.status()``: ``"tuned"``, or
    ``"default (<why>)"`` when left alone.
    """
    why = reason_to_leave_alone(environ)
    if why is not None:
        return f"default ({why})"
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    ok = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    return "tuned" if ok else "default (mallopt refused the values)"
