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

from nbddp.execution.handle import WorkHandle
from nbddp.sweeps.result import SweepResult, ranked

if TYPE_CHECKING:
    from nbddp.sweeps.scheduler import SweepRun


class SweepHandle(WorkHandle[SweepResult]):
    """Returned by ``nbddp.sweep(..., block=False)``: ``trials`` so far, and what every nbddp handle offers.

    A ``concurrent.futures.Future`` of the ``SweepResult``
    (``nbddp/execution/handle.py``): ``done``, ``result`` (``wait``),
    ``exception``, ``cancel``, ``add_done_callback``, ``stop`` (returns what
    finished) and ``await handle``.
    """

    def __init__(self, run: SweepRun | None, finish: Callable[[], SweepResult]):
        super().__init__(run, "nbddp.sweep")  # run None: nothing to run (the study had its trials)
        self._run = run
        self._thread = threading.Thread(target=self.settle, args=(finish,), name="nbddp-sweep-view", daemon=True)
        self._thread.start()

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
