"""The Slurm jobs holding a session's engines: waiting for them, watching them, cancelling them.

``SlurmJobs.of(cluster)`` is not None for any ipyparallel Cluster whose
engines are a Slurm job (``start(slurm=...)``, or ``cluster=`` with
``engines="slurm"``). One job per engine set: the first one, then one per
replacement. Batch launchers never poll their job, so this module does:

* ``wait_started``: while the job waits, one line in the cell says
  "Slurm job 42: PENDING (Resources), 0:12" and keeps it current; a job
  Slurm can never start, or one held past ``queue_timeout``, is cancelled
  and named in the error; Kernel > Interrupt cancels it;
* ``ended()``: a job that is over (cancelled, out of time, a node lost) is
  what the fault path (``nbddp.execution.rank_tasks.RankTasks``, ``Session.ensure_ready``)
  reports, within about a second, instead of waiting for heartbeats;
* ``cancel()`` / ``wait_gone()``: no job is left in ``squeue`` after stop.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

from nbddp.protocol.errors import ClusterError, SlurmError
from nbddp.cluster.engine_exits import read_tail
from nbddp.cluster.slurm.queue import GONE, JobState, cancel, never_starts, query

if TYPE_CHECKING:
    from ipyparallel import Client, Cluster

STATE_MAX_AGE_S = 1.0  # squeue is asked at most this often (each ask is a slurmctld RPC)
GONE_WAIT_S = 10.0
# A job being torn down is COMPLETING, and neither squeue nor scontrol tells why until it is over (seen in
# Slurm 22.05: CANCELLED, TIMEOUT or NODE_FAIL only show afterwards); wait this long for the word
SETTLE_S = 6.0
_END_WORDS = {
    "CANCELLED": "was cancelled (scancel, or an administrator)",
    "TIMEOUT": "reached its time limit",
    "NODE_FAIL": "lost a node",
    "PREEMPTED": "was preempted by another job",
    "OUT_OF_MEMORY": "ran out of memory",
    "BOOT_FAIL": "could not boot its nodes",
    "DEADLINE": "passed its deadline",
    "FAILED": "failed (its batch script exited with an error)",
    "COMPLETED": "ended (its engines exited)",
    "COMPLETING": "is ending (Slurm did not say why within a few seconds)",
    "PENDING": "was put back in the queue by Slurm (requeued: its engines were stopped)",
    "REQUEUED": "was put back in the queue by Slurm (requeued: its engines were stopped)",
    "SUSPENDED": "was suspended (its engines are stopped)",
    GONE: "is no longer listed by Slurm (it ended over MinJobAge ago; with accounting on, `sacct -j {job}` has its state)",
}


def fmt_clock(seconds: float) -> str:
    """``0:12``, ``12:05``, ``1:02:03``: a clock like squeue's."""
    s = max(0, int(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def ended_words(job: JobState) -> str:
    """``"Slurm job 42 was cancelled (scancel, or an administrator): CANCELLED"``."""
    words = _END_WORDS.get(job.state, "ended").replace("{job}", job.job_id)
    where = f" on {job.nodes}" if job.nodes else ""
    return f"Slurm job {job.job_id} {words}: {job.state}{f' ({job.why})' if job.why else ''}{where}"


def job_lines(rows: list[dict[str, str]]) -> list[str]:
    """``%ddp status``'s lines for ``SlurmJobs.describe()`` rows: "Slurm job 42: RUNNING on n[1-2], elapsed 0:12 of 30:00"."""
    return [f"Slurm job {r['job']}: {r['state']}" + (f" ({r['reason']})" if r["reason"] else "")
            + (f" on {r['nodes']}" if r["nodes"] else "") + f", elapsed {r['elapsed'] or '0:00'}"
            + (f" of {r['time_limit']}" if r["time_limit"] else "") for r in rows]


class JobShow(Protocol):
    """What draws a Slurm job's wait: ``live/job_line.py``'s ``JobLine``, or an elastic fit's live view."""

    def show(self, job: JobState, waited: float, have: int, n: int, final: str = "") -> None: ...


class Registering(Protocol):
    """What ``SlurmJobs.wait_started`` reads of the engines (``cluster/engines.py``'s ``Workers``, which imports
    this module): the client that lists them as they register."""

    @property
    def client(self) -> Client: ...


class SlurmJobs:
    """The jobs of one Cluster's engine sets, and their states (asked at most once a second)."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self._known: list[str] = []
        self._states: dict[str, JobState] = {}
        self._asked_at = float("-inf")
        self._ran: set[str] = set()  # jobs seen running: back in the queue means their engines are gone
        self.retired: set[str] = set()  # lost jobs an elastic fit went on without (elastic/job_loss.py): not news

    @classmethod
    def of(cls, cluster: Cluster | None) -> "SlurmJobs | None":
        from ipyparallel.cluster.launcher import SlurmLauncher

        launcher = getattr(cluster, "engine_launcher_class", None)
        return cls(cluster) if isinstance(launcher, type) and issubclass(launcher, SlurmLauncher) else None

    @property
    def ids(self) -> list[str]:
        """Every job submitted for these engines, oldest first (kept after ipyparallel forgets one)."""
        for engine_set in list((getattr(self.cluster, "engines", None) or {}).values()):
            job_id = str(getattr(engine_set, "job_id", "") or "")
            if job_id and job_id not in self._known:
                self._known.append(job_id)
        return list(self._known)

    def output_files(self) -> dict[str, str]:
        return {str(getattr(s, "job_id", "")): getattr(s, "output_file", "")
                for s in list((getattr(self.cluster, "engines", None) or {}).values())}

    def states(self, max_age: float = STATE_MAX_AGE_S) -> dict[str, JobState]:
        now = time.monotonic()
        if now - self._asked_at >= max_age:
            self._asked_at = now
            self._states.update(query(self.ids))
            self._ran.update(j for j, s in self._states.items() if s.running)
        return dict(self._states)

    def ended(self) -> JobState | None:
        """The first of these jobs that is over, or None while all are pending or running.

        A job on its way out (``COMPLETING``) is given ``SETTLE_S`` to say how it ended.
        """
        states = self.states()
        for j in self.ids:
            job = states.get(j)
            if j in self.retired:
                continue
            if job is not None and job.pending and j in self._ran:  # requeued, or suspended
                return job
            if job is not None and job.ended:
                return self._settled(job)
        return None

    def _settled(self, job: JobState) -> JobState:
        deadline = time.monotonic() + SETTLE_S
        while job.state == "COMPLETING" and time.monotonic() < deadline:
            time.sleep(0.25)
            job = self.states(max_age=0.2).get(job.job_id, job)
        return job

    def describe(self) -> list[dict[str, str]]:
        """Rows for ``status()``: job, state, reason, nodes, elapsed, time limit."""
        states = self.states()
        return [{"job": j, "state": s.state, "reason": s.why, "nodes": s.nodes, "elapsed": s.elapsed,
                 "time_limit": s.time_limit} for j in self.ids if (s := states.get(j)) is not None]

    def tail(self, job_id: str, lines: int = 20) -> str:
        path = self.output_files().get(job_id, "")
        return read_tail(path, lines) if path else ""

    def cancel(self) -> str:
        """``scancel`` every job still pending or running; return scancel's complaint, if any."""
        states = self.states(max_age=0)
        return cancel([j for j in self.ids if j not in states or not states[j].ended])

    def wait_gone(self, timeout: float = GONE_WAIT_S) -> None:
        """Wait until none of these jobs is pending, running or completing (so ``squeue`` no longer shows them)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = self.states(max_age=0.2)
            if all(j in states and states[j].ended and states[j].state != "COMPLETING" for j in self.ids):
                return
            time.sleep(0.1)

    def wait_started(self, workers: Registering, n: int, queue_timeout: float | None, run_timeout: float,
                     show: JobShow | None = None) -> None:
        """Wait until ``n`` engines registered, while the newest job waits in Slurm's queue and starts.

        ``show``: None for nothing, or what draws the wait: an object with a
        ``show(job, waited, have, n, final="")`` method, called about every
        50 ms (``live/job_line.py``'s ``JobLine`` in the cell, given by the
        session; an elastic fit's live view, ``elastic/job_loss.py``). The
        drawing is passed in so that ``cluster/`` imports nothing of ``live/``.
        """
        line = show
        job_id = self.ids[-1] if self.ids else "?"
        t0, running_at, job = time.monotonic(), None, JobState(job_id, "PENDING")
        try:
            while len(workers.client.ids) < n:
                now = time.monotonic()
                job = self.states().get(job_id, job)
                if job.ended:
                    raise self._ended_early(job)
                if job.pending:
                    self._check_pending(job, now - t0, queue_timeout)
                elif running_at is None:
                    running_at = now
                if running_at is not None and now - running_at > run_timeout:
                    raise self._slow_engines(job, len(workers.client.ids), n, run_timeout)
                if line is not None:
                    line.show(job, now - t0, len(workers.client.ids), n)
                time.sleep(0.05)
        except KeyboardInterrupt:
            self.cancel()
            if line is not None:
                line.show(job, time.monotonic() - t0, len(workers.client.ids), n, final=f"cancelled (interrupted "
                          f"while {job.state}{f' ({job.why})' if job.why else ''})")
            raise
        if line is not None:
            line.show(self.states().get(job_id, job), time.monotonic() - t0, n, n, final="started")

    def _check_pending(self, job: JobState, waited: float, queue_timeout: float | None) -> None:
        if never_starts(job):
            self.cancel()
            raise SlurmError(f"{job.headline()}: Slurm can never start this job as asked, so nbddp cancelled it. "
                             "Ask for what the partition has (`sinfo -p PARTITION`, `scontrol show partition`).",
                             job.job_id, job.state)
        if queue_timeout is not None and waited > queue_timeout:
            self.cancel()
            raise SlurmError(f"{job.headline()} for {fmt_clock(waited)}, longer than queue_timeout="
                             f"{queue_timeout:g} s, so nbddp cancelled it. Slurm's reason: {job.why or 'none given'} "
                             "(`squeue --me --start` estimates when it would start).", job.job_id, job.state)

    def _ended_early(self, job: JobState) -> SlurmError:
        job = self._settled(job)
        tail = self.tail(job.job_id)
        tail = f"\nthe job's output ends with:\n{tail}" if tail.strip() else ""
        return SlurmError(f"{ended_words(job)} before its engines registered.{tail}", job.job_id, job.state)

    def _slow_engines(self, job: JobState, have: int, n: int, timeout: float) -> ClusterError:
        self.cancel()
        tail = self.tail(job.job_id)
        tail = f"\nthe job's output ends with:\n{tail}" if tail.strip() else ""
        return SlurmError(f"{job.headline()}, but only {have} of {n} engines registered within {timeout:.0f} s of "
                          "its start, so nbddp cancelled it. The engines may not reach the controller (see "
                          f"controller_ip in docs/multi-node.md), or fail at start-up.{tail}", job.job_id, job.state)
