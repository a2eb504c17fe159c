"""``SweepHandle``: a sweep that runs while the notebook stays usable (``nbddp.sweep(..., block=False)``).

The schedule runs in its thread as in a blocking sweep; a second thread
(``nbddp-sweep-view``) draws the live view, and once the schedule ends it
closes the trial groups and builds the ``SweepResult``, the same steps a
blocking call takes in the cell. The notebook is free meanwhile, so the live
view's Stop button works (its click reaches the kernel), as does
``handle.stop()``: both are the stop of Kernel > Interrupt in a blocking
sweep (no new trial; the running ones stop at their next synchronisation;
what finished is returned).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable

from nbddp.execution.work import is_interrupt
from nbddp.sweeps.result import SweepResult, ranked

if TYPE_CHECKING:
    from nbddp.sweeps.scheduler import SweepRun


class SweepHandle:
    """Returned by ``nbddp.sweep(..., block=False)``: ``done()``, ``wait()``, ``stop()``, ``trials`` so far."""

    def __init__(self, run: SweepRun | None, finish: Callable[[], SweepResult]):
        self._run = run  # None: nothing to run (the study had its trials), ``finish`` returns the result
        self._finish = finish
        self._result: SweepResult | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._body, name="nbddp-sweep-view", daemon=True)
        self._thread.start()

    def _body(self) -> None:
        try:
            self._result = self._finish()
        except BaseException as exc:  # noqa: BLE001 - raised by wait()
            self._error = exc

    def done(self) -> bool:
        """Whether the sweep has ended, its groups closed and its result built."""
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> SweepResult:
        """Block until the sweep ends; return its ``SweepResult``, or raise what ended it.

        Kernel > Interrupt while waiting stops the sweep, as in a blocking call.
        """
        try:
            self._thread.join(timeout)
        except BaseException as exc:
            if not is_interrupt(exc):
                raise
            self.stop(wait=False)
            self._thread.join()
        if self._thread.is_alive():
            raise TimeoutError(f"nbddp.sweep still running after {timeout} s; call .wait() again, or .stop()")
        if self._error is not None:
            raise self._error
        assert self._result is not None, "finish() returned a result, or raised it as _error"
        return self._result

    def stop(self, wait: bool = True) -> SweepResult | None:
        """No new trial; the running ones stop at their next synchronisation (as the Stop button does)."""
        if self._run is not None:
            self._run.request_stop()
        return self.wait() if wait else None

    @property
    def trials(self) -> Any:
        """The leaderboard so far, as the DataFrame ``SweepResult.trials`` will be."""
        if self._run is None:
            return self.wait().trials
        return SweepResult(rows=list(self._run.rows), metric=self._run.metric, mode=self._run.mode,
                           study=self._run.study).trials

    def __repr__(self) -> str:
        if self._run is None:
            return "<SweepHandle done: the study had its trials already>"
        rows = list(self._run.rows)
        state = "done" if self.done() else ("stopping" if self._run.stopping else "running")
        best = next(iter(ranked([r for r in rows if r.state == "complete" and r.value is not None], self._run.mode)),
                    None)
        lead = f", best {self._run.metric} {best.value:.4g} (trial {best.trial})" if best is not None else ""
        return f"<SweepHandle {state}: {len(rows)} trial(s) handed out{lead}>"
