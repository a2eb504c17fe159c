"""How an engine process ended, in words a person can act on.

ipyparallel's launcher reaps its engines in a thread; these helpers read the
exit status it recorded (or reap it), turn it into "killed by signal 9
(SIGKILL) (killed: kill -9, or the out-of-memory killer)", and read the tail
of the engine's log.
"""

from __future__ import annotations

import os
import signal
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ipyparallel.cluster.launcher import BaseLauncher


def exit_code(launcher: BaseLauncher, wait_s: float = 2.0) -> int | None:
    """The exit status of a launched engine (negative: killed by that signal), or None.

    ipyparallel's launcher reaps its process in a thread through
    ``psutil.Process.wait``, which caches the status; ``Popen.poll`` would
    then report a wrong ``0``. So read psutil's status, waiting briefly for
    the reaper thread, and reap it ourselves if that thread is not running.
    """
    import psutil

    proc = getattr(launcher, "process", None)
    if proc is None:
        return None
    deadline = time.monotonic() + wait_s
    while True:
        code = getattr(proc, "_exitcode", None)
        if isinstance(code, int):
            return int(code)
        thread = getattr(launcher, "_wait_thread", None)
        if thread is None or not thread.is_alive():
            try:
                code = proc.wait(timeout=0.05)
            except psutil.TimeoutExpired:
                code = None
            except psutil.Error:
                return None
            if isinstance(code, int):
                return int(code)
        if time.monotonic() > deadline:
            return None
        time.sleep(0.02)


def describe_exit(code: int | None) -> str:
    if code is None:
        return "died (still exiting, or exit status not yet known)"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "?"
        hint = {"SIGKILL": " (killed: kill -9, or the out-of-memory killer)", "SIGSEGV": " (segmentation fault)",
                "SIGABRT": " (aborted)"}.get(name, "")
        return f"killed by signal {-code} ({name}){hint}"
    return f"exited with status {code}"


def read_tail(path: str, lines: int = 20) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 16384))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])
