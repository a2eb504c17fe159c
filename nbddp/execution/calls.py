"""Work on the ranks that the calling cell waits for: ``%%ddp`` cells, ``run``, scripts, push and pull, and the
planner's short runs.

A ``RankCall`` launches one task per chosen rank under the session's lock,
holds the workers while it runs (``Session.running``), and waits with the
fault contract of ``nbddp.execution.rank_tasks.RankTasks``: the first failing rank is raised
as a ``WorkerError`` at once, ranks stuck in a collective are killed and
replaced.

Kernel > Interrupt: the first one is forwarded to the ranks still running as
SIGINT (a ``KeyboardInterrupt`` in their code, as in a local cell); the
second kills them, and the supervisor replaces them. A rank that stalled
(``nbddp/execution/stalls.py``: stuck in a collective or in C code, where
SIGINT cannot land) is killed a short grace after the first.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Sequence
from typing import Any, Callable

from nbddp.execution.contracts import SessionLike
from nbddp.execution.rank_tasks import RankTasks
from nbddp.execution.send import to_ranks
from nbddp.execution.stalls import StuckStop
from nbddp.execution.work import Work, interrupts_held, is_interrupt
from nbddp.protocol.errors import WorkerError
from nbddp.protocol.placement import Placement


Targets = Sequence[int] | slice | int | None  # the ranks to run on: a list, a slice of them, one, or all (None)


class RankCall(Work):
    def __init__(self, session: SessionLike, what: str, ranks: Targets = None,
                 failed_result: Callable[[Any], bool] | None = None):
        """``ranks``: the ranks to run on (all by default); ``what`` names the work in messages;
        ``failed_result``: see ``RankTasks``."""
        super().__init__(session, what)
        self.what = what
        self.ranks = ranks
        self.failed_result = failed_result
        self.held_interrupts = 0  # Kernel > Interrupt while it was launched (work.interrupts_held)
        self._tasks: RankTasks | None = None
        self._waiter: int | None = None  # the thread waiting in wait()
        self.interrupted = False
        self.person_interrupts = 0  # Kernel > Interrupt while waiting
        # a stop the call's own code agrees to (nbddp.should_stop(), cells/reported_call.py): True if it took
        # the first interrupt, so that the ranks end at one step instead of a KeyboardInterrupt each
        self.soft_stop: Callable[[], bool] | None = None

    @property
    def tasks(self) -> RankTasks:
        """The ranks' tasks (after ``launch``)."""
        if self._tasks is None:
            raise RuntimeError(f"{self.what} was not launched")
        return self._tasks

    # ---- the work protocol (Session.running) -----------------------------------
    def request_stop(self) -> None:
        """Forward an interrupt to the ranks still running."""
        if self.finished:
            return
        if self.soft_stop is not None and not self.interrupted and self.soft_stop():
            self.interrupted = True  # a second interrupt kills, as for any call
            return
        self.interrupted = True
        self.tasks.stopping()
        self.session.debugger.let_go(self, f"{self.what} is being interrupted")
        group = self.session.group
        by_rank = group.by_rank() if group is not None else {}
        workers = self.session.workers
        if workers is not None:
            workers.signal([by_rank[r].engine_id for r in self.tasks.pending if r in by_rank], signal.SIGINT)

    def hard_stop(self, reason: str = "a second interrupt") -> None:
        """Kill the ranks still running (the supervisor replaces them); from another thread, wait for the end."""
        if self._tasks is None or self.finished:
            return
        self.session.supervisor.replace_ranks(self._tasks.pending)
        if threading.get_ident() != self._waiter:
            self.done_event.wait(10.0)

    # ---- running -------------------------------------------------------------------
    def launch(self, fn: Callable[..., Any], args_for: Callable[[Placement], tuple[Any, ...]],
               listen: Callable[[int, Any], None] | None = None) -> list[Placement]:
        """Send ``fn(*args_for(p))`` to every chosen rank ``p``; return the placements.

        Call holding the session's lock, after ``ensure_ready()``; ``listen``: see ``nbddp.execution.send.to_ranks``.
        """
        s = self.session
        chosen = placements_for(s, self.ranks)
        s.follow_kernel_paths()
        self._tasks = RankTasks(s, to_ranks(s.client, chosen, fn, args_for, listen), self.what,
                                failed_result=self.failed_result)
        s.running = self
        return chosen

    def wait(self, on_tick: Callable[[], None] | None = None) -> dict[int, Any]:
        """Results by rank, or the first rank's ``WorkerError``; interrupts as the module docstring says."""
        self._waiter = threading.get_ident()

        def tick() -> None:  # a rank paused at breakpoint(): the prompt opens in this cell
            if on_tick is not None:
                on_tick()
            self.attend()

        try:
            if self.held_interrupts:  # the first interrupt came while the tasks were being sent
                self.person_interrupts += 1
                self.request_stop()
            while True:
                try:
                    return self.tasks.wait(on_tick=tick)
                except StuckStop as exc:
                    raise KeyboardInterrupt(f"{self.what} interrupted: {exc}") from None
                except BaseException as exc:
                    if not is_interrupt(exc):
                        raise
                    self.person_interrupts += 1
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
            self.set_done()
            self.release_workers()


class UnknownRanks(ValueError):
    """``ranks=`` names a rank the workers do not have; ``detail`` says which, without the call's name."""

    def __init__(self, ranks: Targets, detail: str):
        self.ranks, self.detail = ranks, detail
        super().__init__(f"ranks={ranks}: {detail}")


def chosen_ranks(ranks: Targets, world_size: int) -> list[int] | None:
    """``ranks`` as a sorted list of ranks (None: all), as ipyparallel reads ``targets``: a slice is taken of
    ``range(world_size)`` (``::2`` is every other rank), a negative rank counts from the end."""
    if ranks is None:
        return None
    if isinstance(ranks, slice):
        chosen = list(range(world_size))[ranks]
        if not chosen:
            raise UnknownRanks(ranks, f"the slice {slice_text(ranks)} takes no rank of 0..{world_size - 1}")
        return chosen
    listed = [ranks] if isinstance(ranks, int) else list(ranks)
    if not listed or not all(isinstance(r, int) and not isinstance(r, bool) for r in listed):
        raise TypeError(f"ranks={ranks!r}: give ranks as ints, a list of them or a slice, e.g. [0, 2] or slice(None, "
                        "None, 2)")
    return sorted({r + world_size if -world_size <= r < 0 else r for r in listed})


def slice_text(s: slice) -> str:
    """``slice(None, None, 2)`` as written in a subscript: ``::2``."""
    text = ":".join("" if v is None else str(v) for v in (s.start, s.stop, s.step))
    return text[:-1] if s.step is None else text


def placements_for(session: SessionLike, ranks: Targets) -> list[Placement]:
    """The placements of ``ranks`` (all ranks for None); a rank that does not exist is a clear error."""
    listed = chosen_ranks(ranks, session.world_size)
    if listed is None:
        return list(session.placements)
    group = session.group
    by_rank = group.by_rank() if group is not None else {}
    unknown = [r for r in listed if r not in by_rank]
    if unknown:
        raise UnknownRanks(ranks, f"no rank {', '.join(map(str, unknown))}; "
                                  f"the workers have ranks 0..{session.world_size - 1}")
    return [by_rank[r] for r in listed]


def call_on_ranks(session: SessionLike, what: str, fn: Callable[..., Any],
                  args_for: Callable[[Placement], tuple[Any, ...]], ranks: Targets = None,
                  listen: Callable[[int, Any], None] | None = None) -> RankCall:
    """Start the default workers if needed, launch ``fn`` on ``ranks`` under the lock: the call, to ``wait`` for.

    ``listen(rank, message_future)``: given each rank's task before it leaves (``nbddp.execution.send.to_ranks``).
    """
    session.ensure_started()
    call = RankCall(session, what, ranks)
    with interrupts_held() as held, session.lock:
        session.ensure_ready()
        call.launch(fn, args_for, listen)
    call.held_interrupts = len(held)
    return call
