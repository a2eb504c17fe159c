"""Session: the one object that owns a kernel's workers and process group.

All state about "the workers of this notebook" is here: the engines
(``cluster.Workers``), the backend, the current rank placements, the
process-group generation, the fit that is running, and a heal in progress.
The public functions in ``api`` are thin calls into the one ``Session``
returned by ``get_session()``.

Process-group generations: a failed group cannot be reused, so after any
failure the group is rebuilt as generation ``g + 1`` on a fresh store. On one
host the store is a file in ``/dev/shm`` (no TCP listener at all); across
hosts it is rank 0's address on a port free there.
"""

from __future__ import annotations

import glob
import os
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

from nbddp import topology
from nbddp.cluster import ClusterError, Workers
from nbddp.errors import FitRunningError, NotStartedError
from nbddp.shipping import BufferPool, remove_files, shm_dir
from nbddp.worker.memory import reason_to_leave_alone

DEFAULT_PG_TIMEOUT_S = 300.0
BACKENDS = ("gloo", "nccl")


@dataclass
class StartOptions:
    n: int | None
    backend: str | None
    cluster: Any
    profile: str | None
    cluster_id: str | None
    timeout: float
    threads: int | None
    interface: str | None


def local_gpu_count() -> int:
    """Visible GPUs, without initialising CUDA in the kernel (fork-safe)."""
    import torch

    try:
        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - a broken driver counts as no GPU
        return 0


def validate_start(n: Any, backend: Any, timeout: Any, threads: Any, gpus: int, attach: bool) -> tuple[int | None, str | None]:
    """Check ``start()``'s arguments before any process starts."""
    if n is not None and (isinstance(n, bool) or not isinstance(n, int)):
        raise TypeError(f"start(n=...) must be an int, got {type(n).__name__} {n!r}")
    if n is not None and n < 1:
        raise ValueError(f"start(n=...) must be >= 1, got {n}")
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"start(backend=...) must be one of {BACKENDS}, got {backend!r}")
    if timeout is not None and (not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0):
        raise ValueError(f"start(timeout=...) is the process-group timeout in seconds and must be > 0, got {timeout!r}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"start(threads=...) must be a positive int (CPU threads per worker), got {threads!r}")
    if attach:
        return n, backend
    if backend == "nccl" and gpus == 0:
        raise ValueError(
            "start(backend='nccl') needs CUDA GPUs, and this machine has none visible. "
            "Use backend='gloo' (the default without GPUs) to train on CPU workers."
        )
    if gpus and n is not None and n > gpus and backend != "gloo":
        raise ValueError(
            f"start(n={n}) asks for more workers than the {gpus} visible GPU(s); nccl needs one GPU per worker. "
            f"Use n<={gpus}, or backend='gloo' to run extra CPU workers."
        )
    if n is None:
        n = gpus or 2
    if backend is None:
        backend = "nccl" if gpus else "gloo"
    return n, backend


class Session:
    def __init__(self) -> None:
        self.workers: Workers | None = None
        self.backend: str = ""
        self.placements: list[topology.Placement] = []
        self.probes: list[topology.Probe] = []
        self.generation = 0
        self.options: StartOptions | None = None
        self.stopped_explicitly = False
        self.running: Any = None  # the FitRun or cell that holds the workers now
        self.lock = threading.RLock()
        self._heal: threading.Thread | None = None
        self._heal_error: BaseException | None = None
        self.token = secrets.token_hex(16)
        # every shared-memory file of this session (kernel's and workers') starts with this prefix,
        # so stop() and the reaper can remove them all, even those of a killed worker
        self.file_prefix = f"nbddp-{self.token[:12]}"
        self._token_path = os.path.join(shm_dir(), f"{self.file_prefix}-probe")
        self.send_pool = BufferPool(prefix=f"{self.file_prefix}-k")
        self.last_start_s = 0.0
        self.resident: dict[str, None] = {}  # dataset keys the workers hold, oldest first
        self.allocator: list[str] = []  # what each worker's C allocator runs with (worker/memory.py)
        self.master = ""  # the process group's init_method: file://... on one host, tcp://addr:port across hosts

    def mark_resident(self, keys: list[str], limit: int) -> None:
        """Datasets the workers now hold (their next fit gets the key instead of the data)."""
        for key in keys:
            self.resident.pop(key, None)
            self.resident[key] = None
        while len(self.resident) > limit:
            self.resident.pop(next(iter(self.resident)))

    # ---- lifecycle -------------------------------------------------------
    @property
    def started(self) -> bool:
        return self.workers is not None

    def start(self, n: int | None = None, *, backend: str | None = None, cluster: Any = None,
              profile: str | None = None, cluster_id: str | None = None, timeout: float | None = None,
              threads: int | None = None, interface: str | None = None) -> "Session":
        attach = profile is not None or cluster_id is not None
        if attach and cluster is not None:
            raise ValueError("start() takes either cluster=... or profile=/cluster_id=..., not both")
        gpus = 0 if attach or cluster is not None else local_gpu_count()
        n, backend = validate_start(n, backend, timeout, threads, gpus, attach or cluster is not None)
        if not attach:  # engines started from here inherit this environment: a bad value fails now, not in 7 s
            reason_to_leave_alone(os.environ)
        with self.lock:
            if self.started:
                same = self.options and (n in (None, self.world_size)) and (backend in (None, self.backend))
                if same and not attach and cluster is None:
                    if timeout is not None and float(timeout) != self.options.timeout:
                        self._regroup(float(timeout))
                    return self  # already running as asked: %ddp start twice is harmless
                raise ClusterError(
                    f"workers are already running ({self.world_size} x {self.backend}); "
                    "call nbddp.stop() first, or nbddp.restart() to rebuild them"
                )
            t0 = time.perf_counter()
            timeout = DEFAULT_PG_TIMEOUT_S if timeout is None else float(timeout)
            self.options = StartOptions(n, backend, cluster, profile, cluster_id, timeout, threads, interface)
            if attach:
                self.workers = Workers.attach(profile, cluster_id, n)
            else:
                n_local = n or 2
                # CPU threads per worker, fixed in the environment before torch is imported (as torchrun
                # does); join_process_group sets the same number again once ranks are known
                per_worker = threads or (_threads_per_worker(n_local) if cluster is None else None)
                env = {"OMP_NUM_THREADS": str(per_worker), "MKL_NUM_THREADS": str(per_worker)} if per_worker else {}
                self.workers = Workers.start(n_local, cluster, file_prefix=self.file_prefix, engine_env=env)
            try:
                self._setup_group()
            except BaseException:
                self.workers.stop()
                self.workers = None
                raise
            self.stopped_explicitly = False
            self.last_start_s = time.perf_counter() - t0
        return self

    def stop(self) -> None:
        with self.lock:
            self._join_heal(raise_error=False)
            if self.running is not None and not self.running.finished:
                self.running.hard_stop(reason="nbddp.stop() was called")
                self._join_heal(raise_error=False)  # the kill above starts a heal; let it end first
            if self.workers is not None:
                if not self.workers.owned:
                    self._leave_group()
                self.workers.stop()
            self.workers = None
            self.placements = []
            self.probes = []
            self.stopped_explicitly = True
            self._cleanup_files()

    def restart(self) -> "Session":
        opts = self.options
        if opts is None:
            raise NotStartedError("nothing to restart: no workers were started in this kernel; call nbddp.start()")
        self.stop()
        return self.start(opts.n, backend=opts.backend, cluster=opts.cluster,
                          profile=opts.profile, cluster_id=opts.cluster_id, timeout=opts.timeout,
                          threads=opts.threads, interface=opts.interface)

    def _regroup(self, timeout: float) -> None:
        """Form the process group again (same engines) with a new collective timeout."""
        self._join_heal(raise_error=True)
        if self.running is not None and not self.running.finished:
            raise FitRunningError(
                f"cannot change the process-group timeout while {self.running.describe()} runs; "
                "wait for it or stop it first"
            )
        old = self.options.timeout
        self.options.timeout = timeout
        try:
            self._setup_group(reprobe=False)
        except BaseException:
            self.options.timeout = old
            raise

    def ensure_started(self) -> None:
        """``dist_fit`` starts default workers once; after ``stop()`` it says so instead."""
        if self.started:
            self.ensure_ready()
            return
        if self.stopped_explicitly:
            raise NotStartedError(
                "the workers were stopped with nbddp.stop(); start new ones with nbddp.start() (or %ddp start) first"
            )
        self.start()

    def ensure_ready(self) -> None:
        """Wait for a heal in progress; refuse while another fit runs."""
        if not self.started:
            raise NotStartedError("no workers are running; call nbddp.start() (or %ddp start) first")
        self._join_heal(raise_error=True)
        if self.running is not None and not self.running.finished:
            raise FitRunningError(
                f"{self.running.describe()} is still running on these workers; wait for it "
                "(handle.wait()), stop it (handle.stop()), or use another session"
            )

    @property
    def world_size(self) -> int:
        return len(self.placements)

    @property
    def client(self) -> Any:
        return self.workers.client

    # ---- process group ---------------------------------------------------
    def _probe(self) -> list[topology.Probe]:
        from nbddp.worker.probe import probe

        with open(os.open(self._token_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write(self.token)
        host = self.workers.controller_host
        import socket

        ids = self.workers.ids
        # engines of an attached cluster must outlive this kernel: only our own engines watch it
        kernel_pid = os.getpid() if self.workers.owned else 0
        ars = {eid: self.client[eid].apply_async(probe, host, self._token_path, self.token, kernel_pid, socket.gethostname())
               for eid in ids}
        probes = []
        for eid, ar in ars.items():
            info = ar.get(timeout=60)
            probes.append(topology.Probe(engine_id=eid, **info))
        return probes

    def _setup_group(self, reprobe: bool = True) -> None:
        """Probe engines, assign ranks, (re)join the process group as a new generation.

        ``reprobe=False`` reuses the last probes when the engines are the same
        ones (a rebuild after a failure or a new timeout).
        """
        from nbddp.worker.probe import join_process_group

        opts = self.options
        if reprobe or not self.probes or sorted(p.engine_id for p in self.probes) != self.workers.ids:
            self.probes = self._probe()
        backend = opts.backend
        if backend is None:  # attached clusters: decide from what the engines see
            backend = "nccl" if all(p.cuda_devices for p in self.probes) else "gloo"
        placements = topology.assign(self.probes, backend)
        self.generation += 1
        init_method, ifnames = self._rendezvous(placements)
        threads = opts.threads or _default_threads(placements)
        ars = {p.engine_id: self.client[p.engine_id].apply_async(
            join_process_group, p, backend, init_method, self.generation, opts.timeout, threads, ifnames[p.rank],
            self.file_prefix)
            for p in placements}
        deadline = time.monotonic() + 120
        joined = [ar.get(timeout=max(1.0, deadline - time.monotonic())) for ar in ars.values()]
        self.allocator = sorted({j.get("allocator", "?") for j in joined})
        self.backend = backend
        self.placements = placements
        self.resident = {}  # join_process_group emptied the workers' caches
        # the previous generation's file store is dead now that every rank joined the new one
        for old in glob.glob(os.path.join(shm_dir(), glob.escape(f"{self.file_prefix}-pg-") + "*")):
            if not old.endswith(f"-pg-{self.generation}"):
                os.unlink(old)

    def _rendezvous(self, placements: list[topology.Placement]) -> tuple[str, dict[int, str | None]]:
        """Where the ranks meet: (init_method, rank -> socket interface).

        One host that shares the kernel's file system: a file store in
        ``/dev/shm``, no TCP listener. Several hosts (host names differ):
        rank 0's controller-facing address on a port free there, with each
        rank's gloo/NCCL traffic on the interface carrying its address (or
        ``start(interface=...)``). The torch store listens on rank 0 only.
        """
        single_host = len({p.host for p in placements}) == 1 and all(p.local for p in placements)
        if single_host:
            path = os.path.join(shm_dir(), f"{self.file_prefix}-pg-{self.generation}")
            self.master = f"file://{path}"
            ifname = self.options.interface or "lo"
            return self.master, {p.rank: ifname for p in placements}
        from nbddp.worker.probe import free_port

        master = topology.master_address(placements)
        ifnames = topology.socket_interfaces(placements, self.probes, self.options.interface)
        port = self.client[placements[0].engine_id].apply_sync(free_port, master)
        self.master = f"tcp://{master}:{port}"
        return self.master, ifnames

    def _leave_group(self) -> None:
        from nbddp.worker.probe import leave_process_group

        try:
            self.client[self.workers.ids].apply_sync(leave_process_group)
        except Exception:  # noqa: BLE001 - best effort on an attached cluster
            pass

    def _cleanup_files(self) -> None:
        self.send_pool.close()
        remove_files(self.file_prefix)

    # ---- healing -----------------------------------------------------------
    def heal_async(self, killed: list[int]) -> None:
        """Replace killed or dead engines and rebuild the group, in the background."""
        def _run() -> None:
            try:
                self.heal(killed)
            except BaseException as exc:  # noqa: BLE001 - reported at the next call
                self._heal_error = exc

        self._heal_error = None
        self._heal = threading.Thread(target=_run, name="nbddp-heal", daemon=True)
        self._heal.start()

    def heal(self, killed: list[int]) -> None:
        """Replace ``killed`` engines and dead or unresponsive ones; rebuild the group.

        Runs in the ``nbddp-heal`` thread WITHOUT ``self.lock``: every caller that
        uses the workers joins the heal first (``ensure_ready``, ``stop``), and a
        caller holding the lock while joining would otherwise deadlock.
        """
        from nbddp.worker.entry import ping

        want = len(self.placements) or (self.options.n or 2)
        workers = self.workers
        workers.forget_dead(killed)
        if killed:
            time.sleep(0.3)  # a peer of a killed rank may go down with it; let that show first
        ars = {eid: self.client[eid].apply_async(ping) for eid in workers.ids}
        deadline = time.monotonic() + 5.0
        alive, unresponsive = [], []
        for eid, ar in ars.items():
            try:
                ar.get(timeout=max(0.1, deadline - time.monotonic()))
                alive.append(eid)
            except Exception:  # noqa: BLE001 - dead or stuck: replaced
                unresponsive.append(eid)
        if unresponsive:
            pids = {p.engine_id: p.pid for p in self.probes}
            workers.kill(unresponsive, pids)
            workers.forget_dead(unresponsive)
        if len(alive) > want:  # keep the world size stable
            extra = sorted(alive)[want:]
            workers.kill(extra, {p.engine_id: p.pid for p in self.probes})
            workers.forget_dead(extra)
        missing = want - len(workers.ids)
        if missing > 0:
            workers.add_engines(missing, want)
        self._setup_group(reprobe=bool(killed or unresponsive or missing))

    def _join_heal(self, raise_error: bool) -> None:
        heal = self._heal
        if heal is not None:
            heal.join()
            self._heal = None
            if self._heal_error is not None:
                error, self._heal_error = self._heal_error, None
                if raise_error:
                    raise ClusterError(
                        f"replacing failed workers did not work: {type(error).__name__}: {error}. "
                        "Run nbddp.restart() to start a fresh set."
                    ) from error


def _threads_per_worker(workers_on_host: int) -> int:
    """CPU threads per worker: the host's cores shared among its workers (torchrun uses 1)."""
    return max(1, (os.cpu_count() or 1) // workers_on_host)


def _default_threads(placements: list[topology.Placement]) -> int:
    return _threads_per_worker(max(p.local_world_size for p in placements))


_SESSION: Session | None = None
_SESSION_LOCK = threading.Lock()


def get_session() -> Session:
    """The kernel's one Session."""
    global _SESSION
    with _SESSION_LOCK:
        if _SESSION is None:
            _SESSION = Session()
        return _SESSION
