"""FitHandle: a fit that runs while the notebook stays usable (``block=False``)."""

from __future__ import annotations

import os

from typing import Any

from nbddp.fit.history import History
from nbddp.jobs.waiting import wait_interruptibly
from nbddp.protocol.errors import NbddpError


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

    def profile(self, steps: int = 10, dir: str | os.PathLike | None = None) -> dict[str, Any]:
        """Trace the next ``steps`` optimizer steps on every rank with torch.profiler while the fit goes on.

        Every rank starts at the same step (the request rides in the next
        record's reduction); the call returns once every rank's trace is in,
        merged into one Chrome/Perfetto file: a dict like ``History.profile``
        (``path``, ``ranks``, ``top_ops``, ``breakdown``, ``summary``). The fit
        does not stop. The file goes into ``dir`` (made owner-only if missing),
        or a new private temporary folder.

        Raises:
            NbddpError: the fit has ended, or it ended before any traced step.
            ValueError: ``steps`` is not a whole number >= 1.
        """
        run = self._run
        if run.finished:
            raise NbddpError(f"handle.profile(steps={steps!r}): this fit has ended ({self.status}); profile a running "
                             "fit (dist_fit(..., block=False)), or trace a fit from its start with "
                             "dist_fit(..., profile=True)")
        request = run.requests.ask(steps, None if dir is None else os.fspath(dir))
        result = run.requests.wait(request, None)
        if result is None:
            raise NbddpError(f"handle.profile(steps={steps}): the fit ended ({self.status}) before its ranks traced a "
                             "step; ask for fewer steps, or earlier")
        return result

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
