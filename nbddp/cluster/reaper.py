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

A detached session (``record:PATH`` in PIDFILE, ``nbddp.start(detach=True)``)
outlives its kernel: the reaper then waits while a kernel is attached or a
fit runs, and ends the session the same way once it has been idle for its
``keep_alive`` (``nbddp/cluster/idle_watch.py``), removing its record too.
A kernel that attaches adopts this reaper (``Reaper.adopt``) instead of
starting another.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

from nbddp.cluster.idle_watch import RECORD_PREFIX, record_line, wait_unused
from nbddp.protocol.host import pid_alive
from nbddp.protocol.notes import shm_dir
from nbddp.protocol.session_record import remove_session

SLURM_PREFIX = "slurm:"  # a PIDFILE line naming a Slurm job to cancel


class Reaper:
    """The kernel's side: start the reaper, keep its pid file current, stop it.

    Engines also watch the kernel themselves (``worker/tasks/probe.py``); the reaper
    covers the controller and engines that never got that far.
    """

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None
        self.pidfile: str | None = None
        self.record: str | None = None  # the session record's path once detached
        self.adopted_pid: int | None = None  # a reaper another kernel started (this kernel attached)
        self._last: tuple[list[int], list[str]] = ([], [])

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else self.adopted_pid

    @classmethod
    def adopt(cls, pid: int, pidfile: str, record: str) -> "Reaper":
        """The running reaper of a detached session this kernel attached to: updated and stopped as if started here."""
        reaper = cls()
        reaper.adopted_pid, reaper.pidfile, reaper.record = pid, pidfile, record
        return reaper

    def detach(self, record: str) -> None:
        """From now on the session outlives the kernel: the reaper watches ``record`` instead of the kernel."""
        self.record = record
        self.update(*self._last)

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
        self._last = (list(pids), list(jobs))
        if self.pidfile:
            tmp = self.pidfile + ".tmp"
            record = [f"{RECORD_PREFIX}{self.record}"] if self.record else []
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write("\n".join([*(str(p) for p in pids), *(f"{SLURM_PREFIX}{j}" for j in jobs), *record]))
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
        if self.adopted_pid is not None:  # not our child: wait for it to see the pid file gone
            deadline = time.monotonic() + 3
            while pid_alive(self.adopted_pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if pid_alive(self.adopted_pid):
                with contextlib.suppress(OSError):
                    os.kill(self.adopted_pid, 9)
            self.adopted_pid = None


def pids_listed(pidfile: str) -> tuple[list[int], list[str]] | None:
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
    last: list[int] = []
    jobs: list[str] = []
    while True:
        listed = pids_listed(pidfile)
        if listed is None:  # a clean stop; the probe's token file goes too, should a kill have interrupted a probe
            if file_prefix:
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(shm_dir(), f"{file_prefix}-probe"))
            return 0
        last, jobs = (listed if listed[0] or listed[1] else (last, jobs))
        if not pid_alive(kernel_pid):
            record = record_line(pidfile)
            if record is None:
                break
            if not wait_unused(pidfile, record, file_prefix, interval):
                return 0  # an attached kernel stopped the session cleanly
            listed = pids_listed(pidfile)  # (an attached kernel may have replaced engines meanwhile)
            last, jobs = listed if listed is not None and (listed[0] or listed[1]) else (last, jobs)
            remove_session(record)  # the record and what was kept beside it
            break
        time.sleep(interval)
    _end_session(last, jobs, pidfile, file_prefix)
    return 0


def _end_session(last: list[int], jobs: list[str], pidfile: str, file_prefix: str) -> None:
    """What the kernel's death (or a detached session's idle end) leaves: nothing, on this host and in Slurm."""
    import psutil

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


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else ""))
