"""``dist_fit(profile=...)``: which steps torch.profiler traces on every rank, and with which options.

Checked in the kernel before a fit (``profile_spec``), read by every rank
(``worker/training/profiler.py``): the same schedule everywhere, so the
ranks' traces cover the same steps and merge into one timeline.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any, Mapping

from nbddp.protocol.notes import shm_dir

MINIMUM = {"wait": 0, "warmup": 0, "active": 1, "repeat": 1}


@dataclass(frozen=True)
class ProfileSpec:
    """``torch.profiler.schedule(wait, warmup, active, repeat)`` and ``torch.profiler.profile``'s options.

    ``dir``: where the merged trace is written (default: a new private temporary folder).
    """

    wait: int = 1
    warmup: int = 1
    active: int = 3
    repeat: int = 1
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    dir: str | None = None

    @property
    def steps(self) -> int:
        """Optimizer steps from the start of training to the end of the last traced one."""
        return (self.wait + self.warmup + self.active) * self.repeat


def profile_spec(value: bool | Mapping[str, Any] | None) -> ProfileSpec | None:
    """``dist_fit(profile=...)`` checked: ``None``/``False`` (off), ``True`` (the defaults) or a dict of fields.

    Raises:
        TypeError: neither a bool nor a dict, or a field of the wrong type.
        ValueError: an unknown field, or a count below its minimum.
    """
    if value is None or value is False:
        return None
    if value is True:
        return ProfileSpec()
    names = [f.name for f in fields(ProfileSpec)]
    if not isinstance(value, Mapping):
        raise TypeError(f"dist_fit(profile=...) takes True, False or a dict of {names}, got {type(value).__name__} "
                        f"{value!r}; e.g. profile=True or profile={{'wait': 1, 'warmup': 1, 'active': 5}}")
    unknown = sorted(set(value) - set(names))
    if unknown:
        raise ValueError(f"dist_fit(profile=...) has unknown key(s) {unknown}; the keys are {names}")
    for key, item in value.items():
        _check(key, item)
    return ProfileSpec(**value)


def _check(key: str, item: object) -> None:
    if key in MINIMUM:
        if isinstance(item, bool) or not isinstance(item, int):
            raise TypeError(f"dist_fit(profile={{'{key}': ...}}) must be a whole number of steps, got "
                            f"{type(item).__name__} {item!r}")
        if item < MINIMUM[key]:
            why = " (the steps traced: at least one)" if key == "active" else ""
            raise ValueError(f"dist_fit(profile={{'{key}': {item}}}): {key} must be >= {MINIMUM[key]}{why}")
    elif key == "dir":
        if item is not None and not isinstance(item, str):
            raise TypeError(f"dist_fit(profile={{'dir': ...}}) must be a folder path (str), got {type(item).__name__} "
                            f"{item!r}")
    elif not isinstance(item, bool):
        raise TypeError(f"dist_fit(profile={{'{key}': ...}}) must be True or False, got {type(item).__name__} {item!r}")


def request_path(worker_prefix: str) -> str:
    """``handle.profile``'s request file for the worker whose files are named ``worker_prefix`` (rank 0's)."""
    return os.path.join(shm_dir(), f"{worker_prefix}-profile-request")
