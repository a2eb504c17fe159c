"""Work on the ranks: the one base every kind implements, and waiting for it in the notebook.

``Work`` is what holds the workers while it runs (``Session.running``): a fit
(``nbddp/fit/fit_run.py``), a prediction (``nbddp/inference/predict_run.py``),
a cell, call or script (``nbddp/execution/calls.py``), a sweep and each of
its trials (``nbddp/sweeps/scheduler.py``). Each says what it is, can be
asked to stop cleanly (``request_stop``: every rank at the same step) or
hard (``hard_stop``: its ranks killed and replaced), and is done once its
outcome is known.

A blocking call (``dist_fit``, ``FitHandle.wait``, ``%%ddp``, ``run_script``)
waits here. The first interrupt asks the work to stop cleanly (every rank at
the same step); the second kills what still runs. Interrupts arrive as
``KeyboardInterrupt``, or as torch elastic's ``SignalException`` once its
launcher has run in this process.
"""

from __future__ import annotations

import abc
import contextlib
import signal
import sys
import threading
import time
from collections.abc import Iterator
from types import FrameType
from typing import Callable, Protocol

from nbddp.execution.contracts import SessionLike
from nbddp.protocol.notices import logger


class Interruptible(Protocol):
    """What a cell (or a handle) waiting for work needs of it: ``Work`` below, or a Protocol naming a kind of it."""

    def wait_done(self, timeout: float | None) -> bool: ...

    def attend(self) -> None: ...

    def request_stop(self) -> None: ...

    def hard_stop(self, reason: str = ...) -> None: ...


class Work(abc.ABC):
    """One piece of work on the ranks (see the module docstring)."""

    def __init__(self, session: SessionLike, description: str):
        self.session = session
        self.description = description  # "a dist_fit", "%%ddp cell": names the work in messages
        self.done_event = threading.Event()
        self._when_done: list[Callable[[], None]] = []  # told once the work ended (its handle, execution/handle.py)
        self._ending: list[Callable[[], None]] = []  # told as it ends, before anyone waiting for it wakes
        self._done_lock = threading.Lock()

    @property
    def finished(self) -> bool:
        """Whether the work has ended (done, stopped or failed)."""
        return self.done_event.is_set()

    def wait_done(self, timeout: float | None) -> bool:
        """Wait up to ``timeout`` seconds for the end; whether it ended."""
        return self.done_event.wait(timeout)

    def when_done(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` once the work has ended: in the thread that ends it, or now if it has."""
        with self._done_lock:
            if not self.done_event.is_set():
                self._when_done.append(fn)
                return
        fn()

    def on_ending(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` as the work ends, before a waiting cell returns (a detached session's record is
        brought up to date before the kernel may exit: ``nbddp/detached/journal.py``)."""
        self._ending.append(fn)

    def set_done(self) -> None:
        """The work has ended: its outcome is known. Wakes the waiters, then calls what ``when_done`` was given."""
        for fn in self._ending:
            try:
                fn()
            except Exception:  # noqa: BLE001 - the work's end must come, whatever a listener does
                logger.exception("nbddp: a listener for the end of %s failed", self.description)
        with self._done_lock:
            self.done_event.set()
            told, self._when_done = self._when_done, []
        for fn in told:
            try:
                fn()
            except Exception:  # noqa: BLE001 - one listener's bug must not keep the others from the news
                logger.exception("nbddp: a listener for the end of %s failed", self.description)

    def describe(self) -> str:
        return self.description

    def attend(self) -> None:
        """From the waiting cell: open the debugger prompt for ranks of this work paused at ``breakpoint()``."""
        self.session.attend(self)

    def release_workers(self) -> None:
        """The workers are free for other work (unless a restart gave them to other work meanwhile)."""
        if self.session.running is self:
            self.session.running = None

    @abc.abstractmethod
    def request_stop(self) -> None:
        """The coordinated stop: every rank stops at the same point; the work then ends as stopped."""

    @abc.abstractmethod
    def hard_stop(self, reason: str = "a second interrupt") -> None:
        """Kill the ranks still running (the supervisor replaces them)."""


def is_interrupt(exc: BaseException) -> bool:
    """Kernel > Interrupt, as whatever SIGINT handler the kernel has raises it.

    Usually ``KeyboardInterrupt``; but once torch's elastic launcher has run in
    this process (``accelerate.notebook_launcher``, ``torch.distributed.run``
    used in-process), SIGINT raises its ``SignalException`` instead.
    """
    if isinstance(exc, KeyboardInterrupt):
        return True
    elastic = sys.modules.get("torch.distributed.elastic.multiprocessing.api")
    signal_exc = getattr(elastic, "SignalException", None)
    return signal_exc is not None and isinstance(exc, signal_exc) and getattr(exc, "sigval", None) == signal.SIGINT


@contextlib.contextmanager
def interrupts_held() -> Iterator[list[int]]:
    """Kernel > Interrupt while work is being launched is held until the launch is done, then counted as the first.

    Between the first task sent and the work's watcher set up, a
    ``KeyboardInterrupt`` would leave the ranks running with nobody to stop
    them or wait for them. The list yielded holds the signals that came
    meanwhile; give its length to ``wait_interruptibly(already=...)``. Only
    the main thread receives signals, so elsewhere nothing is held.
    """
    if threading.current_thread() is not threading.main_thread():
        yield []
        return
    came: list[int] = []
    previous = signal.getsignal(signal.SIGINT)

    def hold(signum: int, frame: FrameType | None) -> None:
        came.append(signum)

    signal.signal(signal.SIGINT, hold)
    try:
        yield came
    finally:
        signal.signal(signal.SIGINT, previous)


def wait_interruptibly(work: Interruptible, timeout: float | None = None, tick_s: float = 0.1,
                       on_first_interrupt: Callable[[], None] | None = None, already: int = 0) -> bool:
    """Wait for ``work``; True when it ended, False when ``timeout`` passed first.

    The first interrupt calls ``on_first_interrupt()`` (default:
    ``work.request_stop()``) and goes on waiting; the second calls
    ``work.hard_stop()``. ``already``: interrupts held while the work was
    launched (``interrupts_held``), counted first.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    interrupts = min(already, 1)
    if interrupts:
        (on_first_interrupt or work.request_stop)()
    while True:
        try:
            while not work.wait_done(tick_s):
                work.attend()  # a rank paused at breakpoint(): the prompt opens here, in the waiting cell
                if deadline is not None and time.monotonic() > deadline:
                    return False
            return True
        except BaseException as exc:
            if not is_interrupt(exc):
                raise
            interrupts += 1
            if interrupts == 1:
                (on_first_interrupt or work.request_stop)()
            else:
                work.hard_stop("a second interrupt")
