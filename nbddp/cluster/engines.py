"""ipyparallel engines: start, attach, probe, kill, replace, stop.

Everything about *processes* lives here; what the processes *mean* (ranks,
process groups) lives in ``session/`` and ``protocol/placement.py``.

Facts this module is built on (``docs/ipyparallel-notes.md``, "Engines"): per-engine stop or
restart is not implemented, so a broken engine is killed by pid (through the
nanny, which also works on other hosts) and a new engine set is started
beside the survivors; engine ids change, so nothing here assumes ``range(n)``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import time
from typing import TYPE_CHECKING, Any

from nbddp.cluster.reaper import Reaper
from nbddp.cluster.unregister import unregister
from nbddp.cluster.attach import attach_files
from nbddp.protocol.errors import ClusterError
from nbddp.protocol.host import pid_alive
from nbddp.cluster.engine_exits import describe_exit, exit_code, read_tail
from nbddp.cluster.iopub_guard import harden
from nbddp.cluster.slurm.queue import JobState
from nbddp.cluster.slurm.watch import JobShow, SlurmJobs

if TYPE_CHECKING:
    import psutil
    from ipyparallel import Client, Cluster
    from ipyparallel.cluster.launcher import BaseLauncher

START_TIMEOUT_S = 120.0
CONNECT_TIMEOUT_S = 10.0  # ipyparallel's own default for reaching a controller
HEARTBEAT_MS = 1000
CONTROLLER_CHECK_TIMEOUT_S = 2.0

__all__ = ["ClusterError", "Workers"]


class Workers:
    """The engines of one session and how to reach them.

    ``owned``: nbddp started this cluster, so it may stop it and start
    replacement engines. Attached clusters (``profile=``/``cluster_id=``, or
    a ``cluster=`` object already running) are never stopped by nbddp.
    """

    def __init__(self, cluster: Cluster | None, client: Client, owned: bool, can_add_engines: bool,
                 connection_file: str = ""):
        self.cluster = cluster
        self.client = client
        harden(client)  # one output message ipyparallel cannot handle must not stop all later output
        self.owned = owned
        self.can_add_engines = can_add_engines
        self.connection_file = connection_file  # the controller's client connection file (its address)
        self.engine_env: dict[str, str] = {}  # given to every engine this session launches
        self.pids: dict[int, int] = {}  # engine id -> pid, as the engines reported it (session's probes)
        self.reaper = Reaper()
        self._launched: dict[int, BaseLauncher] = {}  # pid -> launcher, kept after ipyparallel forgets a dead one
        self.controller_helpers: list[psutil.Process] = []  # the controller's schedulers (owned clusters)
        # a detached session's processes another process started (a spare, a caretaker's replacement), as its
        # reaper lists them: this process's launchers do not know them, and stop() must end them all the same
        self.inherited_pids: list[int] = []
        self._endpoint: tuple[str, int] | None = None  # read from the connection file once it could be read
        self.jobs: SlurmJobs | None = None  # the Slurm jobs holding the engines (engines="slurm" clusters)
        # an elastic fit's warm spare engine (nbddp/elastic/spare.py) is registered but no rank until a heal takes
        # it; while one is being started, only the engines registered before it count (``spare_baseline``)
        self.spare_ids: set[int] = set()
        self.spare_baseline: set[int] | None = None

    # ---- construction ---------------------------------------------------
    @classmethod
    def start(cls, n: int, cluster: Cluster | None = None, timeout: float = START_TIMEOUT_S, file_prefix: str = "",
              engine_env: dict[str, str] | None = None, queue_timeout: float | None = None,
              show: JobShow | None = None) -> "Workers":
        """Start ``n`` local engines, or start the given ``ipyparallel.Cluster``.

        ``engine_env`` is added to the engines' environment at launch (thread
        counts must be set before torch is imported to take full effect).
        ``queue_timeout``: how long a Slurm job may wait in the queue (None: as
        long as Slurm holds it; Kernel > Interrupt cancels it). ``show``: what
        draws a Slurm job's wait (the session passes ``live/job_line.py``'s
        ``JobLine``), None for nothing.
        """
        import ipyparallel as ipp

        own = cluster is None
        if cluster is None:
            # A 1 s heartbeat (ipyparallel's default is 3 s) makes engines count as registered ~2 s sooner;
            # 10 missed beats (10 s) are still allowed before an engine is declared dead.
            cluster = ipp.Cluster(n=n, delay=0, log_level=logging.ERROR, shutdown_atexit=True,
                                  controller_args=[f"--HeartMonitor.period={HEARTBEAT_MS}"])
        running = cluster.controller is not None  # a Cluster object the person started already
        if not own:
            n = cluster.n or n
        try:
            if not running:
                cluster.start_controller_sync()
                cluster.start_engines_sync(n, environment=dict(engine_env or {}))
            client = cluster.connect_client_sync()
        except BaseException as exc:  # noqa: BLE001 - re-raised with what to try (an interrupt too, after cleaning up)
            if not running:
                try:
                    cluster.stop_cluster_sync()
                except Exception:  # noqa: BLE001
                    pass
            if isinstance(exc, ClusterError) or not isinstance(exc, Exception):  # Slurm refused the job; an interrupt
                raise
            raise ClusterError(f"could not start {n} engine(s): {type(exc).__name__}: {exc}") from exc
        connection = os.path.join(cluster.profile_dir, "security", f"ipcontroller-{cluster.cluster_id}-client.json")
        workers = cls(cluster, client, owned=not running, can_add_engines=True, connection_file=connection)
        workers.engine_env = dict(engine_env or {})
        workers.jobs = SlurmJobs.of(cluster)
        try:
            if workers.owned:  # from now on: a job may wait in the queue for hours, and the kernel may die meanwhile
                workers.reaper.start(workers.all_pids(), file_prefix, workers.job_ids())
            workers.wait_started(n, timeout, queue_timeout, show=show)
        except BaseException:
            workers.stop()
            raise
        if workers.owned:
            workers.controller_helpers = running_children(getattr(cluster.controller, "process", None))
            workers.reaper.update(workers.all_pids(), workers.job_ids())
        return workers

    @classmethod
    def attach(cls, profile: str | None, cluster_id: str | None, n: int | None, timeout: float = 30.0) -> "Workers":
        """Attach to a running cluster (never stopped by nbddp).

        ``profile`` is a profile name (``ipcluster start --profile=NAME``), the
        path of a profile directory (``--profile-dir=PATH``), or the path of a
        client connection file (``ipcontroller-<id>-client.json``). A cluster
        started by ``ipcluster start`` is found by its cluster file; one whose
        controller was started alone (``ipcontroller``, engines started with
        ``ipengine`` on other hosts) by its client connection file.
        """
        import ipyparallel as ipp

        profile_dir, client_file, cluster_file = attach_files(profile, cluster_id)
        where = f"profile={profile!r}, cluster_id={cluster_id!r}"
        cluster = None
        try:
            if cluster_file is not None:
                cluster = ipp.Cluster.from_file(cluster_file)
                client = cluster.connect_client_sync()
            else:
                client = ipp.Client(client_file, timeout=CONNECT_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001
            raise ClusterError(
                f"could not attach to a running cluster with {where} (file {cluster_file or client_file}): "
                f"{type(exc).__name__}: {exc}. Is its controller still running? Start one with `ipcluster start -n N` "
                "(add --profile/--cluster-id to match), or call nbddp.start(n=N) to let nbddp start local workers."
            ) from exc
        workers = cls(cluster, client, owned=False, can_add_engines=False, connection_file=client_file)
        workers.jobs = SlurmJobs.of(cluster)  # an `ipcluster start --engines=slurm`: its job is watched, never cancelled
        if n:
            workers.wait_for(n, timeout)
        elif not client.ids:
            client.close()
            raise ClusterError(
                f"the attached cluster ({where}) has no engines registered; start some with "
                "`ipcluster engines -n N` or `ipengine --file=<ipcontroller-...-engine.json>` on each host"
            )
        return workers

    # ---- queries ---------------------------------------------------------
    @property
    def ids(self) -> list[int]:
        """The engines that are (or will be) ranks: every registered one but a spare."""
        baseline = self.spare_baseline
        return sorted(i for i in self.client.ids if i not in self.spare_ids and (baseline is None or i in baseline))

    def controller_endpoint(self) -> tuple[str, int | None]:
        """(host, registration port) of the controller, from its client connection file.

        Read once: the controller's address does not change while it lives,
        and this is asked about once a second while work runs.
        """
        if self._endpoint is not None:
            return self._endpoint
        try:
            with open(self.connection_file) as f:
                info = json.load(f)
        except (OSError, ValueError):
            return "127.0.0.1", None
        host = str(info.get("interface", "tcp://127.0.0.1")).split("://", 1)[-1].rsplit(":", 1)[0] or "127.0.0.1"
        if host in ("*", "0.0.0.0"):
            host = info.get("location") or "127.0.0.1"
        port = info.get("registration")
        if not (isinstance(port, int) or str(port).isdigit()):
            return host, None
        self._endpoint = host, int(port)
        return self._endpoint

    @property
    def controller_host(self) -> str:
        return self.controller_endpoint()[0]

    def controller_problem(self) -> str | None:
        """Why the controller cannot be reached now, or None (a check that costs milliseconds).

        A controller this session started is checked by its pid; any
        controller by connecting to its registration port (nothing is sent).
        """
        controller = getattr(self.cluster, "controller", None) if self.owned else None
        process = getattr(controller, "process", None)
        if process is not None and not _running(process):
            return f"the ipyparallel controller (pid {process.pid}) has exited"
        for helper in self.controller_helpers:  # its schedulers and queues: without any one, no task gets through
            if not _running(helper):
                return f"a process of the ipyparallel controller (its scheduler, pid {helper.pid}) has exited"
        host, port = self.controller_endpoint()
        return None if port is None else unanswered(host, port, "the ipyparallel controller")

    def job_problem(self) -> JobState | None:
        """The Slurm job of these engines that ended, or None (asked at most once a second).

        The job is a ``nbddp.cluster.slurm.queue.JobState``.
        """
        return self.jobs.ended() if self.jobs is not None else None

    def job_ids(self) -> list[str]:
        """The Slurm jobs this session submitted (and must cancel): none for other launchers or attached clusters."""
        return self.jobs.ids if self.jobs is not None and self.owned else []

    def wait_started(self, n: int, timeout: float, queue_timeout: float | None = None,
                     show: JobShow | None = None) -> None:
        """Wait until ``n`` engines registered; a Slurm job's wait is drawn by ``show`` and bounded by its state."""
        if self.jobs is None:
            self.wait_for(n, timeout)
        else:
            self.jobs.wait_started(self, n, queue_timeout, timeout, show)

    def wait_for(self, n: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.ids) < n:
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"only {len(self.ids)} of {n} engines registered within {timeout:.0f} s; "
                    "the machine may be overloaded, or engines fail at start-up (see their logs in the profile's log/ folder)"
                )
            time.sleep(0.05)

    def launcher_pids(self) -> dict[int, BaseLauncher]:
        """pid -> launcher object, for engines this cluster object launched."""
        found: dict[int, BaseLauncher] = {}
        engines = getattr(self.cluster, "engines", None) or {}  # None: attached by connection file alone
        for engine_set in engines.values():
            for launcher in getattr(engine_set, "launchers", {}).values():
                pid = getattr(launcher, "pid", None)
                if pid:
                    found[pid] = launcher
        self._launched.update(found)
        return found

    def how_died(self, pid: int) -> tuple[str, str]:
        """(how the engine with ``pid`` died, the tail of its log) as far as known."""
        launcher = self.launcher_pids().get(pid) or self._launched.get(pid)
        how, tail = "died (exit status unknown: the engine was not started by this session)", ""
        if launcher is None and self.jobs is not None:
            jobs = self.jobs.states(max_age=0)
            how = "died on its Slurm node (" + "; ".join(j.headline() for j in jobs.values()) + ")"
            tail = self.jobs.tail(self.jobs.ids[-1]) if self.jobs.ids else ""
        if launcher is not None:
            code = exit_code(launcher, wait_s=2.0)
            if code is None:  # ipyparallel may have noticed the exit first
                code = (getattr(launcher, "stop_data", None) or {}).get("exit_code")
            how = describe_exit(code)
            path = getattr(launcher, "output_file", "")
            tail = read_tail(path) if path else ""
            if not tail:  # ipyparallel removes the log of a stopped engine, keeping its text
                kept = getattr(launcher, "_output", None) or ""
                tail = "\n".join(kept.splitlines()[-20:])
        return how, tail

    # ---- actions ---------------------------------------------------------
    def kill(self, engine_ids: list[int]) -> None:
        """SIGKILL engines by pid: locally when we can, else through their nanny."""
        remote = []
        for eid in engine_ids:
            pid = self.pids.get(eid)
            if pid and pid in self.launcher_pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            else:
                remote.append(eid)
        if remote:
            try:
                self.client.send_signal(signal.SIGKILL, targets=remote, block=True)
            except Exception:  # noqa: BLE001 - already gone
                pass

    def kill_all(self) -> None:
        """SIGKILL every engine this session launched, with its nanny (when the controller is gone, nothing else can)."""
        for pid in self.launcher_pids():
            _kill_tree(pid, wait_s=0.0)  # a killed nanny may stay a zombie where nobody reaps orphans
        if self.jobs is not None and self.job_ids():
            self.jobs.cancel()

    def signal(self, engine_ids: list[int], signum: int) -> Any:
        """Send ``signum`` to the engines; return the request's future (done once every nanny has sent it), or None."""
        if engine_ids:
            return self.client.send_signal(signum, targets=engine_ids, block=False)
        return None

    def add_engines(self, count: int, total: int, timeout: float = START_TIMEOUT_S,
                    wait: dict[str, Any] | None = None) -> None:
        """Start ``count`` more engines and wait until ``total`` are registered.

        ``wait``: ``wait_started``'s ``queue_timeout`` and ``show`` for a Slurm job (default: a queue bounded
        by ``timeout``, nothing shown; an elastic fit's new job after a lost one passes the person's own).
        """
        if not self.can_add_engines or self.cluster is None:  # (attached: no cluster object, or not ours)
            raise ClusterError(
                f"{count} engine(s) of this attached cluster died and nbddp cannot start engines there. "
                f"Start {count} more with `ipengine --profile=...` (or `ipcluster engines -n {count}`) on the cluster, "
                "then call nbddp.restart()."
            )
        self.cluster.start_engines_sync(count, environment=dict(self.engine_env))
        self.reaper.update(self.all_pids(), self.job_ids())
        # (a heal must not wait for a queue forever, unless asked to)
        self.wait_started(total, timeout, **(wait if wait is not None else {"queue_timeout": timeout}))

    def forget_dead(self, engine_ids: list[int], timeout: float = 10.0) -> None:
        """Unregister ``engine_ids``, found dead or killed by the caller, and wait until the client no longer lists them.

        The controller is told at once (``cluster/unregister.py``) rather than left to miss ten heartbeats.
        """
        unregister(self.client, self.controller_endpoint(), sorted(set(engine_ids) & set(self.client.ids)))
        deadline = time.monotonic() + timeout
        while set(engine_ids) & set(self.client.ids) and time.monotonic() < deadline:
            time.sleep(0.05)

    def stop(self, wait_gone: bool = True) -> None:
        """Stop what this session started; only disconnect from attached clusters.

        ``wait_gone``: return once ``squeue`` no longer lists this session's Slurm jobs (their teardown,
        ``COMPLETING``, took about 5 s here); a restart need not wait.
        """
        try:
            self.client.close()
        except Exception:  # noqa: BLE001
            pass
        if self.owned:
            try:
                if self.cluster is not None:  # (an owned cluster always has one)
                    self.cluster.stop_cluster_sync()
            except Exception:  # noqa: BLE001 - fall back to killing by pid below
                pass
            for pid in self.all_pids():
                _kill_tree(pid)
            # ipyparallel scancel'ed them; make sure, and wait until squeue no longer lists them
            if self.jobs is not None and self.job_ids():
                self.jobs.cancel()
                if wait_gone:
                    self.jobs.wait_gone()
        self.reaper.stop()

    # ---- no orphans --------------------------------------------------------
    def all_pids(self) -> list[int]:
        pids = list(self.launcher_pids())
        controller = getattr(self.cluster, "controller", None)
        if controller is not None and getattr(controller, "pid", None):
            pids.append(controller.pid)
        pids += [h.pid for h in self.controller_helpers if _running(h)]  # orphaned if the controller was killed
        pids += [p for p in self.inherited_pids if p not in pids and pid_alive(p)]
        return pids


def _running(process: psutil.Process) -> bool:
    """Whether a psutil.Process is still that process and has not exited (a zombie has)."""
    import psutil

    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def running_children(process: psutil.Process | None) -> list[psutil.Process]:
    import psutil

    if process is None:
        return []
    try:
        return psutil.Process(process.pid).children(recursive=True)
    except psutil.Error:
        return []


def _kill_tree(pid: int, wait_s: float = 3.0) -> None:
    import psutil

    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    if wait_s > 0:
        psutil.wait_procs(procs, timeout=wait_s)


def unanswered(host: str, port: int, who: str) -> str | None:
    """Why ``who`` at ``host:port`` cannot be reached (it refuses or does not accept a connection within
    ``CONTROLLER_CHECK_TIMEOUT_S``; nothing is sent), or None: the one probe of a controller's registration port,
    for the workers of this kernel and for a detached session's record alike."""
    try:
        with socket.create_connection((host, port), timeout=CONTROLLER_CHECK_TIMEOUT_S):
            return None
    except OSError as exc:
        return f"{who} at {host}:{port} does not answer ({exc.strerror or exc})"
