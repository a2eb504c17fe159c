"""ipyparallel engines: start, attach, probe, kill, replace, stop.

Everything about *processes* lives here; what the processes *mean* (ranks,
process groups) lives in ``session`` and ``topology``.

Facts this module is built on (``ipyparallel-facts.md``): per-engine stop or
restart is not implemented, so a broken engine is killed by pid (through the
nanny, which also works on other hosts) and a new engine set is started
beside the survivors; engine ids change, so nothing here assumes ``range(n)``.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from typing import Any
from urllib.parse import urlparse

from nbddp.errors import NbddpError

START_TIMEOUT_S = 120.0


class ClusterError(NbddpError):
    """Engines could not be started, reached or replaced."""


class Workers:
    """The engines of one session and how to reach them.

    ``owned``: nbddp started this cluster, so it may stop it and start
    replacement engines. Attached clusters (``profile=``/``cluster_id=``, or
    a ``cluster=`` object already running) are never stopped by nbddp.
    """

    def __init__(self, cluster: Any, client: Any, owned: bool, can_add_engines: bool):
        self.cluster = cluster
        self.client = client
        self.owned = owned
        self.can_add_engines = can_add_engines
        self.reaper: subprocess.Popen | None = None
        self.pidfile: str | None = None

    # ---- construction ---------------------------------------------------
    @classmethod
    def start(cls, n: int, cluster: Any = None, timeout: float = START_TIMEOUT_S) -> "Workers":
        """Start ``n`` local engines, or start the given ``ipyparallel.Cluster``."""
        import ipyparallel as ipp

        own = cluster is None
        if own:
            cluster = ipp.Cluster(n=n, delay=0, log_level=logging.WARNING, shutdown_atexit=True)
        running = cluster.controller is not None  # a Cluster object the person started already
        if not own:
            n = cluster.n or n
        try:
            if not running:
                cluster.start_controller_sync()
                cluster.start_engines_sync(n)
            client = cluster.connect_client_sync()
        except Exception as exc:  # noqa: BLE001 - re-raised with what to try
            if not running:
                try:
                    cluster.stop_cluster_sync()
                except Exception:  # noqa: BLE001
                    pass
            raise ClusterError(f"could not start {n} engine(s): {type(exc).__name__}: {exc}") from exc
        workers = cls(cluster, client, owned=not running, can_add_engines=True)
        try:
            workers.wait_for(n, timeout)
        except BaseException:
            workers.stop()
            raise
        if workers.owned:
            workers.start_reaper()
        return workers

    @classmethod
    def attach(cls, profile: str | None, cluster_id: str | None, n: int | None, timeout: float = 30.0) -> "Workers":
        """Attach to a cluster started by ``ipcluster start`` (never stopped by nbddp)."""
        import ipyparallel as ipp

        kwargs = {k: v for k, v in {"profile": profile, "cluster_id": cluster_id}.items() if v is not None}
        try:
            cluster = ipp.Cluster.from_file(**kwargs)
            client = cluster.connect_client_sync()
        except Exception as exc:  # noqa: BLE001
            where = ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) or "the default profile"
            raise ClusterError(
                f"could not attach to a running ipcluster with {where}: {type(exc).__name__}: {exc}. "
                "Start one with `ipcluster start -n N` (add --profile/--cluster-id to match), or call nbddp.start(n=N) "
                "to let nbddp start local workers."
            ) from exc
        workers = cls(cluster, client, owned=False, can_add_engines=False)
        if n:
            workers.wait_for(n, timeout)
        elif not client.ids:
            raise ClusterError("the attached cluster has no engines registered; start some with `ipcluster engines -n N`")
        return workers

    # ---- queries ---------------------------------------------------------
    @property
    def ids(self) -> list[int]:
        return sorted(self.client.ids)

    @property
    def controller_host(self) -> str:
        url = self.client._config.get("registration") or self.client._config.get("interface", "tcp://127.0.0.1")
        return urlparse(url).hostname or "127.0.0.1"

    def wait_for(self, n: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.client.ids) < n:
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"only {len(self.client.ids)} of {n} engines registered within {timeout:.0f} s; "
                    "the machine may be overloaded, or engines fail at start-up (see their logs in the profile's log/ folder)"
                )
            time.sleep(0.05)

    def launcher_pids(self) -> dict[int, Any]:
        """pid -> launcher object, for engines this cluster object launched."""
        found: dict[int, Any] = {}
        for engine_set in (self.cluster.engines or {}).values():
            for launcher in getattr(engine_set, "launchers", {}).values():
                pid = getattr(launcher, "pid", None)
                if pid:
                    found[pid] = launcher
        return found

    def how_died(self, pid: int) -> tuple[str, str]:
        """(how the engine with ``pid`` died, the tail of its log) as far as known."""
        launcher = self.launcher_pids().get(pid)
        how, tail = "died (exit status unknown: the engine was not started by this session)", ""
        if launcher is not None:
            deadline = time.monotonic() + 2.0
            proc = getattr(launcher, "_popen_process", None)
            code = None
            while proc is not None and code is None and time.monotonic() < deadline:
                code = proc.poll()
                time.sleep(0.02)
            how = describe_exit(code)
            path = getattr(launcher, "output_file", "")
            tail = read_tail(path) if path else ""
        return how, tail

    # ---- actions ---------------------------------------------------------
    def kill(self, engine_ids: list[int], pids: dict[int, int]) -> None:
        """SIGKILL engines by pid: locally when we can, else through their nanny."""
        remote = []
        for eid in engine_ids:
            pid = pids.get(eid)
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

    def signal(self, engine_ids: list[int], signum: int) -> None:
        if engine_ids:
            self.client.send_signal(signum, targets=engine_ids, block=False)

    def add_engines(self, count: int, total: int, timeout: float = START_TIMEOUT_S) -> None:
        """Start ``count`` more engines and wait until ``total`` are registered."""
        if not self.can_add_engines:
            raise ClusterError(
                f"{count} engine(s) of this attached cluster died and nbddp cannot start engines there. "
                f"Start {count} more with `ipengine --profile=...` (or `ipcluster engines -n {count}`) on the cluster, "
                "then call nbddp.restart()."
            )
        self.cluster.start_engines_sync(count)
        self.wait_for(total, timeout)
        self.update_reaper()

    def forget_dead(self, engine_ids: list[int], timeout: float = 10.0) -> None:
        """Wait until the controller has unregistered ``engine_ids``."""
        deadline = time.monotonic() + timeout
        while set(engine_ids) & set(self.client.ids) and time.monotonic() < deadline:
            time.sleep(0.05)

    def stop(self) -> None:
        """Stop what this session started; only disconnect from attached clusters."""
        try:
            self.client.close()
        except Exception:  # noqa: BLE001
            pass
        if self.owned:
            try:
                self.cluster.stop_cluster_sync()
            except Exception:  # noqa: BLE001 - fall back to killing by pid below
                pass
            for pid in self.all_pids():
                _kill_tree(pid)
        self.stop_reaper()

    # ---- no orphans --------------------------------------------------------
    def all_pids(self) -> list[int]:
        pids = list(self.launcher_pids())
        controller = getattr(self.cluster, "controller", None)
        if controller is not None and getattr(controller, "pid", None):
            pids.append(controller.pid)
        return pids

    def start_reaper(self) -> None:
        """A tiny process that kills our engines and controller if the kernel dies.

        Engines also watch the kernel themselves (``worker.probe``); the
        reaper covers the controller and engines that never got that far.
        """
        import tempfile

        fd, self.pidfile = tempfile.mkstemp(prefix="nbddp-pids-")
        os.close(fd)
        self.update_reaper()
        self.reaper = subprocess.Popen(
            [sys.executable, "-m", "nbddp._reaper", str(os.getpid()), self.pidfile],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def update_reaper(self) -> None:
        if self.pidfile:
            tmp = self.pidfile + ".tmp"
            with open(tmp, "w") as f:
                f.write("\n".join(str(p) for p in self.all_pids()))
            os.replace(tmp, self.pidfile)

    def stop_reaper(self) -> None:
        if self.pidfile:
            try:
                os.unlink(self.pidfile)
            except FileNotFoundError:
                pass
        if self.reaper is not None:
            try:
                self.reaper.wait(timeout=3)
            except subprocess.TimeoutExpired:
                self.reaper.kill()
                self.reaper.wait()
            self.reaper = None


def _kill_tree(pid: int) -> None:
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
    psutil.wait_procs(procs, timeout=3)


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
