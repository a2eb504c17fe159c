"""Seeing a rank that stopped advancing, on the kernel's side.

Every rank's monitor (``nbddp.worker.engine.heartbeat``) publishes a ``messages.Beat``
about once a second, independent of ``log_every`` and without a collective:
its progress counter, phase, step and micro-batch, and its stack once it
stops advancing. ``StallWatch`` keeps each rank's latest beat and when (on
the kernel's clock) its progress counter last changed.

A rank is *stalled* when its counter has not changed for
``max(MIN_STALL_S, STEP_FACTOR x its recent step time)`` and it is behind
another rank's position (micro-batch, then phase; a rank that finished is
ahead of all): the others wait for it. In a fit, when every rank is at the
same position and none advances, all are stalled. ``StallGuard`` applies
this to one piece of work at every tick of its wait (``nbddp.execution.rank_tasks.RankTasks``):

* the stalled ranks are shown (``stalled``; the live view draws them) and a
  hint is printed once;
* with ``stall_timeout``, a rank without progress for that long fails the
  work with ``WorkerStalled``: the stalled ranks and every rank still running
  (they wait for it in a collective) are killed and replaced;
* after a stop was requested (an interrupt, ``handle.stop()``), a stalled
  rank that still has not moved ``STOP_GRACE_S`` later cannot stop: the ranks
  still running are killed and replaced (``StuckStop``).

A rank held at a debugger prompt (its beat says ``paused``, or it is on the
kernel's ``DebugBoard``) is not stalled, and neither are the ranks waiting
for it: the quiet time of every rank counts from the last moment a rank was
seen paused, so no ``WorkerStalled``, kill or replacement happens while one
is, whatever ``stall_timeout`` says.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

from nbddp.execution.contracts import SessionLike
from nbddp.execution.rank_stacks import collect
from nbddp.protocol.errors import RankFailure, WorkerStalled
from nbddp.protocol.messages import Beat, innermost_frames, published
from nbddp.protocol.notices import notify

if TYPE_CHECKING:
    from ipyparallel import AsyncResult

MIN_STALL_S = 10.0
STEP_FACTOR = 10.0
STOP_GRACE_S = 3.0
WAITING_S = 2.0  # quiet this long in a collective: shown "waiting" (for a peer)
TICK_S = 0.25
# where a rank is within one micro-batch; code that marks nothing (cells, calls, scripts) is behind
# a rank waiting in a collective
# ("compiling": Dynamo and Inductor at work inside a forward or backward, worker/training/compile_watch.py;
# "callbacks": rank 0 waiting for the kernel's on_epoch_end, worker/training/kernel_answers.py)
PHASE_ORDER = {"setup": 0, "cell": 0, "call": 0, "script": 0, "push": 0, "data": 1, "compiling": 2, "forward": 2,
               "backward": 3, "optimizer": 4, "collective": 5, "validation": 6, "checkpoint": 7, "callbacks": 7,
               "finish": 8}
FINISHED = (sys.maxsize, 0)
UNSEEN = (-1, -1)


class StuckStop(Exception):
    """A stop was requested, and a stalled rank could not take it: the ranks still running were killed."""


def position(beat: Beat | None) -> tuple[int, int]:
    if beat is None:
        return UNSEEN
    return (beat.micro, PHASE_ORDER.get(beat.phase, 0))


@dataclass
class Seen:
    beat: Beat | None
    changed: float  # kernel clock: when the rank's progress counter last changed (or the watch began)
    phase_since: float = 0.0  # kernel clock: when the rank's beats began to name their present phase


class StallWatch:
    """Each rank's latest beat, and which ranks are stalled (pure: no processes)."""

    def __init__(self, ranks: list[int], clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        now = clock()
        self.seen = {r: Seen(None, now) for r in ranks}
        self.done: set[int] = set()
        self.held = float("-inf")  # kernel clock: when a rank was last seen paused at a debugger prompt

    def feed(self, rank: int, beat: object) -> None:
        """What the rank published last as its heartbeat (a ``Beat``; anything else, or None, is passed over)."""
        seen = self.seen[rank]
        if not isinstance(beat, Beat) or (seen.beat is not None and beat.seq == seen.beat.seq):
            return
        if seen.beat is None or beat.progress != seen.beat.progress:
            seen.changed = self.clock()
        if seen.beat is None or beat.phase != seen.beat.phase:
            seen.phase_since = self.clock()
        seen.beat = beat
        if beat.phase == "paused":
            self.hold()

    def hold(self) -> None:
        """A rank is paused at a debugger prompt now: nobody's quiet time counts until it goes on."""
        self.held = self.clock()

    def finish(self, rank: int) -> None:
        self.done.add(rank)

    def quiet_s(self, rank: int) -> float:
        return self.clock() - max(self.seen[rank].changed, self.held)

    def threshold(self, rank: int) -> float:
        beat = self.seen[rank].beat
        return max(MIN_STALL_S, STEP_FACTOR * (beat.step_time_s if beat is not None else 0.0))

    def stalled(self, threshold: float | None = None, all_quiet: bool = True) -> list[dict[str, Any]]:
        """The stalled ranks, as the live view shows them; ``threshold`` overrides each rank's own."""
        running = [r for r in self.seen if r not in self.done]
        quiet = {r for r in running if self.quiet_s(r) >= (self.threshold(r) if threshold is None else threshold)}
        if not quiet:
            return []
        where = {r: position(self.seen[r].beat) for r in running}
        front = FINISHED if self.done else max(where.values())
        found = [r for r in quiet if where[r] < front]
        if not found and all_quiet and not self.done and quiet == set(running) and len(set(where.values())) == 1:
            found = list(quiet)  # nobody is ahead and nobody moves: all are stuck
        return [self.describe(r) for r in sorted(found)]

    def describe(self, rank: int) -> dict[str, Any]:
        beat = self.seen[rank].beat
        return {"rank": rank, "phase": beat.phase if beat else "starting", "step": beat.step if beat else 0,
                "micro": beat.micro if beat else 0, "idle_s": self.quiet_s(rank), "stack": beat.stack if beat else ""}

    def positions(self) -> list[dict[str, Any]]:
        """Every rank's latest position, for the live view.

        A rank quiet in a collective (or a pipeline stage blocked on a send or
        receive) for ``WAITING_S``, and not stalled itself, is shown
        ``"waiting"``: it waits for a peer, the one that ``stalled()`` names.
        """
        out = []
        stalled = {s["rank"] for s in self.stalled()}
        for rank, seen in sorted(self.seen.items()):
            beat = seen.beat
            if beat is not None:
                phase = "done" if rank in self.done else beat.phase
                if phase == "collective" and self.quiet_s(rank) >= WAITING_S and rank not in stalled:
                    phase = "waiting"
                elif phase == "compiling":  # how long this compile has run: minutes are normal on a first fit
                    phase = f"compiling {self.clock() - seen.phase_since:.0f} s"
                out.append({"rank": rank, "phase": phase, "step": beat.step, "micro": beat.micro,
                            "idle_s": self.quiet_s(rank)})
        return out

    def stacks(self) -> dict[int, str]:
        """rank -> the last stack each rank sent (ranks that never stopped advancing sent none)."""
        return {r: s.beat.stack for r, s in self.seen.items() if s.beat is not None and s.beat.stack}


def describe(stall: dict[str, Any], who: bool = True) -> str:
    """``"rank 1 has made no progress for 12 s in data (step 3, micro-batch 7)"``; without ``who``, no rank."""
    where = f"in {stall['phase']}" + (f" (step {stall['step']}, micro-batch {stall['micro']})" if stall["micro"] else "")
    text = f"made no progress for {stall['idle_s']:.0f} s {where}"
    return f"rank {stall['rank']} has {text}" if who else text


class GuardedTasks(Protocol):
    """What the guard reads of the work's tasks (``rank_tasks.py``'s ``RankTasks``, which imports this module)."""

    ars: dict[int, AsyncResult]
    results: dict[int, Any]
    failures: dict[int, tuple[float, BaseException]]
    lose: Callable[[list[int]], None]

    @property
    def pending(self) -> list[int]: ...


class StallGuard:
    """Stall detection for one piece of work (the tasks of a fit, a cell, a call, a script or a sweep trial).

    ``tasks`` is the work's ``RankTasks``: the guard reads its ranks'
    published beats, and what finished. Killed ranks are handed to
    ``tasks.lose`` (healed at once, or after a sweep's running trials end).
    """

    def __init__(self, session: SessionLike, tasks: GuardedTasks, fit: bool, stall_timeout: float | None = None,
                 notify: Callable[[str], None] | None = None):
        self.session, self.tasks, self.fit = session, tasks, fit
        self.stall_timeout = stall_timeout
        self.notify = notify or notify_person
        self.watch = StallWatch(list(tasks.ars))
        self.stalled: list[dict[str, Any]] = []
        self.stop_at: float | None = None  # when a stop was requested (kernel clock)
        self._hinted = False
        self._next = 0.0

    def tick(self, force: bool = False) -> None:
        """Read every rank's latest beat; raise ``WorkerStalled`` or ``StuckStop`` as the module docstring says.

        ``force``: only read the beats now (when the work has already failed).
        """
        now = time.monotonic()
        if now < self._next and not force:
            return
        self._next = now + TICK_S
        self.read()
        if self.session.debugger.paused():
            self.watch.hold()
        if force:
            return
        self.stalled = self.watch.stalled(all_quiet=self.fit)
        if self.stall_timeout is not None:
            over = self.watch.stalled(self.stall_timeout, all_quiet=self.fit)
            if over:
                raise self.fail(over)
        if self.stalled and self.stop_at is not None and now - self.stop_at >= STOP_GRACE_S:
            raise self.stuck_stop()
        if self.stalled and not self._hinted and self.stop_at is None:
            self._hinted = True
            self.notify(self.hint())

    def read(self) -> None:
        for rank, ar in self.tasks.ars.items():
            self.watch.feed(rank, published(ar, "beat"))
            if rank in self.tasks.results or rank in self.tasks.failures:
                self.watch.finish(rank)

    def hint(self) -> str:
        lines = [f"nbddp: {describe(s)}; the other ranks wait for it." for s in self.stalled]
        for s in self.stalled:
            inner = innermost_frames(s["stack"])
            if inner:
                lines.append(f"rank {s['rank']} is here (innermost frames):\n{inner}")
        if self.fit:
            lines.append("dist_fit(stall_timeout=SECONDS) (or nbddp.start(stall_timeout=...)) fails a stalled fit "
                         "and replaces the stalled ranks; Kernel > Interrupt or handle.stop() stops it.")
        else:
            lines.append("Kernel > Interrupt stops it: a rank that cannot stop is killed and replaced.")
        lines.append("%ddp stacks (nbddp.stacks()) shows every rank's stack, e.g. from another cell with "
                     "dist_fit(..., block=False).")
        return "\n".join(lines)

    def kill_running(self) -> list[int]:
        """Kill the ranks still running (the stalled ones and those waiting for them); they are replaced."""
        ranks = list(self.tasks.pending)
        self.tasks.lose(self.session.supervisor.kill_ranks(ranks))
        return ranks

    def fail(self, over: list[dict[str, Any]]) -> WorkerStalled:
        """``WorkerStalled`` for ``over``, with every running rank's stack; the running ranks are killed first."""
        stacks = self.current_stacks()
        killed = self.kill_running()
        group = self.session.group
        by_rank = group.by_rank() if group is not None else {}
        failures = []
        for s in over:
            p = by_rank.get(s["rank"])
            message = f"{describe(s, who=False)}; stall_timeout={self.stall_timeout:g} s"
            failures.append(RankFailure(s["rank"], "WorkerStalled", message, stacks.get(s["rank"], ""),
                                        p.pid if p else None, p.host if p else "", p.engine_id if p else None))
        note = (f"rank(s) {', '.join(map(str, killed))} were killed (the stalled rank(s) and those waiting for them); "
                "replacement workers are starting, the next call waits for them")
        return WorkerStalled(failures[0], [s["rank"] for s in over], stacks, failures[1:], note)

    def stuck_stop(self) -> StuckStop:
        killed = self.kill_running()
        what = "; ".join(describe(s) for s in self.stalled)
        return StuckStop(f"{what}, so it could not stop: rank(s) {', '.join(map(str, killed))} were killed and "
                         "replacement workers are starting")

    def current_stacks(self) -> dict[int, str]:
        """The ranks' last stacks; a running rank that sent none is asked now (``rank_stacks.collect``)."""
        stacks = self.watch.stacks()
        missing = [r for r in self.tasks.pending if r not in stacks]
        group = self.session.group
        if missing and group is not None:
            busy = {r: self.tasks.ars[r] for r in missing}
            asked, _ = collect(self.session, list(group.placements), busy, 3.0, ranks=missing)
            stacks.update({e.rank: e.text for e in asked if e.text})
        return stacks


def notify_person(text: str) -> None:
    """A stall's hint, or how a stop ended, as an ``NbddpWarning`` (filterable; shown once per text)."""
    notify(text)
