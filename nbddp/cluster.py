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
CONNECT_TIMEOUT_S = 10.0  # ipyparallel's own default for reaching a controller
HEARTBEAT_MS = 1000


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
        self.engine_env: dict[str, str] = {}  # given to every engine this session launches
        self.reaper: subprocess.Popen | None = None
        self.pidfile: str | None = None
        self._launched: dict[int, Any] = {}  # pid -> launcher, kept after ipyparallel forgets a dead one

    # ---- construction ---------------------------------------------------
    @classmethod
    def start(cls, n: int, cluster: Any = None, timeout: float = START_TIMEOUT_S, file_prefix: str = "",
              engine_env: dict[str, str] | None = None) -> "Workers":
        """Start ``n`` local engines, or start the given ``ipyparallel.Cluster``.

        ``engine_env`` is added to the engines' environment at launch (thread
        counts must be set before torch is imported to take full effect).
        """
        import ipyparallel as ipp

        own = cluster is None
        if own:
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
        except Exception as exc:  # noqa: BLE001 - re-raised with what to try
            if not running:
                try:
                    cluster.stop_cluster_sync()
                except Exception:  # noqa: BLE001
                    pass
            raise ClusterError(f"could not start {n} engine(s): {type(exc).__name__}: {exc}") from exc
        workers = cls(cluster, client, owned=not running, can_add_engines=True)
        workers.engine_env = dict(engine_env or {})
        try:
            workers.wait_for(n, timeout)
        except BaseException:
            workers.stop()
            raise
        if workers.owned:
            workers.start_reaper(file_prefix)
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

        profile_dir, client_file, cluster_file = _attach_files(profile, cluster_id)
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
        workers = cls(cluster, client, owned=False, can_add_engines=False)
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
        self.cluster.start_engines_sync(count, environment=dict(self.engine_env))
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

    def start_reaper(self, file_prefix: str = "") -> None:
        """A tiny process that kills our engines and controller if the kernel dies.

        Engines also watch the kernel themselves (``worker.probe``); the
        reaper covers the controller and engines that never got that far.
        """
        import tempfile

        fd, self.pidfile = tempfile.mkstemp(prefix="nbddp-pids-")
        os.close(fd)
        self.update_reaper()
        self.reaper = subprocess.Popen(
            [sys.executable, "-m", "nbddp._reaper", str(os.getpid()), self.pidfile, file_prefix],
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


def _attach_files(profile: str | None, cluster_id: str | None) -> tuple[str, str, str | None]:
    """(profile directory, client connection file, cluster file or None) for ``attach``."""
    if profile is not None and not isinstance(profile, (str, os.PathLike)):
        raise TypeError(f"start(profile=...) must be a profile name or a path, got {type(profile).__name__} {profile!r}")
    if cluster_id is not None and not isinstance(cluster_id, str):
        raise TypeError(f"start(cluster_id=...) must be a str, got {type(cluster_id).__name__} {cluster_id!r}")
    cid = cluster_id or ""
    raw = os.fspath(profile) if profile is not None else "default"
    expanded = os.path.abspath(os.path.expanduser(raw))
    if raw.endswith(".json"):
        if not os.path.isfile(expanded):
            raise ClusterError(f"start(profile={raw!r}): no such connection file. Pass the path of the "
                               "ipcontroller-<cluster_id>-client.json file the controller wrote in <profile>/security/.")
        return os.path.dirname(os.path.dirname(expanded)), expanded, None
    if os.sep in raw or raw.startswith("~") or os.path.isdir(expanded):
        profile_dir = expanded
    else:
        from IPython.paths import get_ipython_dir

        profile_dir = os.path.join(get_ipython_dir(), f"profile_{raw}")
    security = os.path.join(profile_dir, "security")
    cluster_file = os.path.join(security, f"cluster-{cid}.json")
    client_file = os.path.join(security, f"ipcontroller-{cid}-client.json" if cid else "ipcontroller-client.json")
    if os.path.isfile(cluster_file):
        return profile_dir, client_file, cluster_file
    if os.path.isfile(client_file):
        return profile_dir, client_file, None
    found = sorted(name[len("ipcontroller-"):-len("-client.json")] or "''"
                   for name in (os.listdir(security) if os.path.isdir(security) else [])
                   if name.startswith("ipcontroller-") and name.endswith("-client.json"))
    hint = (f"cluster ids found there: {', '.join(found)}; pass cluster_id=..." if found
            else "no cluster was started with this profile; start one with `ipcluster start -n N` "
                 f"(--profile-dir={profile_dir!r}), or check the path")
    raise ClusterError(f"cannot attach with profile={raw!r}, cluster_id={cluster_id!r}: neither {cluster_file} "
                       f"nor {client_file} exists ({hint}).")


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


def exit_code(launcher: Any, wait_s: float = 2.0) -> int | None:
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
