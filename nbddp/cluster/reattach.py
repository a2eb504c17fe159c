"""The engines of a detached session, reached again from a new kernel (``nbddp.attach``).

The kernel that started them is gone; what it knew about the processes is
in ipyparallel's cluster file (the controller's and engines' launchers, with
their pids) and in the session record (the reaper's pid and pid file). The
``Workers`` built here own the cluster as the first kernel did: ``stop()``
ends everything, a heal may start engines, and the session's reaper, still
running, is adopted rather than started again.
"""

from __future__ import annotations

import logging
import time

from nbddp.cluster.engines import Workers, running_children
from nbddp.cluster.reaper import Reaper, pids_listed
from nbddp.cluster.slurm.watch import SlurmJobs
from nbddp.protocol.errors import ClusterError
from nbddp.protocol.host import pid_alive

CONNECT_WITHIN_S = 10.0


def reattach(cluster_file: str, connection_file: str, engine_pids: dict[int, int], reaper: tuple[int, str, str],
             engine_env: dict[str, str]) -> Workers:
    """Connect to the controller of ``cluster_file`` and take its engines over.

    ``reaper``: (pid, pid file, record path) of the session's reaper.

    Raises:
        ClusterError: the controller does not answer (it was killed): the session cannot be reached.
    """
    import ipyparallel as ipp

    try:
        cluster = ipp.Cluster.from_file(cluster_file, log_level=logging.ERROR)
        client = cluster.connect_client_sync()
    except Exception as exc:  # noqa: BLE001 - said with what it means
        raise ClusterError(f"the controller of this session does not answer ({type(exc).__name__}: {exc}); "
                           "its workers cannot be reached") from exc
    cluster.shutdown_atexit = False  # this kernel's exit must not end a detached session
    workers = Workers(cluster, client, owned=True, can_add_engines=True, connection_file=connection_file)
    workers.engine_env = dict(engine_env)
    workers.pids = dict(engine_pids)
    workers.jobs = SlurmJobs.of(cluster)
    workers.reaper = Reaper.adopt(*reaper)
    listed = pids_listed(reaper[1])  # what another process started for the session (a spare, a replacement)
    workers.inherited_pids = sorted(set(listed[0] if listed else []) - set(workers.all_pids()))
    workers.controller_helpers = running_children(getattr(cluster.controller, "process", None))
    deadline = time.monotonic() + CONNECT_WITHIN_S
    while time.monotonic() < deadline:  # the client learns the registered engines moments after connecting
        missing = sorted(set(engine_pids) - set(client.ids))
        if not missing or any(not pid_alive(engine_pids[e]) for e in missing if _local(cluster, engine_pids[e])):
            break
        time.sleep(0.02)
    missing = sorted(set(engine_pids) - set(client.ids))
    dead = [e for e in engine_pids if _local(cluster, engine_pids[e]) and not pid_alive(engine_pids[e])]
    if missing or dead:
        workers.client.close()
        lost = sorted(set(missing) | set(dead))
        raise ClusterError(f"engine(s) {lost} of this session (pid {', '.join(str(engine_pids[e]) for e in lost)}) "
                           "died while no kernel was attached")
    return workers


def _local(cluster: object, pid: int) -> bool:
    """Whether ``pid`` is an engine this host's launcher started (a remote engine's pid means nothing here)."""
    engines = getattr(cluster, "engines", None) or {}
    return any(getattr(launcher, "pid", None) == pid for es in engines.values()
               for launcher in getattr(es, "launchers", {}).values())
