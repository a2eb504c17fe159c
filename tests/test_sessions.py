"""Detached sessions without engines (issue 43): the record, keep_alive, the bad input, the reaper's idle end.

Everything here runs without workers: the record's format and permissions,
what ``attach``/``detach``/``start`` refuse and say, and the reaper's idle
watch against stand-in processes. The real kernels that detach, die and
attach are in ``tests/test_sessions_kernel.py``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

import nbddp
from nbddp.protocol import session_record
from nbddp.protocol.errors import ClusterError, NotStartedError, SessionError
from nbddp.protocol.session_record import SessionRecord, parse_keep_alive


@pytest.fixture
def runtime(tmp_path, monkeypatch):
    """A private records folder for the test (the user's real one is never touched), and a kernel session of its
    own: the suite's shared workers (a session already started in this test process) stay untouched."""
    from nbddp.session import session as kernel_session

    folder = tmp_path / "runtime"
    monkeypatch.setenv("NBDDP_RUNTIME_DIR", str(folder))
    monkeypatch.setattr(kernel_session, "_SESSION", kernel_session.Session())
    return folder


def _record(session_id: str = "20261205-000000-abcdef", **changes) -> SessionRecord:
    fields = dict(id=session_id, owner_uid=os.getuid(), kernel_pid=0, cluster_file="", connection_file="",
                  world=2, backend="gloo", started=time.time(), keep_alive_s=7200.0, file_prefix="nbddp-test0000",
                  token="t")
    fields.update(changes)
    return SessionRecord(**fields)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("text, seconds", [("2h", 7200.0), ("30m", 1800.0), ("90s", 90.0), ("1d", 86400.0),
                                           ("3", 3.0), (45, 45.0), (0.5, 0.5), (" 1.5 H ", 5400.0)])
def test_keep_alive_reads_durations(text, seconds):
    assert parse_keep_alive(text) == seconds


@pytest.mark.parametrize("bad, error, match", [
    ("forever", ValueError, "not a duration.*no 'forever'"),
    (-5, ValueError, "above zero"),
    ("-1h", ValueError, "not a duration"),
    (0, ValueError, "above zero"),
    (float("inf"), ValueError, "finite"),
    (True, TypeError, "must be a duration"),
    (None, TypeError, "got NoneType None"),
])
def test_keep_alive_refuses_forever_negative_and_nonsense(bad, error, match):
    with pytest.raises(error, match=match):
        parse_keep_alive(bad, "start(keep_alive=...)")


def test_start_refuses_a_bad_keep_alive_or_detach_before_any_process_starts(runtime):
    from nbddp.session.session import get_session

    with pytest.raises(ValueError, match=r"start\(keep_alive=...\): 'forever' is not a duration"):
        nbddp.start(2, detach=True, keep_alive="forever")
    with pytest.raises(TypeError, match=r"start\(detach=...\) must be True or False, got str 'yes'"):
        nbddp.start(2, detach="yes")
    assert not get_session().started


def test_the_record_is_owner_only_and_round_trips(runtime):
    record = _record(slurm_job_ids=["42"], resident=["k1"], kept=["m"])
    path = session_record.write(record)
    assert oct(os.stat(runtime).st_mode & 0o777) == "0o700"
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    assert session_record.read(path) == record
    assert [r.id for _, r in session_record.all_records()] == [record.id]


def test_a_record_others_may_read_is_refused(runtime):
    path = session_record.write(_record())
    os.chmod(path, 0o644)
    with pytest.raises(PermissionError, match="mode 644, which lets others read it.*chmod go-rwx"):
        session_record.read(path)
    assert session_record.all_records() == []  # never listed, never attached


@pytest.mark.skipif(os.getuid() != 0, reason="making a file another user's needs root")
def test_a_record_another_user_owns_is_refused(runtime):
    path = session_record.write(_record())
    os.chown(path, 65534, 65534)
    with pytest.raises(PermissionError, match="belongs to uid 65534, not to uid 0"):
        session_record.read(path)


@pytest.mark.skipif(os.getuid() != 0, reason="dropping to another uid needs root")
def test_another_uid_cannot_read_the_record_or_attach(runtime):
    """A process of uid 65534 gets a clear PermissionError, from the folder (0700) and from attach()."""
    session_record.write(_record("20261205-000000-other0"))
    # everything imported first: the interpreter's own files may be where uid 65534 cannot read (under /root)
    code = ("import os, nbddp, nbddp.api, nbddp.detached.attach, nbddp.detached.listing\n"
            "os.setgid(65534); os.setuid(65534)\n"
            "try:\n    nbddp.attach('20261205-000000-other0')\n"
            "except PermissionError as e:\n    print('REFUSED', e)\n")
    env = dict(os.environ, NBDDP_RUNTIME_DIR=str(runtime), HOME="/tmp")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60,
                         cwd="/tmp")
    assert "REFUSED" in out.stdout, out.stdout + out.stderr
    assert "only the user who started a detached session can attach" in out.stdout.lower()


def test_attach_with_no_session_says_so_and_lists_sessions(runtime):
    with pytest.raises(SessionError, match=r"no detached session to attach to.*nbddp.start\(detach=True\).*"
                                           r"nbddp.sessions\(\) lists none"):
        nbddp.attach()


def test_attach_to_an_ended_session_says_it_ended(runtime):
    session_record.write(_record("20261205-000000-alive0"))
    with pytest.raises(SessionError, match=r"no detached session '20261205-000000-gone00': it has ended .*"
                                           r"20261205-000000-alive0 \(2 x gloo"):
        nbddp.attach("20261205-000000-gone00")


def test_attach_with_several_sessions_asks_which(runtime):
    session_record.write(_record("20261205-000000-first0"))
    session_record.write(_record("20261205-000000-secnd0"))
    with pytest.raises(SessionError, match=r"2 detached sessions exist; say which: nbddp.attach\(id\)"):
        nbddp.attach()
    with pytest.raises(TypeError, match=r"attach\(id=...\) must be a session id"):
        nbddp.attach(3)
    with pytest.raises(TypeError, match=r"attach\(take_over=...\) must be True or False"):
        nbddp.attach("20261205-000000-first0", take_over="yes")


def test_a_second_kernel_is_refused_with_the_owners_pid(runtime):
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        session_record.write(_record("20261205-000000-owned0", kernel_pid=owner.pid))
        with pytest.raises(SessionError, match=rf"attached to another kernel \(pid {owner.pid}\).*"
                                               r"take_over=True\) \(%ddp attach 20261205-000000-owned0 --take-over\)"):
            nbddp.attach("20261205-000000-owned0")
    finally:
        owner.kill()
        owner.wait()


def test_a_record_whose_controller_is_gone_is_removed(runtime, tmp_path):
    connection = tmp_path / "ipcontroller-client.json"
    connection.write_text(json.dumps({"location": "127.0.0.1", "registration": _closed_port()}))
    path = session_record.write(_record("20261205-000000-lost00", connection_file=str(connection)))
    with pytest.raises(SessionError, match=r"session 20261205-000000-lost00 cannot be reached: its controller at "
                                           r"127.0.0.1:\d+ does not answer.*its record was removed"):
        nbddp.attach("20261205-000000-lost00")
    assert not os.path.exists(path)
    path = session_record.write(_record("20261205-000000-lost01", connection_file=str(tmp_path / "none.json")))
    with pytest.raises(SessionError, match="connection file .*none.json is gone"):
        nbddp.attach("20261205-000000-lost01")
    assert not os.path.exists(path)


def test_attach_in_a_kernel_that_has_workers_of_its_own_says_to_stop_them(runtime):
    from nbddp.session.session import get_session

    session_record.write(_record("20261205-000000-other0"))
    session = get_session()  # the test's own session (the runtime fixture), made to look started
    session.workers = object()  # type: ignore[assignment]  # (never touched: the refusal comes first)
    with pytest.raises(ClusterError, match=r"this kernel already has workers \(0 x \); call nbddp.stop\(\) before "
                                           r"attaching to session 20261205-000000-other0"):
        nbddp.attach("20261205-000000-other0")


def test_detach_without_workers_says_how_to_start_detached(runtime):
    with pytest.raises(NotStartedError, match=r"nothing to detach.*nbddp.start\(detach=True\)"):
        nbddp.detach()
    with pytest.raises(ValueError, match=r"detach\(keep_alive=...\): 'forever'"):
        nbddp.detach(keep_alive="forever")


def test_detach_while_another_kernel_owns_the_session_is_refused(runtime):
    """The kernel a session was taken from (attach(take_over=True)) may not detach it, nor work on it."""
    from nbddp.detached.detach import detach
    from nbddp.session.ownership import check_owner
    from nbddp.session.session import Session

    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        session = Session()
        session.record_path = session_record.write(_record("20261205-000000-moved0", kernel_pid=owner.pid))
        session.workers, session.group = object(), object()  # type: ignore[assignment]  # (never touched)
        with pytest.raises(SessionError, match=rf"moved to the kernel with pid {owner.pid} .*detach it from there"):
            detach(session)
        with pytest.raises(SessionError, match=rf"moved to the kernel with pid {owner.pid} .*drive it from there"):
            check_owner(session)
    finally:
        owner.kill()
        owner.wait()


def test_sessions_lists_id_world_started_running_kept_and_jobs(runtime):
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        session_record.write(_record("20261205-000000-list00", kernel_pid=owner.pid, slurm_job_ids=["7"],
                                     kept=["fsdp_model"]))
        (row,) = nbddp.sessions()
    finally:
        owner.kill()
        owner.wait()
    assert row["id"] == "20261205-000000-list00" and row["world"] == 2 and row["backend"] == "gloo"
    assert row["attached"] == owner.pid and row["kept"] == ["fsdp_model"] and row["slurm_jobs"] == ["7"]
    assert row["running"] is None and row["keep_alive_s"] == 7200.0 and row["started"].startswith("20")


# ---- the reaper's idle end, against stand-in processes --------------------------------------------------
def _reaper(pidfile, record_path, prefix: str) -> subprocess.Popen:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a kernel that has exited
    pidfile.write_text("")
    return subprocess.Popen([sys.executable, "-m", "nbddp.cluster.reaper", str(dead.pid), str(pidfile), prefix])


def test_the_reaper_ends_an_idle_detached_session_after_keep_alive(runtime, tmp_path):
    """No kernel attached, no fit running: after keep_alive the 'workers' are killed and the record removed."""
    from nbddp.cluster.idle_watch import RECORD_PREFIX
    from nbddp.protocol.notes import write_note

    prefix = f"nbddp-idle{os.getpid()}"
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    path = session_record.write(_record("20261205-000000-idle00", keep_alive_s=1.0, file_prefix=prefix))
    note = session_record.fit_note_path(prefix)
    write_note(note, {"fit_id": "f", "status": "running"})  # a fit runs: the session is in use
    pidfile = tmp_path / "pids"
    reaper = _reaper(pidfile, path, prefix)
    try:
        pidfile.write_text(f"{worker.pid}\n{RECORD_PREFIX}{path}")
        time.sleep(2.5)  # (what is checked is that nothing happens: keep_alive is counted from the fit's end)
        assert worker.poll() is None and os.path.exists(path)
        t0 = time.monotonic()
        write_note(note, {"fit_id": "f", "status": "ended"})
        assert reaper.wait(timeout=20) == 0
        assert 0.9 < time.monotonic() - t0 < 15
        assert worker.wait(timeout=10) is not None
        assert not os.path.exists(path) and not os.path.exists(note)  # the record and the session's files
    finally:
        for p in (worker, reaper):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_the_reaper_of_a_detached_session_exits_on_a_clean_stop(runtime, tmp_path):
    from nbddp.cluster.idle_watch import RECORD_PREFIX

    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    path = session_record.write(_record("20261205-000000-stop00", keep_alive_s=3600.0))
    pidfile = tmp_path / "pids"
    reaper = _reaper(pidfile, path, "")
    try:
        pidfile.write_text(f"{worker.pid}\n{RECORD_PREFIX}{path}")
        time.sleep(1.0)
        pidfile.unlink()  # what an attached kernel's nbddp.stop() does (after stopping the workers itself)
        assert reaper.wait(timeout=10) == 0
        assert worker.poll() is None  # the reaper killed nothing: stop() is the one ending them
    finally:
        for p in (worker, reaper):
            if p.poll() is None:
                p.kill()
                p.wait()


# ---- the magics parse and call the API ----------------------------------------------------------------------
def test_the_magics_call_the_api(ip, monkeypatch, capsys):
    from nbddp import api

    calls = []
    monkeypatch.setattr(api, "detach", lambda keep_alive: calls.append(("detach", keep_alive)) or
                        {"id": "X", "keep_alive_s": 3.0})
    monkeypatch.setattr(api, "attach", lambda id, take_over: calls.append(("attach", id, take_over)) or
                        {"detached": "X"})
    monkeypatch.setattr(api, "running", lambda: None)
    monkeypatch.setattr(api, "sessions", lambda: calls.append(("sessions",)) or [])
    monkeypatch.setattr(api, "start", lambda *a, **k: calls.append(("start", k["detach"], k["keep_alive"])))
    monkeypatch.setattr("nbddp.monitor.status.status_table", lambda: "")
    ip.run_line_magic("ddp", "detach --keep-alive 30m")
    ip.run_line_magic("ddp", "attach 20261205-000000-abcdef --take-over")
    ip.run_line_magic("ddp", "attach")
    ip.run_line_magic("ddp", "sessions")
    ip.run_line_magic("ddp", "start -n 2 --detach --keep-alive 3s")
    assert calls == [("detach", "30m"), ("attach", "20261205-000000-abcdef", True), ("attach", None, False),
                     ("sessions",), ("start", True, "3s")]
    out = capsys.readouterr().out
    assert "session X detached" in out and "nbddp: attached to session X" in out


def test_a_logger_that_cannot_be_handed_on_is_said_at_the_start(runtime):
    """A detached fit's loggers are pickled for a later kernel; one that cannot be is said (the fit goes on)."""
    import threading
    from types import SimpleNamespace

    from nbddp.detached import fit_loggers
    from nbddp.loggers import CSV
    from nbddp.loggers.guard import LoggerSet
    from nbddp.protocol.notices import NbddpWarning
    from nbddp.session.session import Session

    session = Session()
    session.record_path = session_record.write(_record("20261205-000000-logger"))
    entry = {"fit_id": "f1"}

    def run_with(logger):
        return SimpleNamespace(hooks=SimpleNamespace(loggers=LoggerSet([logger]), described={}, noted_runs=None),
                               plan=SimpleNamespace(cfg={"epochs": 1}))

    handed = run_with(CSV("metrics.csv"))
    fit_loggers.save(session, handed, entry)
    saved = fit_loggers.load(session.record_path, entry)
    assert saved is not None and isinstance(saved["loggers"][0], CSV) and handed.hooks.noted_runs is not None
    assert not os.path.exists(fit_loggers.loggers_path(session.record_path, "f1"))  # taken once

    unpicklable = CSV("metrics.csv")
    unpicklable.lock = threading.Lock()  # type: ignore[attr-defined]
    with pytest.warns(NbddpWarning, match="loggers cannot be handed to a kernel that attaches later"):
        fit_loggers.save(session, run_with(unpicklable), entry)
    assert fit_loggers.load(session.record_path, entry) is None


def test_a_fit_found_running_refuses_profiling_and_weights_it_did_not_bring_back(runtime):
    """A resumed fit's handle: no profile (the ranks send traces to the kernel that launched it), and no weights to
    load when the fit kept its model on the ranks; a rank asked twice for a fit's result says it has none."""
    import torch.nn as nn

    from nbddp.detached.resumed_fit import ResumedFit
    from nbddp.detached.resumed_handle import ResumedFitHandle
    from nbddp.live import NullView
    from nbddp.protocol.errors import NbddpError
    from nbddp.session.session import get_session
    from nbddp.worker.tasks.journal import take_fit_result

    run = ResumedFit(get_session(), {"fit_id": "f1", "keep": "net"}, NullView())
    with pytest.raises(NbddpError, match=r"handle.profile\(\) is not available for a fit this kernel found running "
                                         r"when it attached: the ranks send traces to the kernel that launched"):
        ResumedFitHandle(run).profile()
    with pytest.raises(NbddpError, match=r"this fit brought no weights back: it kept its model on the ranks "
                                         r"\(dist_fit\(keep='net'\): predict with nbddp.predict\(name, ...\)\)"):
        run.into(nn.Linear(1, 1))
    with pytest.raises(LookupError, match="this rank keeps no result of fit f1: it was taken already"):
        take_fit_result("f1")
