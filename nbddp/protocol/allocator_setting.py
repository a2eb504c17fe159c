"""``NBDDP_MALLOC`` and the other settings that decide whether a worker's C allocator is tuned.

Read in the kernel, before engines start (a bad value fails at once, not
seconds later on every engine), and on the workers, where
``worker/memory/allocator.py`` applies the tuning.
"""

from __future__ import annotations

import os
import platform

OPT_OUT = "NBDDP_MALLOC"
OFF = ("default", "off", "0", "no", "false")
ON = ("tuned", "on", "1", "yes", "true")
_USER_KNOBS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")


def reason_to_leave_alone(environ: os._Environ | dict[str, str] = os.environ) -> str | None:
    """Why this process's allocator should not be tuned, or None."""
    choice = environ.get(OPT_OUT, "").strip().lower()
    if choice in OFF:
        return f"{OPT_OUT}={environ[OPT_OUT]}"
    if choice not in ("", *ON):
        raise ValueError(
            f"{OPT_OUT}={environ[OPT_OUT]!r} is not understood; set it to 'default' to leave the C allocator "
            f"as it is, or unset it to let nbddp tune it (accepted: {', '.join(OFF)} to leave it; {', '.join(ON)} "
            "or unset to tune it)"
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
