"""Kernel > Interrupt for tests: SIGINT the main thread from a helper thread once something has happened."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from typing import Callable, Iterator


@contextlib.contextmanager
def interrupt_when(condition: Callable[[], bool], *, times: int = 1, gap: float = 1.0, timeout: float = 60.0,
                   on_signal: Callable[[int], None] | None = None) -> Iterator[None]:
    """Send SIGINT to the main thread ``times`` times (``gap`` s apart) once ``condition()`` holds.

    Nothing is sent once the block has ended, nor when ``condition`` does not
    hold within ``timeout``: a block that failed early must not leave a signal
    on its way to a later test (one such stray signal ended a whole CI run).
    ``on_signal(i)`` runs just before the i-th signal.
    """
    main = threading.main_thread().ident
    done = threading.Event()

    def fire() -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if done.wait(0.02) or time.monotonic() > deadline:
                return
        for i in range(times):
            if done.is_set():
                return
            if on_signal is not None:
                on_signal(i)
            signal.pthread_kill(main, signal.SIGINT)
            if i + 1 < times:
                done.wait(gap)

    thread = threading.Thread(target=fire, name="test-interrupter", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
