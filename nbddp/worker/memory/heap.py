"""glibc's heap, through ctypes: settings, trimming, and fencing off its free space.

The calls ``worker/memory/allocator.py`` (when to use which setting) and
``worker/memory/release.py`` (giving memory back after a task) need, and nothing
else. Everywhere but glibc (macOS, musl), or where another allocator is
preloaded, ``libc()`` is None and every call here does nothing.

**Fencing** (``fence``/``unfence``). glibc serves a request from a free chunk
of its heap when one fits, whatever the mmap threshold says; the threshold
only decides how the heap grows. After a DDP fit the heap holds hundreds of
MiB of free chunks (trimmed, so not resident), and a sharded fit that
should give each large block a mapping of its own would carve them up
instead: measured on 96 x ``Linear(1024, 1024)``, AdamW, 2 CPU ranks, FSDP's
peak went from 1,130 MiB on fresh workers to 1,240-1,440 MiB after a DDP
fit. ``fence()`` allocates the heap's free chunks (largest first, down to
``SMALLEST``) and holds them, untouched, until ``unfence()``: the fit's
large blocks then get mappings (1,136-1,142 MiB after a DDP fit), and the
fence costs about one page per chunk and 1-5 ms.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
import time
from typing import Any

SMALLEST = 64 << 10  # chunks below this stay free: the mmap threshold a fenced fit runs with
MAX_FENCE_S = 0.05
_LIBC: dict[str, Any] = {}
_FENCE: list[int] = []


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


def libc() -> Any:
    """The C library when it is glibc (with ``malloc``/``free`` typed for pointers), else None."""
    if "libc" not in _LIBC:
        lib = None
        if platform.libc_ver()[0] == "glibc":
            lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            lib.malloc.restype, lib.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
            lib.free.restype, lib.free.argtypes = None, [ctypes.c_void_p]
            if hasattr(lib, "mallinfo2"):
                lib.mallinfo2.restype = _MallInfo2
        _LIBC["libc"] = lib
    return _LIBC["libc"]


def mallinfo() -> dict[str, int]:
    """glibc's ``mallinfo2()`` (bytes; every arena): ``arena`` (heap size), ``in_use``, ``free``, ``mmapped``."""
    lib = libc()
    if lib is None or not hasattr(lib, "mallinfo2"):
        return {}
    m = lib.mallinfo2()
    return {"arena": m.arena, "in_use": m.uordblks, "free": m.fordblks, "mmapped": m.hblkhd}


def trim() -> None:
    """``malloc_trim(0)``: the free pages of every heap go back to the system."""
    lib = libc()
    if lib is not None:
        lib.malloc_trim(0)


def fence() -> int:
    """Hold the heap's free chunks (see the module docstring); return how many. A second call adds to the first."""
    lib = libc()
    if lib is None or not hasattr(lib, "mallinfo2"):
        return 0
    trim()  # what is held must not be resident
    size, deadline = 64 << 20, time.perf_counter() + MAX_FENCE_S
    while size >= SMALLEST and time.perf_counter() < deadline:
        before = lib.mallinfo2()
        if before.fordblks < 4 * SMALLEST:
            break
        block = lib.malloc(size)
        after = lib.mallinfo2()
        if not block or after.hblkhd > before.hblkhd or after.arena > before.arena:
            lib.free(block)  # a new mapping, or the heap grew: no free chunk of this size is left
            size //= 2
            continue
        _FENCE.append(block)
    return len(_FENCE)


def unfence() -> None:
    """Free what ``fence`` holds."""
    lib = libc()
    while _FENCE:
        lib.free(_FENCE.pop())
