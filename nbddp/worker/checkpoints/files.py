"""Checkpoints: written by rank 0, atomically, loadable with plain ``torch.load``.

A checkpoint is one file ``step-00000123.pt`` holding only torch and plain
Python objects (no nbddp classes), so ``torch.load(path)`` works without
nbddp, even with its default ``weights_only=True`` (the numpy RNG state is
stored as a tensor, not an array), and nbddp reads it that way too
(``trust.py``): a file that needs more is refused unless trusted. It is written to a temporary name in the
same directory, flushed to disk, then renamed: a crash mid-write leaves a
stray temporary file (removed by the next save), never a corrupt
``step-*.pt``. The latest checkpoint is the highest step whose file is a
complete archive.
"""

from __future__ import annotations

import glob
import os
import random
import re
import zipfile
from typing import Any

import torch

from nbddp.protocol.host import pid_alive
from nbddp.worker.checkpoints import trust

KEEP = 3
_NAME = re.compile(r"step-(\d+)(\.pt)?$")  # a file (DDP: rank 0 writes it) or a directory (FSDP: every rank writes)
_TMP = re.compile(r"step-\d+\.pt\.tmp-(\d+)$")


SHARDED_LOOP_FILE = "loop.pt"  # in a sharded checkpoint's directory: the loop's own state
SHARDED_METADATA = ".metadata"  # torch.distributed.checkpoint's index, written last


def is_sharded(path: str) -> bool:
    """A finished sharded checkpoint directory (``worker/checkpoints/sharded.py``)."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, SHARDED_METADATA)) and \
        os.path.isfile(os.path.join(path, SHARDED_LOOP_FILE))


def sharded_files(path: str) -> set[str] | None:
    """Every file a load of the sharded checkpoint ``path`` may read: ``.metadata``, ``loop.pt`` and the rank
    files ``.metadata`` names (None: no readable ``.metadata``). Across hosts a folder may hold only some of
    them (``shard_copies.py``), so a folder is whole only when all are there."""
    import pickle

    try:  # a folder given as resume=... may be anyone's: read without running code (trust.py)
        metadata = trust.read_metadata(os.path.join(path, SHARDED_METADATA))
    except (OSError, EOFError, pickle.UnpicklingError):
        return None
    return {info.relative_path for info in metadata.storage_data.values()} | {SHARDED_METADATA, SHARDED_LOOP_FILE}


def write_private(final: str, data: Any, tmp_marker: str = ".tmp-") -> None:
    """``data`` (bytes-like) as ``final``, 0600 whatever the umask, under ``final + tmp_marker + pid`` until whole:
    a reader never sees part of it (the peer copies of a snapshot's files, ``peer_copies``, ``shard_copies``)."""
    tmp = f"{final}{tmp_marker}{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, final)


def path_for(directory: str, step: int) -> str:
    return os.path.join(directory, f"step-{step:08d}.pt")


def dir_for(directory: str, step: int) -> str:
    """Where a sharded checkpoint of ``step`` goes (``worker/checkpoints/sharded.py``)."""
    return os.path.join(directory, f"step-{step:08d}")


def rng_state() -> dict[str, Any]:
    import numpy as np

    legacy = np.random.get_state()
    if not isinstance(legacy, tuple):  # a dict: np.random's RandomState was replaced by one over another generator
        raise RuntimeError(f"np.random's global generator runs on {legacy.get('bit_generator')}, not MT19937, and a "
                           "checkpoint saves its state in the MT19937 form; keep np.random's global RandomState as "
                           "numpy made it, and use np.random.default_rng(...) for another bit generator")
    kind, keys, pos, has_gauss, cached = legacy
    numpy_state = (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached))
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": numpy_state}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    keys = keys.numpy().astype(np.uint32) if isinstance(keys, torch.Tensor) else keys
    np.random.set_state((kind, keys, pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save(directory: str, step: int, payload: dict[str, Any], keep: int = KEEP, private: bool = False) -> str:
    """Write ``payload`` as the checkpoint of ``step``; keep the newest ``keep``.

    ``private``: the file is 0600 whatever the process's umask (a snapshot, written by a thread that cannot
    change the umask for the whole process).
    """
    os.makedirs(directory, mode=0o700 if private else 0o777, exist_ok=True)
    _remove_stale_temporaries(directory)
    final = path_for(directory, step)
    tmp = f"{final}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o666)
    with os.fdopen(fd, "wb") as f:
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
    prune(directory, keep)
    return final


def prune(directory: str, keep: int = KEEP) -> None:
    """Keep the newest ``keep`` checkpoints, files and directories alike."""
    import shutil

    for old in list_checkpoints(directory)[:-keep]:
        if os.path.isdir(old):
            shutil.rmtree(old, ignore_errors=True)
        else:
            try:
                os.unlink(old)
            except FileNotFoundError:
                pass


def _remove_stale_temporaries(directory: str) -> None:
    """Delete temporaries left by a writer that died mid-save (its pid is gone)."""
    for path in glob.glob(os.path.join(directory, "step-*.pt.tmp-*")):
        match = _TMP.search(path)
        if not match:
            continue
        pid = int(match.group(1))
        if pid != os.getpid() and pid_alive(pid):
            continue
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def is_complete(path: str) -> bool:
    """Whether ``path`` is a whole checkpoint: a ``torch.save`` archive whose zip directory reads, or a finished sharded one."""
    if os.path.isdir(path):
        needs = sharded_files(path) if is_sharded(path) else None
        return needs is not None and all(os.path.isfile(os.path.join(path, name)) for name in needs)
    try:
        with zipfile.ZipFile(path) as archive:
            return bool(archive.namelist())
    except (OSError, zipfile.BadZipFile):
        return False


def list_checkpoints(directory: str) -> list[str]:
    found = [p for p in glob.glob(os.path.join(directory, "step-*")) if _NAME.search(p)]
    return sorted(found, key=step_of)


def step_of(path: str) -> int:
    """The step a checkpoint's name says (``step-00000123.pt`` or a sharded ``step-00000123`` folder)."""
    named = _NAME.search(path)
    if named is None:
        raise ValueError(f"{path!r} is not named as an nbddp checkpoint (step-00000123.pt, or a step-00000123 "
                         "folder); its step cannot be read from its name")
    return int(named.group(1))


def whole(directory: str | None) -> dict[int, str]:
    """The complete checkpoints in ``directory`` by step (none when it is unset or absent)."""
    if not directory or not os.path.isdir(directory):
        return {}
    return {step_of(p): p for p in list_checkpoints(directory) if is_complete(p)}


def latest(directory: str) -> str | None:
    """The newest complete checkpoint in ``directory``, or ``None`` (a damaged file is skipped)."""
    for path in reversed(list_checkpoints(directory)):
        if is_complete(path):
            return path
    return None


def resolve(resume: bool | str, directory: str | None) -> str | None:
    """The checkpoint file ``resume=`` points at (``None``: start fresh)."""
    if resume is False:
        return None
    if resume is True:
        found = latest(directory) if directory and os.path.isdir(directory) else None
        return found  # nothing yet: start fresh, as a re-run cell expects
    if os.path.isdir(resume) and is_complete(resume):
        return resume  # one sharded checkpoint
    if os.path.isdir(resume):
        found = latest(resume)
        if found is None:
            raise FileNotFoundError(f"resume={resume!r}: no loadable step-*.pt checkpoint in that directory")
        return found
    if not os.path.isfile(resume):
        raise FileNotFoundError(f"resume={resume!r}: no such checkpoint file")
    return resume


def load(path: str) -> dict[str, Any]:
    """Read a checkpoint written by ``save``: with ``weights_only=True`` unless ``trust.py`` trusts the file.

    Raises:
        UntrustedCheckpointError: the file needs a full unpickle, and the person did not trust it.
    """
    if os.path.isdir(path):
        raise ValueError(f"resume={path!r} is a sharded checkpoint (a directory written by strategy='fsdp'); resume it "
                         "with strategy='fsdp', or turn it into one file with nbddp.export_checkpoint(path, out)")
    state = trust.load_file(path)
    missing = [k for k in ("model", "optimizer", "step", "epoch") if not isinstance(state, dict) or k not in state]
    if missing:
        raise ValueError(
            f"resume={path!r} is not an nbddp checkpoint (missing {missing}); pass a step-*.pt file that "
            "dist_fit(checkpoint_dir=...) wrote, or the directory holding them"
        )
    return state
