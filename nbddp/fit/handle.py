"""FitHandle: a fit that runs while the notebook stays usable (``block=False``)."""

from __future__ import annotations

from typing import Any

from nbddp.fit.history import History
from nbddp.jobs.waiting import wait_interruptibly


class FitHandle:
    """Returned by ``dist_fit(..., block=False)``.

    The training and the dashboard go on in the background; the model gets
    the trained weights when training ends (or is stopped).
    """

    def __init__(self, run: Any):
        self._run = run

    def done(self) -> bool:
        """Whether training has ended (completed, stopped or failed)."""
        return self._run.finished

    def wait(self, timeout: float | None = None) -> History:
        """Block until training ends; return the ``History`` or raise the workers' error.

        Kernel > Interrupt while waiting stops training at the same step on
        every rank, as in a blocking fit.
        """
        if not wait_interruptibly(self._run, timeout):
            raise TimeoutError(f"training still running after {timeout} s; call .wait() again or .stop()")
        return self._run.result()

    def stop(self, wait: bool = True) -> History | None:
        """Stop every rank at the same step (as the Stop button does); return the History."""
        self._run.request_stop()
        return self.wait() if wait else None

    @property
    def history(self) -> History:
        """What has arrived so far (the full History once training ended)."""
        return self._run.history

    @property
    def status(self) -> str:
        """starting, training, validating, stopping, then completed, interrupted or failed."""
        return self._run.live_state.status

    def __repr__(self) -> str:
        steps = self._run.history.steps
        where = f"step {steps[-1]['step']}" if steps else "starting"
        return f"<FitHandle {self.status}, {where}>"
