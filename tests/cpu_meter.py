"""Each test's CPU seconds, its engines and kernels included: ``NBDDP_CPU_LOG=run.cpu bash scripts/test.sh``.

The suite is bound by its CPU on a 2-core machine, so what a test costs is
its CPU, not its wall time (which depends on what the other test process
does meanwhile). With ``NBDDP_CPU_LOG`` set (root, cgroup v1's ``cpuacct``
mounted), each test process moves itself into a cgroup of its own; every
process it starts (engines, controllers, Jupyter kernels, a private Slurm)
inherits it. Around each test the group's ``cpuacct.usage`` is read, and a
JSON line per test is appended to ``<NBDDP_CPU_LOG>.<xdist worker>``:
the test's node id, its CPU seconds (set-up, call and tear-down) and wall
seconds. ``scripts/cpu_table.py`` sums them by file and by marker
(docs/contributing.md, "Where the time goes").
"""

from __future__ import annotations

import atexit
import json
import os
import time

CPUACCT = "/sys/fs/cgroup/cpuacct"


class CpuMeter:
    """A pytest plugin: the CPU of this test process's cgroup, per test."""

    def __init__(self, log: str):
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        self.path = f"{log}.{worker}"
        self.group = os.path.join(CPUACCT, f"nbddp-suite-{os.getpid()}")
        os.makedirs(self.group, exist_ok=True)
        with open(os.path.join(self.group, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
        self.start: tuple[float, float] | None = None
        self.out = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - open for the whole run

    def usage(self) -> float:
        with open(os.path.join(self.group, "cpuacct.usage")) as f:
            return int(f.read()) / 1e9

    def pytest_runtest_logstart(self, nodeid: str, location: object) -> None:
        self.start = (self.usage(), time.monotonic())

    def pytest_runtest_logfinish(self, nodeid: str, location: object) -> None:
        if self.start is None:
            return
        cpu, wall = self.usage() - self.start[0], time.monotonic() - self.start[1]
        self.out.write(json.dumps({"test": nodeid, "cpu_s": round(cpu, 3), "wall_s": round(wall, 3)}) + "\n")
        self.out.flush()

    def pytest_unconfigure(self) -> None:
        self.out.close()
        with open(os.path.join(CPUACCT, "cgroup.procs"), "w") as f:  # back to the root group, so ours can go
            f.write(str(os.getpid()))
        atexit.register(self.remove)  # after the session's own atexit has stopped the workers (LIFO)

    def remove(self) -> None:
        """The group goes once the last process of the run in it has exited (the workers stop at exit)."""
        deadline = time.monotonic() + 5.0
        while True:
            try:
                os.rmdir(self.group)
                return
            except OSError:
                if time.monotonic() > deadline:
                    return  # a process outlived the run: the leak check named it; the empty group goes with it
                time.sleep(0.05)


def maybe_register(config: object) -> None:
    """Register the meter when ``NBDDP_CPU_LOG`` is set and the cgroup can be made."""
    log = os.environ.get("NBDDP_CPU_LOG")
    if not log or (getattr(config.option, "numprocesses", None) and "PYTEST_XDIST_WORKER" not in os.environ):  # type: ignore[attr-defined]
        return  # (pytest-xdist's controller runs no test: it only relays its workers' reports)
    if not os.access(CPUACCT, os.W_OK):
        raise RuntimeError(f"NBDDP_CPU_LOG={log}: {CPUACCT} is not writable here (run as root with cgroup v1's "
                           "cpuacct mounted), or leave NBDDP_CPU_LOG unset")
    config.pluginmanager.register(CpuMeter(log), "nbddp-cpu-meter")  # type: ignore[attr-defined]
