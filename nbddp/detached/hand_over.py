"""A kernel attaching takes a detached fit from its caretaker: who drives the fit, and the hand-over between them.

While no kernel is attached, a detached elastic fit is driven by the
session's caretaker (``nbddp/detached/caretaker.py``), named in the record
(``caretaker_pid``). One driver at a time: the reaper starts a caretaker
only when none drives the fit (``nbddp/cluster/idle_watch.py``'s
``wants_caretaker``), and ``attach`` asks the
caretaker to let go (``hand_over``) before it takes the session up.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

from nbddp.protocol import session_record
from nbddp.protocol.errors import SessionError
from nbddp.protocol.host import pid_alive
from nbddp.protocol.session_record import SessionRecord

LET_GO_WITHIN_S = 180.0  # a relaunch under way is finished first: a heal that starts an engine takes 10-40 s here


def hand_over(path: str, record: SessionRecord) -> SessionRecord:
    """Take the fit from the session's caretaker, if one drives it: its record once the caretaker let go.

    Raises:
        SessionError: the caretaker did not let go within ``LET_GO_WITHIN_S``.
    """
    pid = record.caretaker_pid
    if not pid or pid == os.getpid() or not pid_alive(pid):
        return record
    record.kernel_pid = os.getpid()  # the reaper starts no other caretaker; this one sees a kernel attached
    session_record.write(record, os.path.dirname(path))
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + LET_GO_WITHIN_S
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if pid_alive(pid):
        raise SessionError(f"the caretaker of session {record.id} (pid {pid}), which drives its fit while no kernel "
                           f"is attached, did not let go within {LET_GO_WITHIN_S:.0f} s (a relaunch taking that "
                           "long?); try nbddp.attach() again")
    return session_record.read(path) or record

