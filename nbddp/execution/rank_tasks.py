"""Watching one task per rank: results, or a fast, named failure.

This is the fault contract's kernel half (``docs/design.md``):

* one ``AsyncResult`` per rank, so a dead engine is seen at once (a task over
  several engines reports a death only when all complete);
* the first failure is remembered; ranks that can be released finish within
  the policy's grace (they fail too, or finish); ranks still running after it
  are stuck in a collective that no signal can break (gloo/NCCL wait in C++),
  and are killed;
* what became of each rank, and which failure is the headline, is decided
  in ``nbddp/execution/outcome.py``;
* every rank's heartbeat is watched (``nbddp.execution.stalls.StallGuard``): stalled
  ranks are shown, and fail the work after the policy's ``stall_timeout``; a
  process-group timeout's error carries the ranks' last stacks;
* about once a second the controller is checked: when it died, the wait
  fails within seconds instead of hanging (``Supervisor.controller_lost``);
  so is the Slurm job holding the engines, when there is one
  (``Supervisor.job_lost``: cancelled, out of time, a node lost).

``fail()`` builds the error to raise; the engines it killed or found dead
go to ``lose`` (by default the supervisor heals them in the background; a
sweep heals once its running trials have ended).
"""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING, Any, Callable

from nbddp.execution import outcome
from nbddp.execution.contracts import SessionLike
from nbddp.execution.outcome import Kind, RankOutcome
from nbddp.execution.policy import FailurePolicy
from nbddp.execution.stalls import StallGuard
from nbddp.protocol.errors import ClusterError, WorkerDied, WorkerError

if TYPE_CHECKING:
    from ipyparallel import AsyncResult

CONTROLLER_CHECK_S = 1.0
_TIMEOUT = re.compile(r"timed? ?out", re.IGNORECASE)  # gloo's "Timed out waiting ...", NCCL's watchdog "timeout"


class RankTasks:
    def __init__(self, session: SessionLike, ars: dict[int, AsyncResult], what: str, fit: bool = False,
                 policy: FailurePolicy | None = None, lose: Callable[[list[int]], None] | None = None,
                 failed_result: Callable[[Any], bool] | None = None, notify: Callable[[str], None] | None = None):
        """``ars``: rank -> the ``AsyncResult`` of that rank's task; ``what`` names the work in messages.

        ``fit``: the ranks mark their progress (``dist_fit``, a sweep trial), rather than being sampled;
        ``policy``: the grace after a first failure and the ``stall_timeout`` (the defaults when None);
        ``lose``: takes the engine ids killed or found dead (default: the supervisor replaces them now);
        ``failed_result``: a result that is a failure all the same (a planner trial out of memory): the
        others get the grace, then the ranks still running are killed as stuck and the results returned;
        ``notify``: how a stall's hint reaches the person (default: an ``NbddpWarning``).
        """
        self.session = session
        self.ars = ars  # rank -> AsyncResult
        self.what = what
        self.policy = policy or FailurePolicy()
        self.lose: Callable[[list[int]], None] = lose or self._replace
        self.failed_result = failed_result
        self.results: dict[int, Any] = {}
        self.failures: dict[int, tuple[float, BaseException]] = {}
        self.first_failure_at: float | None = None
        self.finished = False
        self.ended: list[RankOutcome] = []  # after fail(): every rank's outcome, the stuck ones killed included
        self.stalls = StallGuard(session, self, fit=fit, stall_timeout=self.policy.stall_timeout, notify=notify)
        self._next_check = time.monotonic() + CONTROLLER_CHECK_S

    def _replace(self, engine_ids: list[int]) -> None:
        """The default ``lose``: the supervisor replaces the engines in the background, now."""
        self.session.supervisor.recover(engine_ids)

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
            except BaseException as exc:  # noqa: BLE001 - classified in outcome.py
                self.failures[rank] = (outcome.finished_at(ar), exc)
                self._first_failure()
                continue
            if self.failed_result is not None and self.failed_result(self.results[rank]):
                self._first_failure()
        if not self.pending:
            return True
        return self.first_failure_at is not None and time.monotonic() - self.first_failure_at > self.policy.grace_s

    def _first_failure(self) -> None:
        if self.first_failure_at is None:
            self.first_failure_at = time.monotonic()

    def watch(self) -> None:
        """One look at the ranks' progress and at the controller; raises as the module docstring says."""
        self.stalls.tick()
        self._check_controller()

    def wait(self, on_tick: Callable[[], None] | None = None, tick_s: float = 0.05) -> dict[int, Any]:
        """Block until every rank finished (results by rank) or raise ``WorkerError``."""
        try:
            while not self.poll():
                if on_tick is not None:
                    on_tick()
                self.watch()
                self._sleep(tick_s)
            if on_tick is not None:
                on_tick()
        finally:
            self.finished = True
        if self.failures:
            raise self.fail()
        if self.pending:  # a failed result's peers, stuck in a collective after the grace
            self.lose(self.session.supervisor.kill_ranks(self.pending))
        return self.results

    # ---- what the work's own watcher asks of the stall guard ------------------------------
    def positions(self) -> list[dict[str, Any]]:
        """Every rank's latest position (phase, step), as its heartbeats said."""
        return self.stalls.watch.positions()

    def stalled(self) -> list[dict[str, Any]]:
        """The ranks stalled now, as the live view shows them."""
        return list(self.stalls.stalled)

    def check_stalls(self) -> None:
        """Read the ranks' beats now (``StallGuard.tick``: may raise ``WorkerStalled`` or ``StuckStop``)."""
        self.stalls.tick()

    def hold_stalls(self) -> None:
        """The ranks wait for the kernel (a callback, a debugger prompt): nobody's quiet time counts now."""
        self.stalls.watch.hold()

    def stopping(self) -> None:
        """A stop was sent: a stalled rank that cannot take it is killed after ``STOP_GRACE_S`` from now."""
        self.stalls.stop_at = time.monotonic()

    def pause_stall_timeout(self) -> None:
        """No ``WorkerStalled`` until ``restore_stall_timeout`` (a relaunch's replaced engines set up for seconds)."""
        self.stalls.stall_timeout = None

    @property
    def stall_timeout_paused(self) -> bool:
        return self.stalls.stall_timeout is None and self.policy.stall_timeout is not None

    def restore_stall_timeout(self) -> None:
        """The policy's ``stall_timeout`` applies again, counted from now for every rank."""
        self.stalls.watch.hold()
        self.stalls.stall_timeout = self.policy.stall_timeout

    def notify(self, text: str) -> None:
        """Tell the person (an ``NbddpWarning``; tests may catch the guard's ``notify``)."""
        self.stalls.notify(text)

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

    def outcomes(self) -> list[RankOutcome]:
        """What became of each rank that ended (``outcome.py`` decides)."""
        group = self.session.group
        placements = group.by_rank() if group is not None else {}
        found = [RankOutcome(r, Kind.FINISHED) for r in self.results]
        for rank, (at, exc) in self.failures.items():
            found.append(outcome.judge(rank, exc, placements.get(rank), outcome.raised_at(self.ars[rank], at)))
        return found

    def fail(self) -> WorkerError | ClusterError:
        """Kill stuck ranks, hand them and the dead to ``lose``, and build the error to raise."""
        workers = self.session.workers
        ended = workers.job_problem() if workers is not None else None
        if ended is not None:  # the ranks died because their Slurm job ended: that is the cause, and nothing heals
            return self.session.supervisor.job_lost(ended, self.what)
        stuck = self.pending
        self.stalls.tick(force=True)  # the last beats: a process-group timeout's error shows where every rank was
        placements = self.session.group.by_rank() if self.session.group is not None else {}
        killed = self.session.supervisor.kill_ranks(stuck)  # first, so they stop burning CPU meanwhile
        self.ended = self.outcomes() + [outcome.stuck(r) for r in stuck]
        failed = [o for o in self.ended if o.failure is not None]
        died: dict[int, tuple[str, str]] = {}
        for o in failed:
            if o.kind is Kind.DIED and o.failure is not None:
                p = placements[o.rank]
                how, tail = workers.how_died(p.pid) if workers is not None else ("died", "")
                o.failure.message = f"the worker process (pid {p.pid}) {how}"
                died[o.rank] = (how, tail)
                killed.append(p.engine_id)
        head, others = outcome.headline(failed)
        note = self._note(stuck, killed, died)
        if head.failure is not None and _TIMEOUT.search(head.failure.message):
            note = "\n".join(x for x in (note, self._last_stacks()) if x)
        # Any failure may leave a rank's process group unusable (a collective that
        # timed out or was cut short cannot be resumed), and the kernel cannot tell
        # which: the group is rebuilt as a new generation, replacing killed engines.
        self.lose(killed)
        rest = [o.failure for o in others if o.failure is not None]
        assert head.failure is not None
        if head.rank in died:
            how, tail = died[head.rank]
            return WorkerDied(head.failure, how, tail, rest, note)
        return WorkerError(head.failure, rest, note)

    def _note(self, stuck: list[int], killed: list[int], died: dict[int, tuple[str, str]]) -> str:
        note = ""
        if stuck:
            note = (f"rank(s) {', '.join(map(str, stuck))} were stuck in a collective and were killed; "
                    "replacement workers are starting, the next call waits for them")
        workers = self.session.workers
        if died and workers is not None and not workers.can_add_engines:
            note = "\n".join(x for x in (note, (
                f"nbddp cannot start engines on this attached cluster: start {len(killed)} more with "
                f"`ipcluster engines -n {len(killed)}` (same --profile/--cluster-id), then call nbddp.restart()")) if x)
        elif died and not stuck:
            note = "a replacement worker is starting; the next call waits for it"
        return note

    def _last_stacks(self) -> str:
        """Where each rank was last seen waiting (the heartbeats' stacks), labelled by rank."""
        stacks = self.stalls.watch.stacks()
        if not stacks:
            return ""
        return "the ranks' last stacks:\n" + "\n".join(f"[rank {r}]\n{stacks[r].rstrip()}" for r in sorted(stacks))
