"""Session: the one object that owns a kernel's workers.

It holds, and nothing else holds: the engines (``cluster.Workers``), the
current process group (``group.GroupState``, swapped in whole), the work
that holds the workers now (a fit, a cell, a call), the supervisor that
kills and heals ranks, and the datasets the workers keep between fits. The
public functions in ``api`` are thin calls into the one ``Session`` that
``get_session()`` returns.

Locking: ``lock`` guards starting, stopping, launching work and healing; the
heal thread holds it while it rebuilds. ``cond`` (on the same lock) lets a
caller wait for a heal without holding the lock meanwhile.
"""

from __future__ import annotations

import os
import shutil
import secrets
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from nbddp.protocol import placement as topology
from nbddp.cluster.engines import Workers
from nbddp.debugging.rank_lines import DebugBoard
from nbddp.live.job_line import JobLine
from nbddp.protocol.errors import ClusterError, FitRunningError, NotStartedError
from nbddp.protocol.session_record import remove_session as remove_record
from nbddp.session.ownership import check_owner
from nbddp.session.process_group import GroupFormer, GroupState
from nbddp.session.resident_datasets import ResidentSet
from nbddp.shipping.shm_files import BufferPool, remove_files
from nbddp.protocol.compile_settings import session_cache_dir
from nbddp.session.cache_cleanup import remove_remote_caches
from nbddp.cluster.slurm.request import SlurmChoice, SlurmRequest, slurm_request
from nbddp.session.source_ledger import SourceLedger
from nbddp.session.start_options import (DEFAULT_PG_TIMEOUT_S, StartOptions, check_stall_timeout, local_gpu_count,
                                 threads_per_worker, validate_start)
from nbddp.session.supervisor import Supervisor
from nbddp.protocol.allocator_setting import reason_to_leave_alone
from nbddp.execution.contracts import WorkLike
from nbddp.execution.send import on_engines

if TYPE_CHECKING:
    from ipyparallel import Client, Cluster


class Session:
    def __init__(self) -> None:
        self.workers: Workers | None = None
        self.group: GroupState | None = None
        self.options: StartOptions | None = None
        self.stopped_explicitly = False
        self.running: Any = None  # the FitRun, cell or call that holds the workers now
        self.last_history: Any = None  # the last fit's History (nbddp.last_history()), interrupted ones too
        self.resumed: Any = None  # the handle of a fit nbddp.attach() found running (nbddp/detached/resumed_handle.py)
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.supervisor = Supervisor(self)
        self.token = secrets.token_hex(16)
        # every shared-memory file of this session (kernel's and workers') starts with this prefix,
        # so stop() and the reaper can remove them all, even those of a killed worker
        self.file_prefix = f"nbddp-{self.token[:12]}"
        self.send_pool = BufferPool(prefix=f"{self.file_prefix}-k")
        self.resident = ResidentSet()
        self.sources = SourceLedger()  # which source lines each worker holds (tracebacks show the person's lines)
        self.debugger = DebugBoard(lambda: self.running)  # ranks in pdb (breakpoint(), post-mortems)
        self._former: GroupFormer | None = None
        self._generations = 0  # numbers every group this kernel formed, across stop() and start()
        self._paths_sent: tuple[Any, ...] = ()  # (sys.path, cwd, generation) the local workers follow
        self.started_wall = 0.0  # time.time() of start(): what nbddp.sessions() shows
        self.record_path: str | None = None  # a detached session's record (nbddp/detached/), removed by stop()
        self.on_launch: list[Callable[[Any], None]] = []  # told of every work launched (a detached session's record)

    # ---- what the rest of the package reads ---------------------------------
    @property
    def started(self) -> bool:
        return self.workers is not None

    @property
    def placements(self) -> list[topology.Placement]:
        group = self.group
        return list(group.placements) if group else []

    @property
    def world_size(self) -> int:
        group = self.group
        return group.world_size if group else 0

    @property
    def generation(self) -> int:
        group = self.group
        return group.generation if group else 0

    @property
    def backend(self) -> str:
        group = self.group
        return group.backend if group else ""

    @property
    def client(self) -> Client:
        return self._started()[0].client

    def _started(self) -> tuple[Workers, StartOptions]:
        """The engines and the options they were started with: ``start`` sets both before anything reads them."""
        workers, options = self.workers, self.options
        assert workers is not None and options is not None, "the session's workers are not started"
        return workers, options

    @property
    def busy(self) -> bool:
        return self.running is not None and not self.running.finished

    # ---- lifecycle -------------------------------------------------------
    def start(self, n: int | None = None, *, backend: str | None = None, cluster: Cluster | None = None,
              profile: str | None = None, cluster_id: str | None = None, timeout: float | None = None,
              threads: int | None = None, interface: str | None = None, stall_timeout: float | None = None,
              slurm: SlurmChoice = None) -> "Session":
        attach = profile is not None or cluster_id is not None
        if attach and cluster is not None:
            raise ValueError("start() takes either cluster=... or profile=/cluster_id=..., not both")
        request = slurm_request(slurm, cluster, attach)  # checked (and sbatch found) before anything starts
        remote = attach or cluster is not None or request is not None
        n, backend = validate_start(n, backend, timeout, threads, 0 if remote else local_gpu_count(), remote)
        if request is not None:
            n, backend = request.layout(n, backend)
        stall_timeout = check_stall_timeout(stall_timeout, "start")
        if not attach:  # engines started from here inherit this environment: a bad value fails now, not in 7 s
            reason_to_leave_alone(os.environ)
        self.wait_healed(raise_error=False)
        with self.lock:
            if self.started:
                return self._start_again(n, backend, attach, cluster, timeout, stall_timeout, request)
            timeout = DEFAULT_PG_TIMEOUT_S if timeout is None else float(timeout)
            self.options = StartOptions(n, backend, cluster, profile, cluster_id, timeout, threads, interface,
                                        stall_timeout, request)
            self.workers = self._launch(n, cluster, profile, cluster_id, threads, request)
            self.started_wall = time.time()
            self.supervisor.closing = False
            try:
                self.form_group(reprobe=True)
            except BaseException:
                self.workers.stop()
                self.workers = None
                raise
            self.stopped_explicitly = False
        return self

    def _start_again(self, n: int | None, backend: str | None, attach: bool, cluster: Cluster | None,
                     timeout: float | None, stall_timeout: float | None,
                     request: SlurmRequest | None = None) -> "Session":
        options = self._started()[1]
        same = (n in (None, self.world_size)) and (backend in (None, self.backend))
        if not same or attach or cluster is not None or request not in (None, options.slurm):
            raise ClusterError(
                f"workers are already running ({self.world_size} x {self.backend}); "
                "call nbddp.stop() first, or nbddp.restart() to rebuild them"
            )
        if stall_timeout is not None:
            options.stall_timeout = stall_timeout
        if timeout is not None and float(timeout) != options.timeout:
            self._regroup(float(timeout))
        return self  # already running as asked: %ddp start twice is harmless

    def _launch(self, n: int | None, cluster: Cluster | None, profile: str | None, cluster_id: str | None,
                threads: int | None, request: SlurmRequest | None = None) -> Workers:
        if profile is not None or cluster_id is not None:
            return Workers.attach(profile, cluster_id, n)
        if request is not None:  # a Slurm job: threads are its --cpus-per-task (the nodes' cores are not ours to count)
            assert n is not None, "request.layout() counts the engines of a Slurm job"
            env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)} if threads else {}
            return Workers.start(n, request.cluster(n, threads), file_prefix=self.file_prefix, engine_env=env,
                                 queue_timeout=request.queue_timeout, show=JobLine())
        n_local = n or 2
        # CPU threads per worker, fixed in the environment before torch is imported (as torchrun
        # does); join_process_group sets the same number again once ranks are known
        per_worker = threads or (threads_per_worker(n_local) if cluster is None else None)
        env = {"OMP_NUM_THREADS": str(per_worker), "MKL_NUM_THREADS": str(per_worker)} if per_worker else {}
        return Workers.start(n_local, cluster, file_prefix=self.file_prefix, engine_env=env, show=JobLine())

    def stop(self, wait_gone: bool = True) -> None:
        """Stop the workers this kernel started; never starts any (a heal under way is cancelled).

        ``wait_gone=False`` (restart): a cancelled Slurm job may still be on its way out. A detached
        session moved to another kernel is only let go here: that kernel drives it now.
        """
        from nbddp.session.ownership import let_go_if_moved

        if let_go_if_moved(self):
            return
        self.supervisor.closing = True
        running = self.running
        if running is not None and not running.finished:
            running.hard_stop(reason="nbddp.stop() was called")
        self.supervisor.wait(raise_error=False)
        self.debugger.close()
        with self.lock:
            if self.workers is not None and self.workers.controller_problem() is None:
                remove_remote_caches(self)  # dist_fit(compile=...)'s Inductor cache on the other hosts
            if self.workers is not None:
                if not self.workers.owned and self.workers.controller_problem() is None:
                    self._group_former().leave()  # (through a dead controller it would never return)
                self.workers.stop(wait_gone)
            self.workers = None
            self.group = None
            self.running = None  # whatever ran on them is over
            self._former = None
            self.stopped_explicitly = True
            self.send_pool.close()
            self.sources.forget()
            remove_files(self.file_prefix)
            if self.record_path is not None:  # a detached session ends here: no kernel will find it again
                remove_record(self.record_path)
                self.record_path = None
            # this host's Inductor cache of the session (dist_fit(compile=...)): kept only by compile_cache(save=...)
            shutil.rmtree(session_cache_dir(self.file_prefix), ignore_errors=True)

    def forget_group_state(self, generation: int) -> None:
        """The next group this kernel forms is ``generation + 1``, from fresh probes (``session/ownership.py``)."""
        self._former, self._generations, self._paths_sent = None, generation, ()

    def restart(self) -> "Session":
        opts = self.options
        if opts is None:
            raise NotStartedError("nothing to restart: no workers were started in this kernel; call nbddp.start()")
        self.stop(wait_gone=False)
        return self.start(opts.n, backend=opts.backend, cluster=opts.cluster, profile=opts.profile,
                          cluster_id=opts.cluster_id, timeout=opts.timeout, threads=opts.threads,
                          interface=opts.interface, stall_timeout=opts.stall_timeout, slurm=opts.slurm)

    def _regroup(self, timeout: float) -> None:
        """Form the process group again (same engines) with a new collective timeout."""
        if self.busy:
            raise FitRunningError(
                f"cannot change the process-group timeout while {self.running.describe()} runs; "
                "wait for it or stop it first"
            )
        options = self._started()[1]
        old = options.timeout
        options.timeout = timeout
        try:
            self.form_group(reprobe=False)
        except BaseException:
            options.timeout = old
            raise

    def ensure_started(self) -> None:
        """``dist_fit`` starts default workers once; after ``stop()`` it says so instead."""
        if self.started:
            return
        if self.stopped_explicitly:
            raise NotStartedError(
                "the workers were stopped with nbddp.stop(); start new ones with nbddp.start() (or %ddp start) first"
            )
        self.start()

    def ensure_ready(self) -> None:
        """Call holding ``lock``: wait out a heal, refuse while other work runs, check the controller."""
        if not self.started:
            raise NotStartedError("no workers are running; call nbddp.start() (or %ddp start) first")
        self.supervisor.regrow()  # after a fit that went on with fewer ranks: back to the size it began with
        while self.supervisor.healing:
            self.cond.wait()
        self.supervisor.raise_if_failed()
        if self.workers is None or self.group is None:
            raise NotStartedError("no workers are running; call nbddp.start() (or %ddp start) first")
        check_owner(self)
        if self.busy:
            raise FitRunningError(
                f"{self.running.describe()} is still running on these workers; wait for it "
                "(handle.wait()), stop it (handle.stop()), or use another session"
            )
        problem = self.workers.controller_problem()
        if problem is not None:
            raise ClusterError(f"{problem}, so the workers cannot be reached. Run nbddp.restart() to start fresh "
                               "workers (the old ones are stopped first), or nbddp.stop().")
        ended = self.workers.job_problem()
        if ended is not None:
            raise self.supervisor.job_lost(ended)

    def follow_kernel_paths(self) -> None:
        """Workers on this host import from the kernel's ``sys.path`` and work in its folder (when they changed).

        Called right before work is launched (every check passed), so a refused call sends nothing.
        """
        from nbddp.worker.tasks.module_reload import follow_paths

        paths = [p for p in sys.path if p and os.path.isdir(p)]
        try:
            cwd = os.getcwd()
        except FileNotFoundError:  # the kernel's folder was removed: the workers keep theirs
            cwd = None
        wanted = (tuple(paths), cwd, self.generation)
        if wanted == self._paths_sent:
            return
        local = [p.engine_id for p in self.placements if p.local]
        if local:
            on_engines(self.client, local, follow_paths, paths, wanted[1])
        self._paths_sent = wanted

    def attend(self, work: WorkLike) -> None:
        """From the cell that waits for ``work``: open the debugger prompt for its ranks paused at ``breakpoint()``."""
        from nbddp.debugging.prompt import attend

        attend(work)

    def wait_healed(self, raise_error: bool = True) -> None:
        """Wait for a heal under way, without holding the lock; raise its error if it failed."""
        self.supervisor.wait(raise_error)

    # ---- process group ---------------------------------------------------
    def _group_former(self) -> GroupFormer:
        workers = self._started()[0]
        if self._former is None or self._former.workers is not workers:
            self._former = GroupFormer(workers, self.file_prefix, self.token)
        return self._former

    def form_group(self, reprobe: bool, engines: list[int] | None = None) -> None:
        """Probe (when engines changed), assign ranks, join every engine as the next generation.

        ``reprobe=False`` reuses the last probes when the engines are the same
        ones (a rebuild after a failure or a new timeout). ``engines``: only
        these join (a fit going on with fewer ranks: ``elastic/fewer_ranks.py``).
        """
        former = self._group_former()
        with self.lock:
            workers, options = self._started()
            old = self.group
            probes = list(old.probes) if old else []
            if reprobe or not probes or sorted(p.engine_id for p in probes) != workers.ids:
                probes = former.probe()
            if engines is not None:
                probes = [p for p in probes if p.engine_id in engines]
            self._generations += 1
            self.group = former.form(options, self._generations, probes)
            self.resident.clear()  # joining a group emptied the workers' dataset caches
            self.debugger.announce(workers.client, list(self.group.placements), workers.controller_host)

    def snapshot(self) -> dict[str, Any]:
        """What ``nbddp.status()`` shows: one consistent view of one generation."""
        group, workers = self.group, self.workers
        if workers is None or group is None:
            return {"running": False, "backend": None, "world_size": 0, "ranks": [], "fit_running": False}
        return {
            "running": True,
            "backend": group.backend,
            "world_size": group.world_size,
            "generation": group.generation,
            "owned": workers.owned,
            "detached": os.path.basename(self.record_path)[len("session-"):-len(".json")] if self.record_path else None,
            "hosts": sorted({p.host for p in group.placements}),
            "master": group.init_method,
            "allocator": list(group.allocator),  # worker/memory/allocator.py: "tuned", or "default (why)"
            "stall_timeout": self.options.stall_timeout if self.options else None,
            "healing": self.supervisor.healing,
            "ranks": topology.describe(list(group.placements)),
            "fit_running": self.busy,
            "slurm": workers.jobs.describe() if workers.jobs is not None else None,  # job, state, nodes, elapsed
        }


_SESSION: Session | None = None
_SESSION_LOCK = threading.Lock()


def get_session() -> Session:
    """The kernel's one Session."""
    global _SESSION
    with _SESSION_LOCK:
        if _SESSION is None:
            _SESSION = Session()
        return _SESSION
