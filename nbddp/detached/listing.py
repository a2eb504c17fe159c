"""``nbddp.sessions()``: this user's detached sessions, one row each, and the same as one line for an error."""

from __future__ import annotations

import datetime
import os
from typing import Any

from nbddp.protocol import session_record
from nbddp.protocol.host import pid_alive
from nbddp.protocol.session_record import SessionRecord


def rows() -> list[dict[str, Any]]:
    """One dict per session (``row``), oldest first."""
    return [row(record) for _, record in session_record.all_records()]


def row(record: SessionRecord) -> dict[str, Any]:
    """``id``, ``world``, ``backend``, ``started``, ``attached`` (a live kernel's pid, or None), ``running`` (the
    fit running on it, or None), ``kept`` (the names ``dist_fit(keep=...)`` bound), ``keep_alive_s``,
    ``slurm_jobs`` and ``this_kernel``."""
    attached = record.kernel_pid if record.kernel_pid and pid_alive(record.kernel_pid) else None
    running = dict(record.running) if record.running else None
    if running is not None and not _fit_note_running(record.file_prefix, running.get("fit_id", "")):
        running = None  # it ended while no kernel was attached (or this kernel took its result)
    kept = list(dict.fromkeys([*record.kept, *([running["keep"]] if running and running.get("keep") else [])]))
    return {
        "id": record.id, "world": record.world, "backend": record.backend,
        "started": datetime.datetime.fromtimestamp(record.started).isoformat(timespec="seconds"),
        "attached": attached, "running": running, "kept": kept, "keep_alive_s": record.keep_alive_s,
        "slurm_jobs": list(record.slurm_job_ids), "this_kernel": record.kernel_pid == os.getpid(),
    }


def _fit_note_running(file_prefix: str, fit_id: str) -> bool:
    from nbddp.protocol.notes import read_note

    note = read_note(session_record.fit_note_path(file_prefix))
    return isinstance(note, dict) and note.get("fit_id") == fit_id and note.get("status") == "running"


def describe_all() -> str:
    """The sessions as one sentence, for an error that must say what there is."""
    found = rows()
    if not found:
        return "nbddp.sessions() lists none."
    items = [f"{r['id']} ({r['world']} x {r['backend']}, started {r['started']}, "
             f"{'attached to pid ' + str(r['attached']) if r['attached'] else 'no kernel attached'})" for r in found]
    return "nbddp.sessions(): " + "; ".join(items) + "."
