"""One handle for all work that runs while the notebook stays usable: a ``concurrent.futures.Future``.

``dist_fit``, ``predict``, ``evaluate`` and ``sweep`` with ``block=False``,
``run(..., block=False)``, ``run_cell(..., block=False)`` and ``%%ddp
--noblock`` each return a ``WorkHandle``: ``FitHandle``
(``nbddp/fit/handle.py``), ``PredictHandle``
(``nbddp/inference/predict_run.py``), ``SweepHandle``
(``nbddp/sweeps/handle.py``) or ``CallHandle``
(``nbddp/cells/call_handle.py``). Each kind adds its extras; the common
part means one thing everywhere, as ipyparallel's ``AsyncResult`` (a
``Future`` too) and ``asyncio.Task`` have taught people:

* ``done()``, ``running()``; ``result(timeout=None)`` (``wait`` is its
  alias) and ``exception(timeout=None)`` wait as a blocking call waits:
  Kernel > Interrupt stops the work (every rank at the same point), a second
  kills its ranks; ``TimeoutError`` once ``timeout`` passes (the work goes on).
* ``stop(wait=True)``: the coordinated stop; with ``wait``, what the stopped
  work returns (a fit's ``History``, a sweep's ``SweepResult``), or None for
  a call that returns nothing once stopped (predict, evaluate, run, a cell).
* ``cancel()``: the same stop, asked without waiting, as
  ``asyncio.Task.cancel``: True unless the work had ended. The handle is
  cancelled once every rank has stopped and the workers are free:
  ``cancelled()`` is then True and ``result()`` raises ``CancelledError``. A
  failure that is not the stop's own stays the handle's exception.
* ``add_done_callback(fn)``: ``fn(handle)`` once the outcome is known, in
  the thread that learnt it (the work's watcher), or at once.
* ``await handle``: ``asyncio.wrap_future`` on the kernel's event loop, so
  the loop goes on (widget messages such as the Stop button, other tasks)
  while the work's own thread draws the live view. Cancelling the awaiting
  task (Kernel > Interrupt of an ``await`` cell) cancels the handle. A
  stopped call that returns nothing raises ``asyncio.CancelledError`` there,
  never ``KeyboardInterrupt``, which would leave the event loop.
* ``concurrent.futures.wait``/``as_completed`` and ``asyncio.gather`` take
  handles as they are.

The ``Future`` stays pending until the outcome is known (``running()``
says the truth instead), so that a cancel ends through ``Future``'s own
public steps: ``cancel``, then ``set_running_or_notify_cancel``, which
wakes ``concurrent.futures.wait``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Generator
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from typing import Any, Callable, TypeVar

from nbddp.execution.work import Interruptible, is_interrupt, wait_interruptibly

T = TypeVar("T")


def check_block(block: object, where: str) -> None:
    """``where(block=...)`` is True or False (a string such as "no" would read as True)."""
    if not isinstance(block, bool):
        raise TypeError(f"{where}(block=...) must be True or False, got {block!r}")


class WorkHandle(Future[T]):
    """The handle of work running on the ranks (see the module docstring); each kind subclasses it."""

    def __init__(self, work: Interruptible | None, what: str):
        """``work``: what stops and is waited for (None: nothing runs, the owner settles at once);
        ``what``: the work's name in messages ("training", "nbddp.predict", ...)."""
        super().__init__()
        self._work = work
        self.what = what
        self._cancel_asked = False
        self._settling = threading.RLock()

    # ---- the owner's side ----------------------------------------------------------------------------------
    def settle(self, outcome: Callable[[], T]) -> None:
        """The work has ended: ``outcome()`` returns its value or raises its error; the handle takes it.

        Called once by whoever learns the end (the work's watcher, or the
        handle's own thread); a cancel asked for before turns a stopped end
        into a cancellation.
        """
        error: BaseException | None = None
        value: T | None = None
        try:
            value = outcome()
        except BaseException as exc:  # noqa: BLE001 - the handle holds it for result()/exception()
            error = exc
        with self._settling:
            if self.done():
                return
            if self._cancel_asked and (error is None or is_interrupt(error)):
                super().cancel()  # still pending: it becomes cancelled and its callbacks run
                self.set_running_or_notify_cancel()  # ... and concurrent.futures.wait hears of it
            elif error is not None:
                self.set_exception(error)
            else:
                self.set_result(value)  # type: ignore[arg-type]  # (outcome() returned a T)

    # ---- what a person calls ---------------------------------------------------------------------------------
    def running(self) -> bool:
        """Whether the work still runs (it has no outcome yet)."""
        return not self.done()

    def result(self, timeout: float | None = None) -> T:
        """Wait for the end and return the work's value, or raise its error.

        Kernel > Interrupt while waiting stops the work as in a blocking call
        (every rank at the same point); a second kills its ranks.

        Raises:
            TimeoutError: ``timeout`` seconds passed first; the work goes on.
            concurrent.futures.CancelledError: the handle was cancelled.
        """
        return self._take(timeout, "result")

    def wait(self, timeout: float | None = None) -> T:
        """The same as ``result(timeout)`` (the name nbddp's handles had first)."""
        return self._take(timeout, "wait")

    def _take(self, timeout: float | None, method: str) -> T:  # (Future keeps its value in ._result)
        self.wait_for(timeout, method)
        self.before_result()
        return super().result(0)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Wait for the end as ``result`` does; the work's error, or None when it returned a value."""
        self.wait_for(timeout, "exception")
        return super().exception(0)

    def stop(self, wait: bool = True) -> T | None:
        """Stop every rank at the same point (as the Stop button and Kernel > Interrupt do).

        With ``wait``, wait for the end and return what the stopped work
        returns (a fit's ``History``, a sweep's ``SweepResult``), or None
        where a stopped call returns nothing (predict, evaluate, run, a cell);
        an error that is not the stop's own is raised.
        """
        self.request_stop()
        if not wait:
            return None
        self.wait_for(None, "stop")
        error = None if self.cancelled() else super().exception(0)
        if self.cancelled() or (error is not None and is_interrupt(error)):
            return None
        return self.result(0)

    def cancel(self) -> bool:
        """Ask for the coordinated stop and return at once; True unless the work had ended.

        The handle is cancelled once every rank has stopped (``cancelled()``,
        and ``result()`` raises ``CancelledError``).
        """
        with self._settling:
            if self.done():
                return self.cancelled()
            self._cancel_asked = True
        self.request_stop()
        return True

    def __await__(self) -> Generator[Any, None, T]:
        return self._awaited().__await__()

    async def _awaited(self) -> T:
        import asyncio

        try:
            return await asyncio.wrap_future(self)
        except BaseException as exc:
            if is_interrupt(exc):  # a stopped call that returns nothing: a cancellation, in asyncio's words
                raise asyncio.CancelledError(f"{self.what} was stopped: {exc}") from None
            raise

    # ---- what a kind of work may say otherwise ----------------------------------------------------------------
    def request_stop(self) -> None:
        """The coordinated stop of this kind of work."""
        if self._work is not None:
            self._work.request_stop()

    def check_waiter(self, method: str) -> None:
        """Raise if waiting here could never end (a fit's own callback waiting for it)."""

    def before_result(self) -> None:
        """Said in the thread that asks for the result, once it is known (a fit's notices)."""

    def wait_for(self, timeout: float | None, method: str) -> None:
        """Wait for the outcome, taking Kernel > Interrupt as a blocking call does; ``TimeoutError`` after ``timeout``."""
        self.check_waiter(method)
        if self.done():
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._work is not None and not wait_interruptibly(self._work, timeout):
            raise TimeoutError(self.still_running(timeout))
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not futures_wait([self], left).done:  # the owner settles moments after the work ends
            raise TimeoutError(self.still_running(timeout))

    def still_running(self, timeout: float | None) -> str:
        return f"{self.what} still running after {timeout} s; call .wait() again or .stop()"

    def state(self) -> str:
        """``running``, ``cancelled``, ``failed`` or ``done``, for the repr."""
        if not self.done():
            return "running"
        if self.cancelled():
            return "cancelled"
        return "failed" if super().exception(0) is not None else "done"

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.what}: {self.state()}>"
