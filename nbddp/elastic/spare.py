"""A warm spare engine beside the group, so that replacing a lost rank does not start one from nothing.

Measured on the loaded 2-core test machine, a recovery spent most of its 20-30
seconds in a fresh engine: starting it (6-7 s), its first probe importing
torch (9-11 s), then the relaunched fit importing nbddp's training code
(9-10 s). An elastic fit (``dist_fit(max_restarts=N)``) therefore starts one
extra engine in the background, which imports all that at a lower CPU
priority (``worker/tasks/spare.py``) and waits, registered but outside the
process group (``Workers.spare_ids``). When a rank is lost, the heal takes it
as the replacement (``Supervisor._heal``); once the fit has resumed, the next
spare is started. It stays for the session's later elastic fits and goes
with the workers (``nbddp.stop()``, the reaper if the kernel dies).

Only for engines this session starts on its own host: a spare on a Slurm
cluster would be another job in the queue, and an attached cluster cannot
be given engines.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

from nbddp.cluster.engines import START_TIMEOUT_S, Workers
from nbddp.execution.contracts import SessionLike, SpareLike
from nbddp.execution.send import to_engine
from nbddp.protocol.notes import shm_dir


class Spare:
    """At most one warm engine, started in the ``nbddp-spare`` thread; the heal ``take``s it."""

    def __init__(self, session: SessionLike):
        self.session = session
        self.workers: Workers | None = None  # the Workers it belongs to (a restart makes new ones, and forgets it)
        self.engine_id: int | None = None  # warm and waiting
        self.thread: threading.Thread | None = None
        self.error: str | None = None  # why the last one could not be started (then the heal starts one)
        self.warm_s: float | None = None  # what its imports took

    def allowed(self) -> bool:
        s = self.session
        w = s.workers
        return (w is not None and w.owned and w.can_add_engines and w.jobs is None and not s.supervisor.closing
                and bool(s.placements) and all(p.local for p in s.placements))

    def ensure(self) -> None:
        """Start a spare in the background, unless one is ready or on its way (or none can be started here)."""
        workers = self.session.workers
        if self.workers is not workers:  # new workers: the old spare went with the old ones
            self.workers, self.engine_id = workers, None
        if workers is None:  # (stopped meanwhile: no spare, and none is on its way)
            return
        if self.engine_id is not None and self.engine_id not in workers.client.ids:
            workers.spare_ids.discard(self.engine_id)  # it died while waiting
            self.engine_id = None
        if self.engine_id is not None or (self.thread is not None and self.thread.is_alive()) or not self.allowed():
            return
        self.warm_s = None
        self.thread = threading.Thread(target=self._start, args=(workers,), name="nbddp-spare", daemon=True)
        self.thread.start()

    def wait(self, timeout: float = START_TIMEOUT_S) -> None:
        """Until a spare on its way is ready or failed (the heal, ``stop()``, the test suite's leak check)."""
        thread = self.thread
        if thread is not None:
            thread.join(timeout)

    def take(self) -> int | None:
        """The spare's engine id, from now on one of the ranks' engines; None when there is no live one."""
        self.wait()
        eid, self.engine_id = self.engine_id, None
        workers = self.session.workers
        if eid is None or workers is None or self.workers is not workers:
            return None
        workers.spare_ids.discard(eid)
        return eid if eid in workers.client.ids else None

    def _start(self, workers: Workers) -> None:
        started: list[int] = []
        eid = None
        t0 = time.monotonic()
        try:
            cluster = workers.cluster
            assert cluster is not None, "a spare is started only on a cluster this session started (allowed())"
            workers.spare_baseline = set(workers.client.ids)  # what registers from now on is the spare, not a rank
            set_id = cluster.start_engines_sync(1, environment=dict(workers.engine_env))
            started = [launcher.pid for launcher in cluster.engines[set_id].launchers.values()]
            workers.reaper.update(workers.all_pids(), workers.job_ids())
            eid = self._registered(workers, t0)
            if eid is not None:
                workers.spare_ids.add(eid)
                workers.spare_baseline = None
                self.warm_s = self._warm(workers, eid, t0)
            if self.warm_s is not None and eid is not None:
                self.engine_id, self.error = eid, None
                return
            self.error = (f"the spare engine was not ready within {START_TIMEOUT_S:.0f} s"
                          if not self.session.supervisor.closing else "the session stopped")
        except Exception as exc:  # noqa: BLE001 - without a spare, the heal starts an engine as it always did
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            workers.spare_baseline = None
        workers.spare_ids.discard(eid)
        for pid in started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def _waiting(self, t0: float) -> bool:
        """Whether a spare on its way is still worth waiting for."""
        return not self.session.supervisor.closing and time.monotonic() - t0 < START_TIMEOUT_S

    def _registered(self, workers: Workers, t0: float) -> int | None:
        """The spare's engine id, once the controller has it (None: too late, or the session is stopping)."""
        baseline = workers.spare_baseline
        assert baseline is not None, "_start sets the baseline before it waits"
        while self._waiting(t0):
            new = sorted(set(workers.client.ids) - baseline)
            if new:
                return new[-1]
            time.sleep(0.05)
        return None

    def _warm(self, workers: Workers, eid: int, t0: float) -> float | None:
        """Probe it (it watches the kernel from then on) and import what a relaunch needs: the seconds it took."""
        from nbddp.worker.tasks.spare import warm_spare

        token = self.session.token
        path = os.path.join(shm_dir(), f"{self.session.file_prefix}-spare-probe")
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write(token)
        try:
            ar = to_engine(workers.client, eid, warm_spare, eid, workers.controller_host, path, token, os.getpid(),
                           self.session.file_prefix)
            while not ar.ready() and self._waiting(t0):  # a stop() does not wait for the imports
                time.sleep(0.05)
            if not ar.ready():
                return None
            probe, seconds = ar.get()
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        workers.pids[eid] = probe.pid
        return seconds


def keep_spare(session: SessionLike) -> SpareLike:
    """The session's spare keeper (made on the first elastic fit), asked to have one ready."""
    spare = session.supervisor.spare
    if spare is None:
        spare = session.supervisor.spare = Spare(session)
    spare.ensure()
    return spare
