"""Detaching: the session's workers, controller and shared-memory files outlive this kernel.

Three things keep them alive once the kernel exits or dies: the marker file
tells the ranks' kernel watchdogs not to exit (``worker/tasks/probe.py``),
ipyparallel's own exit hook no longer stops the cluster, and the reaper
watches the session record instead of the kernel
(``nbddp/cluster/idle_watch.py``). The record (``protocol/session_record.py``)
is what the next kernel's ``nbddp.attach`` reads.
"""

from __future__ import annotations

import os
import time

from nbddp.detached import records
from nbddp.protocol import session_record
from nbddp.protocol.errors import ClusterError, NotStartedError, SessionError
from nbddp.protocol.host import pid_alive
from nbddp.session.session import Session


def owner_elsewhere(session: Session) -> int:
    """The pid of another live kernel this session was moved to (``attach(take_over=True)``), else 0."""
    record = session_record.read(session.record_path) if session.record_path else None
    if record is None or record.kernel_pid in (0, os.getpid()) or not pid_alive(record.kernel_pid):
        return 0
    return record.kernel_pid


def check_start(detach: object, keep_alive: object) -> None:
    """``start(detach=..., keep_alive=...)`` checked before any process starts.

    Raises:
        TypeError, ValueError: ``detach`` is not a bool, ``keep_alive`` not a duration above zero.
    """
    if not isinstance(detach, bool):
        raise TypeError(f"start(detach=...) must be True or False, got {type(detach).__name__} {detach!r}")
    session_record.parse_keep_alive(keep_alive, "start(keep_alive=...)")


def detach(session: Session, keep_alive: object = session_record.DEFAULT_KEEP_ALIVE) -> session_record.SessionRecord:
    """Make ``session`` outlive this kernel; its record (written or updated). See ``nbddp.api.detach``.

    Raises:
        TypeError, ValueError: ``keep_alive`` is not a duration above zero.
        NotStartedError: no workers run in this kernel.
        SessionError: another kernel owns the session now.
        ClusterError: the workers are an ipcluster attached by ``profile=`` (they already outlive the kernel).
    """
    keep_alive_s = session_record.parse_keep_alive(keep_alive, "detach(keep_alive=...)")
    workers, group = session.workers, session.group
    if workers is None or group is None:
        raise NotStartedError("nothing to detach: no workers run in this kernel; start them with "
                              "nbddp.start(detach=True) (or %ddp start --detach)")
    other = owner_elsewhere(session)
    if other:
        raise SessionError(f"this session was moved to the kernel with pid {other} (attach(take_over=True)); "
                           "detach it from there, or take it back here with nbddp.attach(take_over=True)")
    if not workers.owned or workers.cluster is None or not getattr(workers.cluster, "cluster_file", ""):
        raise ClusterError("these workers are a cluster nbddp did not start (start(profile=...) or cluster=...); "
                           "nbddp never stops them, so they already outlive this kernel: attach to them again with "
                           "nbddp.start(profile=..., cluster_id=...)")
    _mark(session.file_prefix)
    workers.cluster.shutdown_atexit = False  # ipyparallel's exit hook would stop the cluster with a clean exit
    cluster_file = workers.cluster.cluster_file
    workers.cluster.update_cluster_file()
    os.chmod(cluster_file, 0o600)  # it names the controller and the engines' pids: owner-only, as the record
    if session.record_path is None:
        record = records.build(session, session_record.new_id(), keep_alive_s, session.started_wall or time.time())
        session.record_path = session_record.write(record)
    else:
        refreshed = records.refresh(session, keep_alive_s=keep_alive_s, kernel_pid=os.getpid())
        assert refreshed is not None, "a detached session's record exists until stop()"
        record = refreshed
    workers.reaper.detach(session.record_path)
    from nbddp.detached.journal import note_running

    note_running(session)
    return record


def _mark(file_prefix: str) -> None:
    """The ranks' watchdogs read this file: it exists, so the kernel's death is no reason to exit."""
    fd = os.open(session_record.detached_marker(file_prefix), os.O_WRONLY | os.O_CREAT, 0o600)
    os.close(fd)


def restart(session: Session) -> None:
    """``nbddp.restart()``: fresh workers; a detached session's are detached again, with the same ``keep_alive``."""
    record = session_record.read(session.record_path) if session.record_path else None
    session.restart()
    if record is not None:
        detach(session, record.keep_alive_s)
