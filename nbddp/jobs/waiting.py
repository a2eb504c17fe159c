"""Waiting in the notebook for work on the ranks, with Kernel > Interrupt as a stop.

A blocking call (``dist_fit``, ``FitHandle.wait``, ``%%ddp``, ``run_script``)
waits here. The first interrupt asks the work to stop cleanly (every rank at
the same step); the second kills what still runs. Interrupts arrive as
``KeyboardInterrupt``, or as torch elastic's ``SignalException`` once its
launcher has run in this process.
"""

from __future__ import annotations

import signal
import sys
import time
from typing import Callable, Protocol

from nbddp.debugging.prompt import attend


class Stoppable(Protocol):
    """What ``wait_interruptibly`` needs of the work it waits for."""

    def wait_done(self, timeout: float) -> bool: ...

    def request_stop(self) -> None: ...

    def hard_stop(self, reason: str = ...) -> None: ...


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


def wait_interruptibly(work: Stoppable, timeout: float | None = None, tick_s: float = 0.1,
                       on_first_interrupt: Callable[[], None] | None = None) -> bool:
    """Wait for ``work``; True when it ended, False when ``timeout`` passed first.

    The first interrupt calls ``on_first_interrupt()`` (default:
    ``work.request_stop()``) and goes on waiting; the second calls
    ``work.hard_stop()``.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    interrupts = 0
    while True:
        try:
            while not work.wait_done(tick_s):
                attend(work)  # a rank paused at breakpoint(): the prompt opens here, in the waiting cell
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
