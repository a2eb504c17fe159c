"""``python -m nbddp.detached.caretaker RECORD``: a detached elastic fit's driver while no kernel is attached.

A kernel drives an elastic fit (``dist_fit(max_restarts=N)``): when a rank
is lost, its ``FitRun`` has the supervisor replace it and relaunches the fit
from its newest snapshot. When that kernel dies (or exits) in a detached
session, the session's reaper (``nbddp/cluster/reaper.py``, through
``nbddp/cluster/idle_watch.py``) starts this process. It takes the session
up as ``nbddp.attach`` does (the same engines, the same group, nothing sent
but the wait for the fit's end), and drives the fit with a ``ResumedFit``
(``nbddp/detached/resumed_fit.py``, ``caretaker=True``): the fit's own
``FailurePolicy``, the same ``Recovery``, the same supervisor heal, the
fit's relaunch spec (``nbddp/detached/care_spec.py``).

It lets go the moment a kernel attaches: ``hand_over`` (``hand_over.py``,
called by ``attach``) names the kernel in the record and sends SIGTERM; the caretaker
finishes a relaunch under way, writes the fit's ledger (its restarts and
records), names the healed group in the record, and exits without touching
the workers. When the fit ends (completed, or failed past ``max_restarts``)
it exits the same way, leaving the result on the ranks and the outcome in
the ledger for the kernel that attaches later. It never ends the session:
the reaper does that, after ``keep_alive`` idle.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys

from nbddp.detached import records
from nbddp.cluster.idle_watch import wants_caretaker
from nbddp.protocol import session_record
from nbddp.protocol.errors import ClusterError, SessionError
from nbddp.protocol.notes import write_note
from nbddp.protocol.session_record import fit_note_path

def main(path: str) -> int:
    """Drive the fit named in the record at ``path`` until it ends or a kernel attaches (see the module)."""
    from nbddp.detached.attach import take_up
    from nbddp.detached.resumed_fit import ResumedFit
    from nbddp.live import NullView
    from nbddp.session.session import get_session

    record = session_record.read(path)
    if record is None or not wants_caretaker(record):
        return 0
    record.caretaker_pid = os.getpid()
    session_record.write(record, os.path.dirname(path))
    session = get_session()
    try:
        take_up(session, path, record)
    except (ClusterError, SessionError) as exc:  # a rank was lost before this took over: as attach() says it
        print(f"nbddp caretaker: cannot take session {record.id} up: {exc}", file=sys.stderr)
        _release(path)
        return 1
    assert record.running is not None, "should_drive() saw the fit"
    run = ResumedFit(session, record.running, NullView(), caretaker=True)

    def let_go(signum: int, frame: object) -> None:
        run.letting_go = True

    signal.signal(signal.SIGTERM, let_go)
    run.launch()
    print(f"nbddp caretaker: driving fit {run.fit_id} of session {record.id}", file=sys.stderr, flush=True)
    run.done_event.wait()
    print(f"nbddp caretaker: fit {run.fit_id} " + ("ended: " + repr(run.error) if run.error is not None else
                                                    "handed over" if run.letting_go else "ended"),
          file=sys.stderr, flush=True)
    if run.error is not None:  # past max_restarts (or not retried): the fit ended; the ledger says how
        write_note(fit_note_path(session.file_prefix), {"fit_id": run.fit_id, "status": "ended",
                                                        "ended": f"failed: {run.error}"})
    _leave(session)
    _release(path)
    return 0


def _leave(session: object) -> None:
    """Hand the workers back as they are: the heal finished, no spare of ours left, the record current."""
    from nbddp.elastic.spare import Spare
    from nbddp.session.session import Session

    assert isinstance(session, Session)
    with contextlib.suppress(Exception):  # a heal that failed: the next driver sees the lost rank
        session.wait_healed(raise_error=False)
    spare = session.supervisor.spare
    workers = session.workers
    if isinstance(spare, Spare) and workers is not None:  # the record names the group only: no kernel would see it
        spare.wait()
        if spare.engine_id is not None:
            workers.kill([spare.engine_id])
            workers.pids.pop(spare.engine_id, None)
            workers.reaper.update(workers.all_pids(), workers.job_ids())
    if workers is not None and workers.cluster is not None:
        with contextlib.suppress(Exception):
            workers.cluster.update_cluster_file()  # the engines a heal started, for the next kernel's stop()
            os.chmod(workers.cluster.cluster_file, 0o600)
    records.refresh(session, keep_owner=True)
    if workers is not None:
        with contextlib.suppress(Exception):
            workers.client.close()


def _release(path: str) -> None:
    """The record no longer names this process as the fit's driver."""
    current = session_record.read(path)
    if current is not None and current.caretaker_pid == os.getpid():
        current.caretaker_pid = 0
        session_record.write(current, os.path.dirname(path))


if __name__ == "__main__":
    code = main(sys.argv[1])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # never the exit hooks: they would stop what this process only borrowed
