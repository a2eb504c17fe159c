"""Watching one task per rank: results, or a fast, named failure.

This is the fault contract's kernel half (``design.md``):

* one ``AsyncResult`` per rank, so a dead engine is seen at once (a task over
  several engines reports a death only when all complete);
* the first failure is remembered; ranks that can be released finish within
  a short grace (they fail too, or finish); ranks still running after it are
  stuck in a collective that no signal can break (gloo/NCCL wait in C++);
* a failure a rank raised deliberately because *another* rank failed
  (``PeerFailed``) is never the headline;
* every rank's heartbeat is watched (``stalls.StallGuard``): stalled ranks
  are shown, and fail the work after a ``stall_timeout``; a process-group
  timeout's error carries the ranks' last stacks;
* about once a second the controller is checked: when it died, the wait
  fails within seconds instead of hanging (``Supervisor.controller_lost``);
  so is the Slurm job holding the engines, when there is one
  (``Supervisor.job_lost``: cancelled, out of time, a node lost).

``fail()`` builds the error to raise; killing the stuck ranks and replacing
them is the supervisor's (``supervisor.Supervisor.recover``).
"""

from __future__ import annotations

import re
import time
from typing import Any, Callable

from nbddp.protocol.errors import ClusterError, RankFailure, WorkerDied, WorkerError
from nbddp.protocol.messages import published
from nbddp.monitor.stalls import StallGuard

GRACE_S = 1.5
# an elastic fit (max_restarts) waits longer for the survivors of a lost rank to raise "connection closed" on their
# own: one kept alive is one engine less to replace (seconds of start-up and imports), while a rank that takes
# longer than that is stuck in a collective and is killed as before
ELASTIC_GRACE_S = 6.0
CONTROLLER_CHECK_S = 1.0
PEER_FAILED = "PeerFailed"
_TIMEOUT = re.compile(r"timed? ?out", re.IGNORECASE)  # gloo's "Timed out waiting ...", NCCL's watchdog "timeout"


class RankTasks:
    def __init__(self, session: Any, ars: dict[int, Any], what: str, fit: bool = False,
                 stall_timeout: float | None = None):
        """``ars``: rank -> the ``AsyncResult`` of that rank's task; ``what`` names the work in messages.

        ``fit``: the ranks mark their progress (``dist_fit``), rather than being sampled;
        ``stall_timeout``: seconds without progress that fail the work (``WorkerStalled``).
        """
        self.session = session
        self.ars = ars  # rank -> AsyncResult
        self.what = what
        self.results: dict[int, Any] = {}
        self.failures: dict[int, tuple[float, BaseException]] = {}
        self.first_failure_at: float | None = None
        self.grace_s = GRACE_S  # after the first failure, how long the other ranks may take to finish or fail
        self.finished = False
        self.stalls = StallGuard(session, self, fit=fit, stall_timeout=stall_timeout)
        self._next_check = time.monotonic() + CONTROLLER_CHECK_S

    @property
    def pending(self) -> list[int]:
        return [r for r in self.ars if r not in self.results and r not in self.failures]

    def poll(self) -> bool:
        """Collect what finished; return True when the outcome is decided."""
        for rank in self.pending:
            ar = self.ars[rank]
            if not ar.ready():
                continue
            try:
                self.results[rank] = ar.get(timeout=0)
            except BaseException as exc:  # noqa: BLE001 - classified below
                self.failures[rank] = (_finished_at(ar), exc)
                if self.first_failure_at is None:
                    self.first_failure_at = time.monotonic()
        if not self.pending:
            return True
        return self.first_failure_at is not None and time.monotonic() - self.first_failure_at > self.grace_s

    def wait(self, on_tick: Callable[[], None] | None = None, tick_s: float = 0.05) -> dict[int, Any]:
        """Block until every rank finished (results by rank) or raise ``WorkerError``."""
        try:
            while not self.poll():
                if on_tick is not None:
                    on_tick()
                self.stalls.tick()
                self._check_controller()
                self._sleep(tick_s)
            if on_tick is not None:
                on_tick()
        finally:
            self.finished = True
        if self.failures:
            raise self.fail()
        return self.results

    def _check_controller(self) -> None:
        """A dead controller never delivers a result: fail fast, naming it (checked every ~1 s, milliseconds each)."""
        now = time.monotonic()
        workers = self.session.workers
        if now < self._next_check or workers is None:
            return
        self._next_check = now + CONTROLLER_CHECK_S
        problem = workers.controller_problem()
        if problem is not None:
            raise self.session.supervisor.controller_lost(problem, self.what)
        ended = workers.job_problem()  # a Slurm job cancelled, out of time, or a node lost
        if ended is not None:
            raise self.session.supervisor.job_lost(ended, self.what)

    def _sleep(self, tick_s: float) -> None:
        # wait on any pending result rather than sleeping blindly: returns early when one finishes
        pending = self.pending
        if pending:
            try:
                self.ars[pending[0]].wait(tick_s)
            except Exception:  # noqa: BLE001
                time.sleep(tick_s)

    def fail(self) -> WorkerError | ClusterError:
        """Kill stuck ranks, hand the rest to the supervisor, and build the error to raise."""
        ended = self.session.workers.job_problem() if self.session.workers is not None else None
        if ended is not None:  # the ranks died because their Slurm job ended: that is the cause, and nothing heals
            return self.session.supervisor.job_lost(ended, self.what)
        stuck = self.pending
        self.stalls.tick(force=True)  # the last beats: a process-group timeout's error shows where every rank was
        placements = self.session.group.by_rank()
        workers = self.session.workers
        supervisor = self.session.supervisor
        killed = supervisor.kill_ranks(stuck)  # first, so they stop burning CPU while we build the report
        ranked = []
        died: dict[int, tuple[str, str]] = {}
        for rank, (at, exc) in self.failures.items():
            at = _raised_at(self.ars[rank], at)
            p = placements[rank]
            failure, dead = classify(rank, exc, p)
            if dead:
                how, tail = workers.how_died(p.pid)
                failure.message = f"the worker process (pid {p.pid}) {how}"
                died[rank] = (how, tail)
                killed.append(p.engine_id)
            # the headline is the cause: a death before any raise, an own error before
            # a peer's broken connection, then the earliest on the workers' clock
            ranked.append(((not dead, is_consequence(failure), at), failure))
        failures = [f for _, f in sorted(ranked, key=lambda kv: kv[0])]
        own = [f for f in failures if f.exc_type != PEER_FAILED] or failures
        head, others = own[0], [f for f in failures if f is not own[0] and f.exc_type != PEER_FAILED]
        note = ""
        if stuck:
            note = (f"rank(s) {', '.join(map(str, stuck))} were stuck in a collective and were killed; "
                    "replacement workers are starting, the next call waits for them")
        if died and not workers.can_add_engines:
            note = "\n".join(x for x in (note, (
                f"nbddp cannot start engines on this attached cluster: start {len(killed)} more with "
                f"`ipcluster engines -n {len(killed)}` (same --profile/--cluster-id), then call nbddp.restart()")) if x)
        elif died and not stuck:
            note = "a replacement worker is starting; the next call waits for it"
        if _TIMEOUT.search(head.message):
            note = "\n".join(x for x in (note, self._last_stacks()) if x)
        # Any failure may leave a rank's process group unusable (a collective that
        # timed out or was cut short cannot be resumed), and the kernel cannot tell
        # which: rebuild the group as a new generation, replacing killed engines.
        supervisor.recover(killed)
        if head.rank in died:
            how, tail = died[head.rank]
            return WorkerDied(head, how, tail, others, note)
        return WorkerError(head, others, note)

    def _last_stacks(self) -> str:
        """Where each rank was last seen waiting (the heartbeats' stacks), labelled by rank."""
        stacks = self.stalls.watch.stacks()
        if not stacks:
            return ""
        return "the ranks' last stacks:\n" + "\n".join(f"[rank {r}]\n{stacks[r].rstrip()}" for r in sorted(stacks))


def _raised_at(ar: Any, finished: float) -> float:
    """When the rank raised, as it published before its reply (read now: the reply may overtake it), else ``finished``.

    The task's end as the engine reports it comes after ipyparallel formatted
    the traceback, which on a loaded machine reordered ranks that raised half
    a second apart.
    """
    raised = published(ar, "raised")
    return float(raised) if isinstance(raised, (int, float)) and not isinstance(raised, bool) else finished


def _finished_at(ar: Any) -> float:
    """When the task ended on the engine (wall clock), else now."""
    try:
        done = ar.metadata.get("completed")
        if done is not None:
            return float(done.timestamp())
    except Exception:  # noqa: BLE001 - metadata is best effort
        pass
    return time.time()


_CONSEQUENCES = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def is_consequence(failure: RankFailure) -> bool:
    """A failure caused by another rank's failure (its own work was fine)."""
    return failure.exc_type == PEER_FAILED or any(c in failure.message for c in _CONSEQUENCES)


def classify(rank: int, exc: BaseException, placement: Any) -> tuple[RankFailure, bool]:
    """(failure record, whether the engine process died)."""
    from ipyparallel.error import EngineError, RemoteError

    if isinstance(exc, EngineError) or (isinstance(exc, RemoteError) and exc.ename == "EngineError"):
        # the controller reports a dead engine as a RemoteError named EngineError
        return RankFailure(rank, "WorkerDied", f"the worker process (pid {placement.pid}) died", "",
                           placement.pid, placement.host), True
    if isinstance(exc, RemoteError):
        tb = exc.traceback if isinstance(exc.traceback, str) else "".join(exc.traceback or [])
        return RankFailure(rank, exc.ename, str(exc.evalue), tb, placement.pid, placement.host), False
    return RankFailure(rank, type(exc).__name__, str(exc), "", placement.pid, placement.host), False
