"""Checkpoints: written by rank 0, atomically, loadable with plain ``torch.load``.

A checkpoint is one file ``step-00000123.pt`` holding only torch and plain
Python objects (no nbddp classes), so ``torch.load(path)`` works without
nbddp. It is written to a temporary name in the same directory, flushed to
disk, then renamed: a crash mid-write leaves a stray temporary file, never a
corrupt ``step-*.pt``. The latest checkpoint is the highest step that loads.
"""

from __future__ import annotations

import glob
import os
import random
import re
from typing import Any

import torch

KEEP = 3
_NAME = re.compile(r"step-(\d+)\.pt$")


def path_for(directory: str, step: int) -> str:
    return os.path.join(directory, f"step-{step:08d}.pt")


def rng_state() -> dict[str, Any]:
    import numpy as np

    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save(directory: str, step: int, payload: dict[str, Any], keep: int = KEEP) -> str:
    """Write ``payload`` as the checkpoint of ``step``; keep the newest ``keep``."""
    os.makedirs(directory, exist_ok=True)
    final = path_for(directory, step)
    tmp = f"{final}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    try:
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass
    for old in list_checkpoints(directory)[:-keep]:
        try:
            os.unlink(old)
        except FileNotFoundError:
            pass
    return final


def list_checkpoints(directory: str) -> list[str]:
    found = [p for p in glob.glob(os.path.join(directory, "step-*.pt")) if _NAME.search(p)]
    return sorted(found, key=lambda p: int(_NAME.search(p).group(1)))


def latest(directory: str) -> str | None:
    """The newest checkpoint in ``directory`` that loads, or ``None``."""
    for path in reversed(list_checkpoints(directory)):
        try:
            torch.load(path, map_location="cpu", weights_only=False)
            return path
        except Exception:  # noqa: BLE001 - a damaged file is skipped, the previous one is used
            continue
    return None


def resolve(resume: bool | str, directory: str | None) -> str | None:
    """The checkpoint file ``resume=`` points at (``None``: start fresh)."""
    if resume is False:
        return None
    if resume is True:
        found = latest(directory) if directory and os.path.isdir(directory) else None
        return found  # nothing yet: start fresh, as a re-run cell expects
    if os.path.isdir(resume):
        found = latest(resume)
        if found is None:
            raise FileNotFoundError(f"resume={resume!r}: no loadable step-*.pt checkpoint in that directory")
        return found
    if not os.path.isfile(resume):
        raise FileNotFoundError(f"resume={resume!r}: no such checkpoint file")
    return resume


def load(path: str) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=False)
