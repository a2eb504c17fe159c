"""The record of a detached session: one owner-only JSON file per session in the user's runtime folder.

A session started with ``nbddp.start(detach=True)`` (or detached later)
outlives its kernel; the next kernel finds it here (``nbddp.attach``), the
reaper reads it to know whether a kernel is attached and when the session
has been idle for its ``keep_alive``, and ``nbddp.sessions()`` lists them.
The kernel, the reaper (``nbddp/cluster/reaper.py``) and the ranks (the
marker and the journal below) all name the same files, so this lives in the
shared layer.

Only the user who started a session may attach to it: the folder is 0700,
every record 0600, and a record that another user owns, or that others may
read or write, is refused with a ``PermissionError`` before it is parsed
(the record names the controller's connection files, which carry its key).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import stat
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from nbddp.protocol.notes import shm_dir

DEFAULT_KEEP_ALIVE = "2h"
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)?\s*$")


@dataclass
class SessionRecord:
    """What a new kernel needs to take a detached session over, and what ``sessions()`` shows."""

    id: str
    owner_uid: int
    kernel_pid: int  # the kernel attached now; 0 while none is
    cluster_file: str  # ipyparallel's cluster file (the launchers' pids): Cluster.from_file reads it
    connection_file: str  # the controller's client connection file (its address and key), 0600
    world: int
    backend: str
    started: float  # time.time() of start()
    keep_alive_s: float
    file_prefix: str  # the session's /dev/shm files: the reaper removes them at the end
    token: str  # the session's token (the ranks' same-host check)
    reaper_pid: int = 0
    reaper_pidfile: str = ""
    slurm_job_ids: list[str] = field(default_factory=list)
    group: dict[str, Any] = field(default_factory=dict)  # the process group as the ranks joined it
    options: dict[str, Any] = field(default_factory=dict)  # start()'s settings (restart() asks for them again)
    resident: list[str] = field(default_factory=list)  # the dataset keys the ranks hold
    kept: list[str] = field(default_factory=list)  # names dist_fit(keep=...) bound, as the last kernel knew them
    running: dict[str, Any] | None = None  # the fit running when the kernel left (its id, returns, keep ...)
    caretaker_pid: int = 0  # the process driving that fit while no kernel is attached (nbddp/detached/caretaker.py)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SessionRecord:
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})


def parse_keep_alive(value: object, where: str = "start(keep_alive=...)") -> float:
    """Seconds from ``"2h"``, ``"30m"``, ``"45s"``, ``"1d"`` or a number of seconds.

    Raises:
        TypeError: not a string or a number.
        ValueError: not a duration, or not above zero ("forever" is refused: an abandoned session would hold its
            workers, and their GPUs, until someone finds it).
    """
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise TypeError(f"{where} must be a duration such as '2h', '30m' or a number of seconds, "
                        f"got {type(value).__name__} {value!r}")
    if isinstance(value, str):
        match = _DURATION.match(value.lower())
        if match is None:
            raise ValueError(f"{where}: {value!r} is not a duration; write it as '2h', '30m', '90s', '1d' or a number "
                             "of seconds (there is no 'forever': an abandoned session must end; pass a long one, "
                             "e.g. '7d', and end it with nbddp.stop() from an attached kernel)")
        seconds = float(match.group(1)) * _UNITS[match.group(2) or "s"]
    else:
        seconds = float(value)
    if not seconds > 0 or seconds != seconds or seconds == float("inf"):
        raise ValueError(f"{where}: {value!r} must be above zero and finite, such as '2h' (the default) or '30m'")
    return seconds


def runtime_dir() -> str:
    """The folder of the records: ``$NBDDP_RUNTIME_DIR``, else Jupyter's runtime folder's ``nbddp/``; made 0700."""
    base = os.environ.get("NBDDP_RUNTIME_DIR")
    if not base:
        try:
            from jupyter_core.paths import jupyter_runtime_dir

            base = os.path.join(jupyter_runtime_dir(), "nbddp")
        except ImportError:
            base = os.path.join(os.environ.get("XDG_RUNTIME_DIR") or os.path.expanduser("~/.local/share"), "nbddp")
    try:
        os.makedirs(base, mode=0o700, exist_ok=True)
    except PermissionError as e:
        raise PermissionError(f"the session records' folder {base} cannot be created by uid {os.getuid()}: {e}. "
                              "Only the user who started a detached session can attach to it.") from None
    check_owned(base, "the session records' folder")
    return base


def check_owned(path: str, what: str) -> os.stat_result:
    """Refuse ``path`` unless this user owns it and no one else may read or write it."""
    try:
        st = os.stat(path)
    except PermissionError:
        raise PermissionError(f"{what} {path} cannot be read by uid {os.getuid()}: it belongs to another user. "
                               "Only the user who started a detached session can attach to it.") from None
    if st.st_uid != os.getuid():
        raise PermissionError(f"{what} {path} belongs to uid {st.st_uid}, not to uid {os.getuid()} (this process): "
                              "only the user who started a detached session can attach to it.")
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise PermissionError(f"{what} {path} has mode {stat.S_IMODE(st.st_mode):o}, which lets others read it; "
                              f"nbddp makes it owner-only (chmod go-rwx {path}) and refuses it otherwise")
    return st


def record_path(session_id: str, folder: str | None = None) -> str:
    return os.path.join(folder or runtime_dir(), f"session-{session_id}.json")


def new_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3)


def write(record: SessionRecord, folder: str | None = None) -> str:
    """Replace the record atomically, owner-only (a reader sees the old or the new one); its path."""
    path = record_path(record.id, folder)
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(record.to_json(), f)
    os.replace(tmp, path)
    return path


def read(path: str) -> SessionRecord | None:
    """The record at ``path`` (None once removed); ``PermissionError`` for one this user may not trust."""
    try:
        check_owned(path, "the session record")
        with open(path) as f:
            return SessionRecord.from_json(json.load(f))
    except FileNotFoundError:
        return None
    except ValueError:  # half-written by a process killed in the middle (the replace is atomic, so: not ours)
        return None


def all_records(folder: str | None = None) -> list[tuple[str, SessionRecord]]:
    """Every readable record of this user, oldest first."""
    folder = folder or runtime_dir()
    found = []
    for name in sorted(os.listdir(folder)):
        if name.startswith("session-") and name.endswith(".json"):
            path = os.path.join(folder, name)
            try:
                record = read(path)
            except PermissionError:
                continue  # not this user's: never listed, never attached
            if record is not None:
                found.append((path, record))
    return sorted(found, key=lambda item: item[1].started)


def remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def remove_session(path: str) -> None:
    """The record and every file kept beside it for the session (``session-<id>-*``: a fit's loggers)."""
    import glob

    for beside in glob.glob(glob.escape(path[:-len(".json")]) + "-*"):
        remove(beside)
    remove(path)


def detached_marker(file_prefix: str) -> str:
    """The file whose presence tells a rank on this host that its session outlives the kernel."""
    return os.path.join(shm_dir(), f"{file_prefix}-detached")


def journal_path(file_prefix: str) -> str:
    """Rank 0's journal of the fit that runs in a detached session: every record so far, pickled, owner-only."""
    return os.path.join(shm_dir(), f"{file_prefix}-journal")


def fit_note_path(file_prefix: str) -> str:
    """Rank 0's small JSON note beside the journal: the fit's id and ``status`` ("running", then "ended")."""
    return os.path.join(shm_dir(), f"{file_prefix}-fitnote")
