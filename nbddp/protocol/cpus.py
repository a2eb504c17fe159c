"""The CPUs a process may run on, as containers and Slurm limit them: read on each engine's own host.

``os.cpu_count()`` counts the host's cores. A container (``--cpus=2``) or a
Slurm step (``--cpus-per-task``) allows fewer, through the affinity mask or
the cgroup's CPU quota; sizing thread pools by the host's count
oversubscribes them. The kernel uses this for the engines it starts on its
host; every engine uses it again when it joins the group
(``worker/tasks/process_group.py``), on its own host, divided by the ranks
on that host. No dependencies.
"""

from __future__ import annotations

import os


def threads_for(ranks_on_host: int) -> int:
    """CPU threads for one of ``ranks_on_host`` workers sharing this host's usable CPUs (at least 1)."""
    return max(1, usable_cpus() // max(1, ranks_on_host))


def usable_cpus(cgroup_root: str = "/sys/fs/cgroup", self_cgroup: str = "/proc/self/cgroup") -> int:
    """The CPUs this process may run on: its affinity mask, capped by its cgroup's CPU quota.

    ``os.cpu_count()`` counts the host's cores. A container (``--cpus=2``) or a
    Slurm step (``--cpus-per-task``) allows fewer, through the affinity mask
    or the cgroup's quota; sizing thread pools by the host's count
    oversubscribes them. The engines inherit the kernel's limits on its host.
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroup_root, self_cgroup)
    if quota is not None:
        cpus = min(cpus, max(1, int(quota)))  # 1.5 CPUs of quota: one thread that never waits for its share
    return max(1, cpus)


def cgroup_cpu_quota(cgroup_root: str = "/sys/fs/cgroup", self_cgroup: str = "/proc/self/cgroup") -> float | None:
    """The cgroup's CPU quota in CPUs (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``), or None when there is none.

    The process's own cgroup is read first (``/proc/self/cgroup``), then the
    root of the hierarchy (what a container sees as its own).
    """
    v2, v1 = "", ""
    try:
        with open(self_cgroup) as f:
            for line in f.read().splitlines():
                _, controllers, path = line.split(":", 2)
                if controllers == "":
                    v2 = path
                elif "cpu" in controllers.split(","):
                    v1 = path
    except (OSError, ValueError):
        pass
    for folder in dict.fromkeys([os.path.join(cgroup_root, v2.lstrip("/")), cgroup_root]):
        quota = _quota(os.path.join(folder, "cpu.max"), None)
        if quota is not None:
            return quota
    for folder in dict.fromkeys([os.path.join(cgroup_root, "cpu", v1.lstrip("/")), os.path.join(cgroup_root, "cpu")]):
        quota = _quota(os.path.join(folder, "cpu.cfs_quota_us"), os.path.join(folder, "cpu.cfs_period_us"))
        if quota is not None:
            return quota
    return None


def _quota(limit_file: str, period_file: str | None) -> float | None:
    """``cpu.max`` ("max 100000" or "150000 100000"), or v1's quota and period files (-1: no limit)."""
    try:
        with open(limit_file) as f:
            words = f.read().split()
        if period_file is not None:
            with open(period_file) as f:
                words = words[:1] + f.read().split()[:1]
        limit, period = words[0], int(words[1])
        return None if limit == "max" or int(limit) <= 0 else int(limit) / period
    except (OSError, ValueError, IndexError):
        return None
