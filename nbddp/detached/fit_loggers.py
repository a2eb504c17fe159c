"""A detached fit's loggers, handed from the kernel that launched it to the kernel that attaches later.

Loggers run in the kernel (``nbddp/loggers/``): when the kernel dies, its
logger objects die with it. So when a fit starts in a detached session, its
loggers (as configured, before they open anything), its ``FitConfig`` and
the options the loggers describe are pickled by value into an owner-only
file beside the session's record, and every logger's run, once opened, is
noted in the record (``FitHooks.noted_runs``: the same plain data a resumed
fit's ``checkpoint_dir`` keeps). The kernel that attaches opens the same
runs again (``FitHooks.saved_runs``) and hands them every record of the fit
from its first: a CSV run is rewritten whole, a TensorBoard run gets the
steps again, W&B and MLflow go on in the same run.
"""

from __future__ import annotations

import os
from typing import Any

from nbddp.detached import records
from nbddp.protocol import session_record
from nbddp.protocol.notices import notify
from nbddp.session.session import Session
from nbddp.shipping import pickling as shipping


def loggers_path(record_path: str, fit_id: str) -> str:
    return f"{record_path[:-len('.json')]}-{fit_id}-loggers.pkl"


def save(session: Session, run: Any, entry: dict[str, Any]) -> None:
    """Pickle the fit's loggers for a later kernel; note their runs in the record as they open."""
    hooks = run.hooks
    if not hooks.loggers or session.record_path is None:
        return
    loggers = [g.logger for g in hooks.loggers.guards]
    try:
        blob = shipping.dumps({"loggers": loggers, "cfg": run.plan.cfg, "described": hooks.described},
                              what="the fit's loggers", label="loggers")
    except Exception as exc:  # noqa: BLE001 - said, and the fit goes on: only a later kernel loses the loggers
        notify(f"nbddp: this fit's loggers cannot be handed to a kernel that attaches later ({exc}); if this kernel "
               "dies, the fit goes on and its History comes back, but its loggers see no more records")
        return
    path = loggers_path(session.record_path, entry["fit_id"])
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(blob)

    def noted(run_name: str, states: dict[str, Any]) -> None:
        records.refresh(session, running={**entry, "runs": {"run_name": run_name, "loggers": states}})

    hooks.noted_runs = noted


def load(record_path: str, entry: dict[str, Any]) -> dict[str, Any] | None:
    """What ``save`` wrote for this fit (``loggers``, ``cfg``, ``described``), or None; the file is removed."""
    import cloudpickle

    path = loggers_path(record_path, str(entry["fit_id"]))
    try:
        session_record.check_owned(path, "the fit's loggers file")
        with open(path, "rb") as f:
            saved = cloudpickle.load(f)
    except FileNotFoundError:
        return None
    finally:
        session_record.remove(path)
    return saved if isinstance(saved, dict) else None


def forget(record_path: str | None, entry: dict[str, Any]) -> None:
    """The fit's loggers file, no longer needed (the fit ended in a kernel that held its loggers)."""
    if record_path is not None:
        session_record.remove(loggers_path(record_path, str(entry["fit_id"])))
