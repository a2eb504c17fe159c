"""The C allocator of a worker: keep training's buffers, without letting a fit's memory linger.

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

So the setting follows what a fit is doing (glibc's ``mallopt`` may be
called again at any time):

* **steady state** (``for_steady_state``: between tasks, and in a DDP fit
  from its second step on): blocks up to 32 MiB (glibc's largest mmap
  threshold) come from the heap, and the heap keeps up to 256 MiB of free
  memory at its top. The loop then allocates from memory it already
  touched: no page faults after the first steps.
* **a fit's set-up and first step** (``for_setup``): blocks from 64 KiB up
  get mappings of their own. What lives through the fit (weights,
  gradients, optimizer state, DDP's buckets, FSDP's shards) is allocated
  then, so it is unmapped when the fit ends instead of leaving hundreds of
  MiB of free chunks in the heap.
* **a sharded (FSDP) fit keeps the set-up setting to its end**, and the
  heap's free chunks are fenced off first (``heap.fence``). FSDP's steady
  state gathers a unit's full weights, then frees them, unit after unit,
  in sizes that mix with its shards; a heap that keeps those buffers
  fragments. Measured on 96 x ``Linear(1024, 1024)`` with AdamW, 2 CPU
  ranks, ``History.ranks[i]["peak_mem"]``: FSDP 2,080-2,690 MiB per rank with
  the steady-state setting (DDP: 2,290-2,340), 1,130-1,140 MiB like this,
  whichever fit ran before. The price is a page fault per 4 KiB of those
  buffers in every step: on CPU workers that fit ran at 11-15 samples/s
  against 12-18 with the steady-state setting (3-step fits on a busy 2-core
  machine: about 20 % slower). On GPUs those buffers are CUDA memory, which
  this setting does not touch.

After every task ``worker/memory/release.py`` trims the heap (``malloc_trim``), so
an idle worker keeps none of its last fit's buffers.

It is left alone where a person chose otherwise: ``NBDDP_MALLOC=default`` in
the engine's environment, glibc's own ``MALLOC_MMAP_THRESHOLD_`` /
``MALLOC_TRIM_THRESHOLD_`` variables, or another allocator in ``LD_PRELOAD``.
On other C libraries (macOS, musl) there is nothing to set.
"""

from __future__ import annotations

import os
from typing import Any

from nbddp.protocol.allocator_setting import reason_to_leave_alone
from nbddp.worker.memory import heap
MMAP_THRESHOLD = 32 << 20  # glibc's maximum (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
TRIM_THRESHOLD = 256 << 20
SETUP_MMAP_THRESHOLD = heap.SMALLEST
_M_TRIM_THRESHOLD = -1  # mallopt parameter numbers, from glibc's malloc.h
_M_MMAP_THRESHOLD = -3
_TUNED: dict[str, Any] = {}  # "libc": the C library, while tune_allocator's setting is in force


def _set(libc: Any, mmap_threshold: int, trim_threshold: int) -> bool:
    return libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold) == 1


def tune_allocator(environ: os._Environ | dict[str, str] = os.environ) -> str:
    """Set glibc's steady-state thresholds (when the process group forms; again is harmless).

    Returns what was done, for ``nbddp.status()``: ``"tuned"``, or
    ``"default (<why>)"`` when left alone.
    """
    _TUNED.pop("libc", None)
    why = reason_to_leave_alone(environ)
    if why is not None:
        return f"default ({why})"
    libc = heap.libc()
    if libc is None or not _set(libc, MMAP_THRESHOLD, TRIM_THRESHOLD):
        return "default (mallopt refused the values)"
    _TUNED["libc"] = libc
    return "tuned"


def for_setup(sharded: bool) -> None:
    """A fit's set-up (and first step): large blocks get their own mappings; ``sharded`` fences the heap too."""
    libc = _TUNED.get("libc")
    if libc is None:
        return
    _set(libc, SETUP_MMAP_THRESHOLD, TRIM_THRESHOLD)
    if sharded:
        heap.fence()


def for_steady_state() -> None:
    """The steady-state thresholds (a no-op when the allocator is left alone); the fence goes."""
    libc = _TUNED.get("libc")
    if libc is None:
        return
    heap.unfence()
    _set(libc, MMAP_THRESHOLD, TRIM_THRESHOLD)


def steady_after_first_step(optimizer: Any) -> None:
    """Switch to the steady state once ``optimizer`` has stepped (its state exists from then on)."""
    if _TUNED.get("libc") is None:
        return
    handle: list[Any] = []

    def first_step_done(*_: Any) -> None:
        if handle:
            for_steady_state()
            handle.pop().remove()

    handle.append(optimizer.register_step_post_hook(first_step_done))
