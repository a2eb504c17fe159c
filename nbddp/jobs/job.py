"""Work on the ranks that the calling cell waits for: ``%%ddp`` cells, ``run``, scripts, push and pull.

A ``Job`` launches one task per chosen rank under the session's lock, holds
the workers while it runs (``Session.running``), and waits with the fault
contract of ``tasks.RankTasks``: the first failing rank is raised as a
``WorkerError`` at once, ranks stuck in a collective are killed and replaced.

Kernel > Interrupt: the first one is forwarded to the ranks still running as
SIGINT (a ``KeyboardInterrupt`` in their code, as in a local cell); the
second kills them, and the supervisor replaces them. A rank that stalled
(``stalls``: stuck in a collective or in C code, where SIGINT cannot land)
is killed a short grace after the first.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any, Callable

from nbddp.debugging.prompt import attend
from nbddp.protocol.errors import WorkerError
from nbddp.jobs.rank_output import RankOutput
from nbddp.monitor.stalls import StuckStop
from nbddp.jobs.rank_tasks import RankTasks
from nbddp.jobs.waiting import is_interrupt


class Job:
    def __init__(self, session: Any, what: str, ranks: list[int] | None = None):
        """``ranks``: the ranks to run on (all by default); ``what`` names the work in messages."""
        self.session = session
        self.what = what
        self.ranks = ranks
        self.tasks: RankTasks | None = None
        self._done = threading.Event()
        self._waiter: int | None = None  # the thread waiting in wait()
        self.interrupted = False

    # ---- the work protocol (Session.running) -----------------------------------
    @property
    def finished(self) -> bool:
        return self._done.is_set()

    def wait_done(self, timeout: float) -> bool:
        return self._done.wait(timeout)

    def describe(self) -> str:
        return self.what

    def request_stop(self) -> None:
        """Forward an interrupt to the ranks still running."""
        self.interrupted = True
        self.tasks.stalls.stop_at = time.monotonic()
        self.session.debugger.let_go(self, f"{self.what} is being interrupted")
        by_rank = self.session.group.by_rank()
        self.session.workers.signal([by_rank[r].engine_id for r in self.tasks.pending if r in by_rank], signal.SIGINT)

    def hard_stop(self, reason: str = "a second interrupt") -> None:
        """Kill the ranks still running (the supervisor replaces them); from another thread, wait for the end."""
        if self.tasks is None or self.finished:
            return
        self.session.supervisor.replace_ranks(self.tasks.pending)
        if threading.get_ident() != self._waiter:
            self._done.wait(10.0)

    # ---- running -------------------------------------------------------------------
    def launch(self, submit: Callable[[Any], Any]) -> list[Any]:
        """Submit ``submit(placement) -> AsyncResult`` on every chosen rank; return the placements.

        Call holding the session's lock, after ``ensure_ready()``.
        """
        s = self.session
        chosen = placements_for(s, self.ranks)
        s.follow_kernel_paths()
        self.tasks = RankTasks(s, {p.rank: submit(p) for p in chosen}, self.what)
        s.running = self
        return chosen

    def wait(self, on_tick: Callable[[], None] | None = None) -> dict[int, Any]:
        """Results by rank, or the first rank's ``WorkerError``; interrupts as the module docstring says."""
        self._waiter = threading.get_ident()

        def tick() -> None:  # a rank paused at breakpoint(): the prompt opens in this cell
            if on_tick is not None:
                on_tick()
            attend(self)

        try:
            while True:
                try:
                    return self.tasks.wait(on_tick=tick)
                except StuckStop as exc:
                    raise KeyboardInterrupt(f"{self.what} interrupted: {exc}") from None
                except BaseException as exc:
                    if not is_interrupt(exc):
                        raise
                    if self.interrupted:
                        self.hard_stop()
                        raise KeyboardInterrupt(
                            f"{self.what}: killed the ranks still running after a second interrupt; replacement "
                            "workers are starting (names defined on them are lost)") from None
                    self.request_stop()
        except WorkerError as exc:
            if self.interrupted:
                raise KeyboardInterrupt(f"{self.what} interrupted on every rank ({exc})") from None
            raise
        finally:
            self._done.set()
            if self.session.running is self:
                self.session.running = None


class UnknownRanks(ValueError):
    """``ranks=`` names a rank the workers do not have; ``detail`` says which, without the call's name."""

    def __init__(self, ranks: list[int], detail: str):
        self.ranks, self.detail = ranks, detail
        super().__init__(f"ranks={ranks}: {detail}")


def placements_for(session: Any, ranks: list[int] | None) -> list[Any]:
    """The placements of ``ranks`` (all ranks for None); a rank that does not exist is a clear error."""
    if ranks is None:
        return list(session.placements)
    by_rank = session.group.by_rank()
    unknown = [r for r in ranks if r not in by_rank]
    if unknown:
        raise UnknownRanks(ranks, f"no rank {', '.join(map(str, unknown))}; "
                                  f"the workers have ranks 0..{session.world_size - 1}")
    return [by_rank[r] for r in ranks]


def run_job(session: Any, what: str, submit: Callable[[Any], Any], ranks: list[int] | None = None,
            output: bool | None = None) -> dict[int, Any]:
    """Start the default workers if needed, launch ``submit`` on ``ranks``, wait: results by rank.

    ``output``: print what the ranks print, labelled ``[rank N]``, as it
    arrives (True) or grouped by rank at the end (False); None prints nothing.
    """
    session.ensure_started()
    job = Job(session, what, ranks)
    with session.lock:
        session.ensure_ready()
        job.launch(submit)
    if output is None:
        return job.wait()
    printer = RankOutput(job.tasks.ars, live=output)
    try:
        return job.wait(on_tick=printer.tick)
    finally:
        printer.finish(job.tasks)
