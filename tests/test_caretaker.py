"""A detached elastic fit's caretaker, without engines: when one is wanted, the hand-over, the ledger, dead kernels.

The real thing (a kernel killed, a rank killed with no kernel attached, the
fit relaunched, a new kernel attaching) is in ``tests/test_sessions_kernel.py``;
here are the decisions it rests on, each against stand-ins.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from nbddp.cluster.idle_watch import Caretakers, wants_caretaker
from nbddp.detached import care_spec
from nbddp.detached.care_spec import Ledger
from nbddp.protocol import session_record
from nbddp.protocol.epoch_answer import EpochAnswer, wait_answer, write_answer
from nbddp.protocol.errors import RankFailure, SessionError, WorkerDied
from nbddp.protocol.session_record import SessionRecord


@pytest.fixture
def runtime(tmp_path, monkeypatch):
    """A private records folder (the user's real one is never touched), and a kernel session of the test's own."""
    from nbddp.session import session as kernel_session

    monkeypatch.setenv("NBDDP_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setattr(kernel_session, "_SESSION", kernel_session.Session())
    return tmp_path / "runtime"


def _record(**changes) -> SessionRecord:
    fields = dict(id="20261205-000000-c4c4c4", owner_uid=os.getuid(), kernel_pid=0, cluster_file="",
                  connection_file="", world=2, backend="gloo", started=time.time(), keep_alive_s=60.0,
                  file_prefix="nbddp-caretest0", token="t", running={"fit_id": "f1", "care": True})
    fields.update(changes)
    return SessionRecord(**fields)


@pytest.fixture
def sleeper():
    """A live process that is neither this one nor a kernel (a stand-in for another kernel or caretaker)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_caretaker_is_wanted_only_for_an_elastic_fit_no_kernel_nor_other_caretaker_drives(sleeper):
    assert not wants_caretaker(None)
    assert not wants_caretaker(_record(running=None))  # nothing runs
    assert not wants_caretaker(_record(running={"fit_id": "f1", "care": False}))  # no max_restarts: nothing to do
    assert not wants_caretaker(_record(kernel_pid=sleeper.pid))  # a kernel is attached: it drives the fit
    assert not wants_caretaker(_record(caretaker_pid=sleeper.pid))  # another caretaker drives it
    assert wants_caretaker(_record(kernel_pid=_dead_pid()))  # the kernel died
    assert wants_caretaker(_record(caretaker_pid=os.getpid()))  # the caretaker asking itself is not "another"


def test_the_reaper_starts_no_caretaker_while_the_fit_is_not_running_or_one_is_not_wanted(tmp_path, sleeper):
    care = Caretakers(str(tmp_path / "session-x.json"), "nbddp-caretest1")  # no fit note: not running
    care.tick(_record())
    care.tick(_record(kernel_pid=sleeper.pid))
    assert care.process is None
    care.end()  # (nothing to end)


def test_the_ledger_hands_the_restarts_the_records_and_the_lost_ranks_error_to_the_next_driver(runtime):
    path = session_record.write(_record())
    died = WorkerDied(RankFailure(1, "WorkerDied", "gone", "", 123, "vm", 1), "killed by signal 9 (SIGKILL)")
    died.with_note("nbddp: the fit was restarted 1 time(s) and max_restarts=1 were all used")
    event = {"rank": 1, "cause": "killed", "step_lost_at": 9, "step_resumed_from": 8}
    care_spec.save_ledger(path, "f1", Ledger([event], [("step", {"step": 8, "loss": 1.0})], False, "WorkerDied: ...",
                                             died))
    assert oct(os.stat(path[:-len(".json")] + "-f1-ledger.pkl").st_mode & 0o777) == "0o600"
    back = care_spec.load_ledger(path, "f1")
    assert back.restarts == [event] and back.records == [("step", {"step": 8, "loss": 1.0})] and not back.pending
    assert type(back.error) is WorkerDied and str(back.error) == str(died) and back.error.how == died.how
    assert care_spec.load_ledger(path, "other") == Ledger()  # none written: a fit with no restarts so far


def test_an_error_that_does_not_unpickle_travels_as_its_text(runtime):
    class Odd(Exception):
        def __init__(self, a, b):
            super().__init__(f"{a}{b}")

    path = session_record.write(_record())
    care_spec.save_ledger(path, "f1", Ledger(failed="Odd: xy", error=Odd("x", "y")))
    back = care_spec.load_ledger(path, "f1")
    assert back.error is None and back.failed == "Odd: xy"


def test_a_fit_that_failed_with_no_kernel_raises_its_error_in_the_attaching_kernel_at_once(runtime):
    from nbddp.detached.resumed_fit import ResumedFit
    from nbddp.detached.resumed_handle import ResumedFitHandle
    from nbddp.live import NullView
    from nbddp.session.session import get_session

    session = get_session()
    session.record_path = session_record.write(_record())
    died = WorkerDied(RankFailure(0, "WorkerDied", "gone", "", 7, "vm", 0), "killed by signal 9 (SIGKILL)")
    care_spec.save_ledger(session.record_path, "f1", Ledger([{"rank": 1}], [], False, "WorkerDied: gone", died))
    run = ResumedFit(session, {"fit_id": "f1", "care": True}, NullView())
    handle = run.handle = ResumedFitHandle(run)
    run.launch()  # sends nothing: the fit ended while no kernel was attached
    assert handle.done()
    with pytest.raises(WorkerDied, match=r"rank 0 \(pid 7 on vm\): WorkerDied: gone"):
        handle.result()
    assert run.history.restarts == [{"rank": 1}] and run.history.status == "failed"
    assert not os.path.exists(session.record_path[:-len(".json")] + "-f1-ledger.pkl")  # taken: it goes


def test_attach_takes_the_fit_from_its_caretaker_which_lets_go_on_sigterm(runtime):
    from nbddp.detached.hand_over import hand_over

    proc = subprocess.Popen([sys.executable, "-c", "import signal, sys, time\n"
                             "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\nprint('up', flush=True)\n"
                             "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "up\n"
        path = session_record.write(_record(caretaker_pid=proc.pid))
        t0 = time.monotonic()
        record = hand_over(path, session_record.read(path))
        assert time.monotonic() - t0 < 10 and proc.wait(5) == 0
        assert record.kernel_pid == os.getpid()  # named before the caretaker went: no reaper starts another
    finally:
        proc.kill()
        proc.wait()


def test_a_caretaker_that_does_not_let_go_is_named_with_its_pid(runtime, monkeypatch):
    from nbddp.detached import hand_over as module

    monkeypatch.setattr(module, "LET_GO_WITHIN_S", 0.3)
    stuck = subprocess.Popen([sys.executable, "-c", "import signal, time\n"
                              "signal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('up', flush=True)\n"
                              "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert stuck.stdout is not None and stuck.stdout.readline() == "up\n"
        path = session_record.write(_record(caretaker_pid=stuck.pid))
        with pytest.raises(SessionError, match=rf"the caretaker of session .* \(pid {stuck.pid}\), which drives its "
                                               r"fit while no kernel is attached, did not let go within 0 s"):
            module.hand_over(path, session_record.read(path))
    finally:
        stuck.kill()
        stuck.wait()


def test_rank_0_stops_waiting_for_an_answer_the_moment_its_kernel_is_gone(tmp_path):
    path = str(tmp_path / "answer")
    t0 = time.monotonic()
    answer = wait_answer(path, 3, timeout_s=600, gone=lambda: True)
    assert answer == EpochAnswer(3, kernel_gone=True) and time.monotonic() - t0 < 1
    write_answer(path, EpochAnswer(4, stop="enough"))
    assert wait_answer(path, 4, timeout_s=600, gone=lambda: False) == EpochAnswer(4, stop="enough")
    assert wait_answer(path, 5, timeout_s=0.05, gone=lambda: False) is None  # alive, silent: the timeout


def test_the_ranks_skip_every_later_point_once_told_and_say_how_many(monkeypatch):
    from nbddp.worker.training import kernel_answers
    from nbddp.worker.training.kernel_answers import KernelAnswers

    sent = []

    def broadcast(box, src, group):  # one rank, no group: the answer rank 0 made is what every rank gets
        sent.append(box[0])

    monkeypatch.setattr(kernel_answers.dist, "broadcast_object_list", broadcast)

    class Reporter:
        records = [("epoch", {})]

        def publish(self, force):
            pass

    class State:
        status, step, stop_reason, reporter = "training", 32, None, Reporter()

    answers = KernelAnswers(0, ("epoch",), "nbddp-caretest2-w0", kernel_pid=_dead_pid())
    for _ in range(3):
        answers.exchange(State(), "epoch")
    assert [a.kernel_gone for a in sent] == [True]  # one collective, then none
    assert answers.skipped == 3 and answers.waited == 0
    (notice,) = answers.gone_notice()
    assert "from step 32 on: 3 synchronous callback point(s) (epoch records) were skipped" in notice
