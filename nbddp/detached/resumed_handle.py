"""The handle of a fit ``nbddp.attach`` found running (``nbddp.running()``), and taking that fit up in a kernel.

The fit itself, its journal, its restarts and its weights are
``nbddp/detached/resumed_fit.py``'s ``ResumedFit``; here is what the person
holds: a ``FitHandle`` whose weights come back into a model passed to
``result(into=model)``, since the kernel that attached has no model object
of the fit's own.
"""

from __future__ import annotations

from typing import Any

from nbddp.detached.resumed_fit import ResumedFit
from nbddp.fit.handle import FitHandle
from nbddp.fit.history import History
from nbddp.protocol.errors import NbddpError
from nbddp.session.session import Session


class ResumedFitHandle(FitHandle):
    """``nbddp.running()`` after ``attach()``: a ``FitHandle`` whose weights come back on request.

    The kernel that launched the fit held the person's model; this one does
    not, so ``result(into=model)`` (or ``wait(into=model)``) loads the
    trained weights into the model given; without ``into`` the History's
    ``model`` is the trained state dict.
    """

    def __init__(self, run: ResumedFit):
        super().__init__(run)
        self._resumed = run

    @property
    def work(self) -> ResumedFit:
        return self._resumed

    def result(self, timeout: float | None = None, into: Any = None) -> History:
        history = super().result(timeout)
        if into is not None:
            self._resumed.into(into)
        return history

    def wait(self, timeout: float | None = None, into: Any = None) -> History:
        return self.result(timeout, into)

    def profile(self, steps: int = 10, dir: Any = None) -> dict[str, Any]:
        """Not for a fit found running at attach: its ranks answer profile requests to the kernel that launched it.

        Raises:
            NbddpError: always, saying so.
        """
        raise NbddpError("handle.profile() is not available for a fit this kernel found running when it attached: "
                         "the ranks send traces to the kernel that launched the fit. Profile the next fit "
                         "(dist_fit(..., profile=True), or handle.profile() on its handle)")


def resume(session: Session, entry: dict[str, Any], live: Any = None) -> ResumedFitHandle:
    """Take the fit named in the record up in this kernel: its handle, its view started in the calling cell."""
    from nbddp.live import choose_view

    run = ResumedFit(session, entry, choose_view(live))
    handle = run.handle = ResumedFitHandle(run)
    session.resumed = handle
    run.launch()
    return handle


def running_handle(session: Session) -> FitHandle | None:
    """The handle of the fit running on this kernel's workers, or of the one ``attach()`` found; None otherwise."""
    run = session.running
    if run is not None and not run.finished and isinstance(getattr(run, "handle", None), FitHandle):
        return run.handle
    resumed = session.resumed
    if resumed is not None and (run is None or run is resumed.work):
        return resumed
    return None
