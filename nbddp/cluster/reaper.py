"""``python -m nbddp.cluster.reaper KERNEL_PID PIDFILE [FILE_PREFIX]``: no worker outlives its kernel.

``Reaper`` is the kernel's handle on that process. It is started by
``nbddp.cluster.engines.Workers`` in its own session (so a signal to the
kernel's process group does not reach it). Every half second it checks the
kernel; when the kernel is gone (even SIGKILLed) it kills every pid listed
in PIDFILE, and their children, cancels the Slurm jobs listed there
(``slurm:JOBID`` lines: engines on other machines that no local kill
reaches), and removes the session's shared-memory files
(``/dev/shm/FILE_PREFIX*``) and its Inductor cache on this host
(``/tmp/FILE_PREFIX-inductor``, ``dist_fit(compile=...)``). When PIDFILE disappears (a clean
``nbddp.stop()``), it simply exits.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

from nbddp.protocol.host import pid_alive
from nbddp.protocol.notes import shm_dir

SLURM_PREFIX = "slurm:"  # a PIDFILE line naming a Slurm job to cancel


class Reaper:
    """The kernel's side: start the reaper, keep its pid file current, stop it.

    Engines also watch the kernel themselves (``worker/tasks/probe.py``); the reaper
    covers the controller and engines that never got that far.
    """

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None
        self.pidfile: str | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def start(self, pids: list[int], file_prefix: str = "", jobs: Sequence[str] = ()) -> None:
        fd, self.pidfile = tempfile.mkstemp(prefix="nbddp-pids-")
        os.close(fd)
        self.update(pids, jobs)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "nbddp.cluster.reaper", str(os.getpid()), self.pidfile, file_prefix],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def update(self, pids: list[int], jobs: Sequence[str] = ()) -> None:
        """Replace the list of pids to kill (and Slurm jobs to cancel) if the kernel dies."""
        if self.pidfile:
            tmp = self.pidfile + ".tmp"
            with open(tmp, "w") as f:
                f.write("\n".join([*(str(p) for p in pids), *(f"{SLURM_PREFIX}{j}" for j in jobs)]))
            os.replace(tmp, self.pidfile)

    def stop(self) -> None:
        """A clean stop: removing the pid file tells the reaper to exit."""
        if self.pidfile:
            try:
                os.unlink(self.pidfile)
            except FileNotFoundError:
                pass
            self.pidfile = None
        if self.process is not None:
            try:
                self.process.wait(timeout=3)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            self.process = None


def _pids(pidfile: str) -> tuple[list[int], list[str]] | None:
    """(pids, Slurm job ids) listed in ``pidfile``; None once it is gone."""
    try:
        with open(pidfile) as f:
            words = f.read().split()
    except FileNotFoundError:
        return None
    except OSError:
        return [], []
    jobs = [w[len(SLURM_PREFIX):] for w in words if w.startswith(SLURM_PREFIX)]
    return [int(w) for w in words if w.isdigit()], jobs


def main(kernel_pid: int, pidfile: str, file_prefix: str = "", interval: float = 0.5) -> int:
    import psutil

    last: list[int] = []
    jobs: list[str] = []
    while True:
        listed = _pids(pidfile)
        if listed is None:  # a clean stop; the probe's token file goes too, should a kill have interrupted a probe
            if file_prefix:
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(shm_dir(), f"{file_prefix}-probe"))
            return 0
        last, jobs = (listed if listed[0] or listed[1] else (last, jobs))
        if not pid_alive(kernel_pid):
            break
        time.sleep(interval)
    if jobs:  # first: the job's engines run elsewhere, and this is the only way to them
        from nbddp.cluster.slurm.queue import cancel

        cancel(jobs)
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
        from nbddp.shipping.shm_files import remove_files

        remove_files(file_prefix)
        import shutil

        from nbddp.protocol.compile_settings import session_cache_dir

        shutil.rmtree(session_cache_dir(file_prefix), ignore_errors=True)  # dist_fit(compile=...)'s Inductor cache
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else ""))
