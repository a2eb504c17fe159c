"""Attaching: a new kernel finds a detached session's record and uses its workers as they are.

What comes back: the engines (the same processes, found through the
controller's connection file), the process group as the ranks joined it
(never formed again: that would empty their caches), the resident datasets,
and, on the ranks, untouched, every kept model and ``%%ddp`` name. A fit
that ran meanwhile comes back as a handle (``nbddp/detached/resumed_fit.py``).
"""

from __future__ import annotations

import json
import os

from nbddp.cluster.engines import unanswered
from nbddp.cluster.reattach import reattach
from nbddp.detached import records
from nbddp.detached.hand_over import hand_over
from nbddp.detached.journal import note_running
from nbddp.detached.listing import describe_all
from nbddp.detached.resumed_handle import resume
from nbddp.protocol import session_record
from nbddp.protocol.errors import ClusterError, SessionError
from nbddp.protocol.host import pid_alive
from nbddp.protocol.session_record import SessionRecord
from nbddp.session import ownership
from nbddp.session.session import Session


def find(session_id: str | None) -> tuple[str, SessionRecord]:
    """(path, record) of the session to attach to: the one named, or the only one there is.

    Raises:
        SessionError: there is none, the one named has ended, or there are several and none was named.
        PermissionError: the record belongs to another user (or others may read it).
    """
    if session_id is not None and not isinstance(session_id, str):
        raise TypeError(f"attach(id=...) must be a session id (a str from nbddp.sessions()), got "
                        f"{type(session_id).__name__} {session_id!r}")
    if session_id is not None:
        path = session_record.record_path(session_id)
        record = session_record.read(path)
        if record is None:
            raise SessionError(f"no detached session {session_id!r}: it has ended (stopped, or idle past its "
                               f"keep_alive) or never existed. {describe_all()}")
        return path, record
    found = session_record.all_records()
    if not found:
        raise SessionError("no detached session to attach to. Start one with nbddp.start(detach=True) "
                           f"(or %ddp start --detach), or detach running workers with %ddp detach. {describe_all()}")
    if len(found) > 1:
        raise SessionError(f"{len(found)} detached sessions exist; say which: nbddp.attach(id). {describe_all()}")
    return found[0]


def controller_gone(record: SessionRecord) -> str | None:
    """Why the session's controller cannot be reached (its registration port refuses), or None."""
    try:
        with open(record.connection_file) as f:
            info = json.load(f)
    except FileNotFoundError:
        return f"its controller's connection file {record.connection_file} is gone"
    return unanswered(str(info.get("location") or "127.0.0.1"), int(info["registration"]), "its controller")


def take_up(session: Session, path: str, record: SessionRecord, end_broken: bool = False) -> None:
    """This process drives the session of ``record`` from now on: its engines, group and datasets as they are.

    Raises:
        SessionError: one of its workers died while no kernel was attached; ``end_broken``: the session is ended.
    """
    try:
        workers = reattach(record.cluster_file, record.connection_file,
                           {p["engine_id"]: p["pid"] for p in record.group["placements"]},
                           (record.reaper_pid, record.reaper_pidfile, path), record.options.get("engine_env", {}))
    except ClusterError as exc:  # a worker died while no kernel was attached: its group and what it held are lost
        if end_broken:
            session_record.remove(path)  # the reaper sees it gone and ends the rest of the session
        raise SessionError(f"session {record.id} cannot be attached: {exc}. Its process group is broken, and a fit "
                           "that was running cannot go on (while no kernel is attached only a fit's own lost rank, "
                           "with max_restarts, is replaced); the session was ended, "
                           "leaving nothing behind. Start new workers with nbddp.start(detach=True)") from exc
    ownership.take_over(session, workers, records.group_from_json(record.group),
                        records.options_from_json(record.options), record.token, record.file_prefix, record.resident,
                        record.started, busy=bool(record.running))
    session.record_path = path


def attach(session: Session, session_id: str | None = None, take_over: bool = False,
           live: object = None) -> SessionRecord:
    """Take the detached session over in this kernel; its record, now naming this kernel. See ``nbddp.api.attach``."""
    if not isinstance(take_over, bool):
        raise TypeError(f"attach(take_over=...) must be True or False, got {take_over!r}")
    path, record = find(session_id)
    if record.kernel_pid == os.getpid() and session.record_path == path:
        return record  # attached already
    if session.started:
        raise ClusterError(f"this kernel already has workers ({session.world_size} x {session.backend}); call "
                           f"nbddp.stop() before attaching to session {record.id}")
    owner = record.kernel_pid
    if owner and owner != os.getpid() and pid_alive(owner) and not take_over:
        raise SessionError(f"session {record.id} is attached to another kernel (pid {owner}); one kernel at a time "
                           "drives it. Detach or shut that kernel down, or move the session here with "
                           f"nbddp.attach({record.id!r}, take_over=True) (%ddp attach {record.id} --take-over)")
    gone = controller_gone(record)
    if gone is not None:
        session_record.remove(path)  # the reaper sees it gone and ends what is left of the session
        raise SessionError(f"session {record.id} cannot be reached: {gone}. Its workers are lost (the machine "
                           "restarted, or the controller was killed); its record was removed and whatever was left "
                           "of it is ended. Start new workers with nbddp.start(detach=True).")
    record = hand_over(path, record)  # a caretaker drove its fit meanwhile: it lets go first
    take_up(session, path, record, end_broken=True)
    record.kernel_pid = os.getpid()
    session_record.write(record, os.path.dirname(path))
    if record.running:  # a fit that ran on while no kernel was attached (or ended meanwhile): its handle
        resume(session, record.running, live)
    note_running(session)  # later fits are named in the record too
    return record
