"""What a rank uses: resident and peak memory, CUDA memory.

Peak memory is what decides whether a model fits, so it is measured per
fit: on CUDA the allocator's peak (reset when a fit starts), on CPU the
process's peak resident set (``VmHWM``), which Linux resets when ``5`` is
written to ``/proc/self/clear_refs``. Where that reset is refused, the peak
is the process's lifetime peak, and is marked so.

The reset happens once the previous task's memory was given back
(``worker/memory/release.py``), so the peak is this fit's own: what was resident
when it began (``base_mem``: the engine, imported modules, what the person
keeps) plus what the fit added at its worst.
"""

from __future__ import annotations

import os
import torch

_PEAK_RESET = {"ok": True}


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def _vm_hwm() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return rss_bytes()


def reset_peak_memory(device: torch.device) -> int:
    """Start measuring the peak afresh (at the start of each fit or trial); return what is resident now.

    On CUDA: the bytes allocated on ``device``; on CPU: the resident set.
    """
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return int(torch.cuda.memory_allocated(device))
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        _PEAK_RESET["ok"] = False
    return rss_bytes()


def peak_memory(device: torch.device) -> int:
    """Bytes: the CUDA peak allocated on GPU, the peak resident set on CPU (both since the last reset)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return _vm_hwm()


def cuda_memory(device: torch.device) -> dict[str, int]:
    """``cuda_allocated``, ``cuda_reserved``, ``cuda_peak`` on a CUDA device; nothing on CPU."""
    if device.type != "cuda":
        return {}
    return {"cuda_allocated": int(torch.cuda.memory_allocated(device)),
            "cuda_reserved": int(torch.cuda.memory_reserved(device)),
            "cuda_peak": int(torch.cuda.max_memory_allocated(device))}
