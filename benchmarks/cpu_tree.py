"""CPU seconds of this process and every process it started, by role: what a benchmark's side costs the machine.

On 2 cores with a busy worker on each, every CPU-second that the kernel
(this process), the ipyparallel controller (hub and schedulers) or an
engine's non-training threads spend is taken from training; with 1 worker
the same work runs on the idle second core for free. ``snapshot()`` reads
utime+stime from ``/proc/<pid>/stat`` for this process and its descendants
(and, for this process, per thread, so the sweep's schedule thread shows
apart from the client's IO thread); ``spent(before, after)`` gives the
seconds each role used in between. Linux only (``/proc``); elsewhere the
snapshot is empty and so is the difference.
"""

from __future__ import annotations

import os
from typing import Any

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(path: str) -> tuple[int, float] | None:
    """(parent pid, utime+stime in seconds) from a ``stat`` file, or None if it is gone."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()  # after "pid (comm) ": state ppid ... utime(11) stime(12)
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICK


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def role(pid: int, cmdline: str) -> str:
    """What an ipyparallel process is, from its command line: engine, nanny, controller; else ``other``."""
    if pid == os.getpid():
        return "kernel"
    if "ipengine" in cmdline or "ipyparallel.engine" in cmdline:
        return "nanny" if "nanny" in cmdline else "engine"
    if "nanny" in cmdline:
        return "nanny"
    if "ipcontroller" in cmdline or "ipyparallel.controller" in cmdline or "ipyparallel.apps.ipcontrollerapp" \
            in cmdline:
        return "controller"
    return "other"


def snapshot() -> dict[str, Any]:
    """``{"procs": {pid: (role, cpu_s)}, "threads": {thread name: cpu_s}}`` for this process and its descendants."""
    if not os.path.isdir("/proc"):
        return {"procs": {}, "threads": {}}
    parent_of, cpu = {}, {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            got = _stat(f"/proc/{name}/stat")
            if got is not None:
                parent_of[int(name)], cpu[int(name)] = got
    mine, frontier = {os.getpid()}, [os.getpid()]
    while frontier:
        children = [p for p, parent in parent_of.items() if parent in frontier and p not in mine]
        mine.update(children)
        frontier = children
    procs = {p: (role(p, _cmdline(p)), cpu[p]) for p in mine if p in cpu}
    side = {p: _other_threads(p) for p, (name, _) in procs.items() if name == "engine"}
    import threading

    names = {t.native_id: t.name for t in threading.enumerate()}  # Python's names (the OS's are all "python")
    threads: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{os.getpid()}/task"):
        got = _stat(f"/proc/{os.getpid()}/task/{tid}/stat")
        if got is not None:
            name = names.get(int(tid), "native")  # torch's, zmq's and other threads Python did not start
            threads[name] = threads.get(name, 0.0) + got[1]
    return {"procs": procs, "threads": threads, "engine_side_threads": side}


def _other_threads(pid: int) -> float:
    """CPU seconds of a process's threads other than its main one (an engine trains on its main thread; the
    others are its zmq IO, heartbeat, iopub and nbddp's monitor threads)."""
    total = 0.0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    for tid in tids:
        if int(tid) != pid:
            got = _stat(f"/proc/{pid}/task/{tid}/stat")
            total += got[1] if got is not None else 0.0
    return total


def spent(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """CPU seconds each role used between two snapshots (processes that started in between count from 0), and the
    kernel's threads; ``engines`` lists each engine's own seconds, largest first."""
    by_role: dict[str, float] = {}
    engines = []
    for pid, (name, cpu_s) in after["procs"].items():
        used = cpu_s - before["procs"].get(pid, (name, 0.0))[1]
        by_role[name] = by_role.get(name, 0.0) + used
        if name == "engine":
            engines.append(used)
    threads = {t: s - before["threads"].get(t, 0.0) for t, s in after["threads"].items()}
    # a thread that ended in between (the sweep's schedule thread) is gone from /proc; the process keeps its time
    threads["ended threads"] = by_role.get("kernel", 0.0) - sum(threads.values())
    side = sum(s - before.get("engine_side_threads", {}).get(p, 0.0) for p, s in after["engine_side_threads"].items())
    return {"roles": by_role, "engines": sorted(engines, reverse=True), "engine_side_threads": side,
            "kernel_threads": {t: s for t, s in sorted(threads.items(), key=lambda kv: -kv[1]) if s > 0}}
