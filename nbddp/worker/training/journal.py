"""Rank 0's journal of a fit in a detached session, and every rank's result kept for a kernel that comes later.

In a detached session (the marker file ``protocol/session_record.py``
names exists on this host) the kernel may die while the fit trains on.
Whatever rank 0 publishes then reaches nobody (``docs/ipyparallel-notes.md``),
so rank 0 also keeps, in an owner-only file in /dev/shm, every record so
far with the fit's status; the next kernel replays it (the whole curve) and
follows it while the fit goes on. A small JSON note beside it says whether
the fit still runs: the reaper reads it to hold the session's ``keep_alive``
(``nbddp/cluster/idle_watch.py``). When the fit task ends, each rank keeps
its result (rank 0's holds the trained weights' parcel) in
``STATE.fit_results`` until a kernel takes it (``worker/tasks/journal.py``).
"""

from __future__ import annotations

import os
import pickle
from typing import Any

from nbddp.protocol.notes import write_note
from nbddp.protocol.session_record import detached_marker, fit_note_path, journal_path
from nbddp.worker.engine.rank_state import STATE


def detached() -> bool:
    """Whether this rank's session is detached (the marker is on this host)."""
    return bool(STATE.session_prefix) and os.path.exists(detached_marker(STATE.session_prefix))


def keep(plan: Any, records: list[tuple[int, str, dict[str, Any]]], status: str, ranks: list[dict[str, Any]],
         ended: str = "") -> None:
    """Rank 0: write the journal (every record so far) and the note, when the session is detached."""
    if not STATE.fit_id or not detached():
        return
    path = journal_path(STATE.session_prefix)
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        pickle.dump({"fit_id": STATE.fit_id, "records": list(records), "status": status, "ranks": list(ranks),
                     "plan": plan, "ended": ended}, f)
    os.replace(tmp, path)
    write_note(fit_note_path(STATE.session_prefix), {"fit_id": STATE.fit_id, "status": "ended" if ended else "running",
                                                  "seq": len(records), "ended": ended})


def ended(fit_id: str, result: Any, error: BaseException | None) -> None:
    """Every rank, as the fit task ends: keep its result (or error) for a later kernel; rank 0 closes the journal."""
    if not fit_id or not detached():
        return
    STATE.fit_results = {fit_id: error if error is not None else result}
    if STATE.placement is None or STATE.placement.rank != 0:
        return
    if error is not None:  # the journal keeps the records it had; the note says how the fit ended
        how = f"failed: {type(error).__name__}: {error}"
        write_note(fit_note_path(STATE.session_prefix), {"fit_id": fit_id, "status": "ended", "ended": how})
        return
    keep(result.plan, list(result.records), str(result.status), [], ended=str(result.status))
