"""The result of a fit that ended while no kernel was attached, taken by the kernel that attached after.

A kernel that attaches to a detached session sends ``take_fit_result`` to every rank at
once: on an engine it waits in the queue behind the fit task still running,
and runs the moment the fit ends, so the kernel's wait for it is a wait for
the fit (``nbddp/detached/resumed_fit.py``).
"""

from __future__ import annotations

from typing import Any

from nbddp.worker.engine.rank_state import STATE


def take_fit_result(fit_id: str) -> Any:
    """This rank's ``FitResult`` of fit ``fit_id`` (kept by ``worker/training/journal.py``), given once.

    Raises:
        the fit's own error, when it failed on this rank;
        LookupError: this rank keeps no result of that fit (it was taken already, or the engine was replaced).
    """
    kept = STATE.fit_results.pop(fit_id, None)
    if kept is None:
        raise LookupError(f"this rank keeps no result of fit {fit_id}: it was taken already, or this engine "
                          "was replaced after the fit ended")
    if isinstance(kept, BaseException):
        raise kept
    return kept


def fit_outcome(fit_id: str) -> str:
    """How fit ``fit_id`` ended on this rank (its status), leaving its result for the kernel that takes it.

    The caretaker of a detached session (``nbddp/detached/caretaker.py``) sends this behind the fit task: it
    learns that the fit ended, or that a rank was lost, and the result stays for ``take_fit_result``.

    Raises:
        the fit's own error, when it failed on this rank;
        LookupError: this rank keeps no result of that fit (this engine was replaced after the fit ended).
    """
    kept = STATE.fit_results.get(fit_id)
    if kept is None:
        raise LookupError(f"this rank keeps no result of fit {fit_id}: this engine was replaced after the fit ended")
    if isinstance(kept, BaseException):
        raise kept
    return str(getattr(kept, "status", "completed"))
