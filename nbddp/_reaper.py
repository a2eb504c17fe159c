"""``python -m nbddp._reaper KERNEL_PID PIDFILE [FILE_PREFIX]``: no worker outlives its kernel.

Started by ``cluster.Workers`` in its own session (so a signal to the
kernel's process group does not reach it). Every half second it checks the
kernel; when the kernel is gone (even SIGKILLed) it kills every pid listed
in PIDFILE, and their children, and removes the session's shared-memory
files (``/dev/shm/FILE_PREFIX*``). When PIDFILE disappears (a clean
``nbddp.stop()``), it simply exits.
"""

from __future__ import annotations

import os
import sys
import time

from nbddp._proc import pid_alive


def _pids(pidfile: str) -> list[int] | None:
    try:
        with open(pidfile) as f:
            return [int(x) for x in f.read().split()]
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return []


def main(kernel_pid: int, pidfile: str, file_prefix: str = "", interval: float = 0.5) -> int:
    import psutil

    last: list[int] = []
    while True:
        pids = _pids(pidfile)
        if pids is None:
            return 0
        last = pids or last
        if not pid_alive(kernel_pid):
            break
        time.sleep(interval)
    procs = []
    for pid in last:
        try:
            p = psutil.Process(pid)
            procs += [p, *p.children(recursive=True)]
        except psutil.Error:
            pass
    for p in procs:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=3)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    try:
        os.unlink(pidfile)
    except OSError:
        pass
    if file_prefix:
        from nbddp.shipping import remove_files

        remove_files(file_prefix)
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else ""))
