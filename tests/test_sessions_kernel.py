"""Detached sessions with real Jupyter kernels (issue 43, "Done when"): detach, SIGKILL the kernel, attach.

Each kernel is started through ``jupyter_client`` with a private records
folder (``NBDDP_RUNTIME_DIR``). One session is checked in order: a detached
kernel keeps an FSDP model, defines a ``%%ddp`` name and runs a
``block=False`` fit, then is SIGKILLed; a new kernel attaches, takes the fit
up (History continuous, weights equal to an unbroken fit's, its CSV logger's run complete), predicts with
the kept model and reads the name; a third kernel is refused, then takes
the session over (``take_over=True``: the second is refused work and its
``stop()`` only lets go); a process of another uid cannot attach; the
third kernel's ``nbddp.stop()`` leaves nothing. A second test
lets an abandoned session end by its ``keep_alive``. The last two keep an
elastic fit's ``max_restarts`` with no kernel attached (the caretaker,
``nbddp/detached/caretaker.py``): a rank lost then is replaced and the fit
relaunched, a dead kernel's callback points are skipped, and a fit past
``max_restarts`` ends with the loss named to the next kernel. A kernel killed
without ``detach`` is ``tests/test_orphans.py``'s (run as ever: nothing left).
"""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.timeout(420), pytest.mark.fresh_workers, pytest.mark.faults, pytest.mark.notebook]

from kernel_cells import HELPERS, ROOT, Kernel, alive, kill, none_left, wait_gone

COMMON = HELPERS + """
import json, os, time, torch, nbddp
from nbddp.session.session import get_session
torch.manual_seed(0)
X = torch.randn(256, 8); Y = X.sum(1, keepdim=True)
def net():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
FIT = dict(epochs=EPOCHS, batch_size=4, lr=0.01, seed=3, live=False, log_every=8)
"""

BEFORE = """
nbddp.start(2, backend="gloo", detach=True, keep_alive="10m")
nbddp.dist_fit(net(), (X, Y), epochs=1, batch_size=16, strategy="fsdp", keep="fsdp_m", live=False, seed=0)
torch.save(nbddp.predict("fsdp_m", X[:32], live=False), PREDICTED)
nbddp.run_cell("secret = 40 + rank")
handle = nbddp.dist_fit(net(), (X, Y), **FIT, block=False, loggers=[nbddp.loggers.CSV(CSV_PATH)])
while len(handle.history.steps) < 3:
    time.sleep(0.02)
s = get_session()
out({"pids": session_pids(), "prefix": s.file_prefix, "record": s.record_path,
    "steps": len(handle.history.steps)})
"""

AFTER = """
t0 = time.perf_counter()
nbddp.attach()
attach_s = time.perf_counter() - t0
handle = nbddp.running()
was_running = not handle.done()
at_attach = len(handle.history.steps)  # the whole curve so far, before any new record (what the view draws)
model = net()
history = handle.wait(into=model)
steps = [r["step"] for r in history.steps]
reference = net()
unbroken = nbddp.dist_fit(reference, (X, Y), **FIT)
weights_diff = max((a - b).abs().max().item() for a, b in zip(model.state_dict().values(),
                                                                reference.state_dict().values()))
kept = nbddp.kept()
import csv
with open(CSV_PATH) as f:
    rows = list(csv.DictReader(f))
csv_runs = sorted({r["run"] for r in rows})
csv_steps = [int(r["step"]) for r in rows if r["kind"] == "step"]
predict_diff = (nbddp.predict("fsdp_m", X[:32], live=False) - torch.load(PREDICTED)).abs().max().item()
out({"attach_s": attach_s, "was_running": was_running, "steps": steps,
    "at_attach": at_attach,
    "unbroken_steps": [r["step"] for r in unbroken.steps],
    "loss_diff": max(abs(a["loss"] - b["loss"]) for a, b in zip(history.steps, unbroken.steps)),
    "epochs": len(history.epochs), "status": history.status, "weights_diff": weights_diff,
    "kept": kept, "predict_diff": predict_diff, "csv_runs": csv_runs,
    "csv_steps": csv_steps,
    "secret": nbddp.pull("secret", ranks=[0, 1])["secret"],
    "pid": os.getpid(), "id": nbddp.sessions()[0]["id"]})
"""

REFUSED = """
try:
    nbddp.attach()
except nbddp.SessionError as e:
    out({"refused": str(e)})
"""


def _other_uid_attach(runtime: str, session_id: str) -> str:
    code = ("import os, nbddp, nbddp.api, nbddp.detached.attach, nbddp.detached.listing\n"
            "os.setgid(65534); os.setuid(65534)\n"
            f"try:\n    nbddp.attach({session_id!r})\n"
            "except PermissionError as e:\n    print('REFUSED', e)\n")
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, NBDDP_RUNTIME_DIR=runtime, HOME="/tmp"),
                         capture_output=True, text=True, timeout=120, cwd="/tmp")
    return out.stdout + out.stderr


def test_a_fit_kept_models_and_names_outlive_a_killed_kernel(tmp_path):
    """The whole story in one session: three kernels, one set of workers, an FSDP fit, a fit killed in the middle
    of and the unbroken fit it is compared with (about 35 s on 2 cores)."""
    runtime = str(tmp_path / "runtime")
    common = (COMMON.replace("EPOCHS", "12") + f"PREDICTED = {str(tmp_path / 'predicted.pt')!r}\n"
              f"CSV_PATH = {str(tmp_path / 'metrics.csv')!r}\n")
    first = Kernel(NBDDP_RUNTIME_DIR=runtime)
    pids: list[int] = []
    kernels = [first]
    try:
        first.run(common)
        before = first.run(BEFORE, timeout=300)
        pids = before["pids"]
        first.kill()  # no detach() call, no clean exit: the kernel is gone at once
        time.sleep(1.5)  # the engines' watchdogs look every 0.5 s: they would have exited by now
        assert len(alive(pids)) == len(pids), "a detached session's workers died with their kernel"

        second = Kernel(NBDDP_RUNTIME_DIR=runtime)
        kernels.append(second)
        second.run(common)
        after = second.run(AFTER, timeout=300)
        assert after["attach_s"] < 2.0, after
        assert after["was_running"], "the fit ended before the new kernel attached: make it longer"
        assert after["at_attach"] >= before["steps"]  # the journal replayed every record from before the kill
        # continuous: every record the unbroken fit has, in order, with the same losses (none lost in the restart)
        assert after["steps"] == after["unbroken_steps"] and after["steps"][-1] == 12 * 32
        assert after["loss_diff"] <= 1e-6
        # the loggers given at the start wrote the same run on, through the restart: every step once, in order
        assert len(after["csv_runs"]) == 1 and after["csv_steps"] == after["steps"]
        assert after["epochs"] == 12 and after["status"] == "completed"
        assert after["weights_diff"] <= 1e-6
        (kept,) = after["kept"]
        assert kept["name"] == "fsdp_m" and kept["strategy"] == "fsdp" and kept["params"] == 8 * 16 + 16 + 16 + 1
        assert after["predict_diff"] <= 1e-6
        assert after["secret"] == [40, 41]

        third = Kernel(NBDDP_RUNTIME_DIR=runtime)
        kernels.append(third)
        third.run(COMMON.replace("EPOCHS", "1"))
        refused = third.run(REFUSED)["refused"]
        assert f"attached to another kernel (pid {second.pid})" in refused

        assert "REFUSED" in _other_uid_attach(runtime, after["id"])

        moved = third.run("nbddp.attach(take_over=True)\n"
                          "out(nbddp.pull('secret', ranks=[0, 1])['secret'])")
        assert moved == [40, 41]  # the session moved to the third kernel, the names with it
        left = second.run("try:\n    nbddp.run(os.getpid)\nexcept nbddp.SessionError as e:\n"
                          "    nbddp.stop()  # (lets go only: the third kernel drives the session)\n"
                          "    out({'refused': str(e)})")
        assert left is not None and f"moved to the kernel with pid {third.pid}" in left["refused"]
        assert len(alive(pids)) == len(pids)

        third.run("nbddp.stop()")
        assert wait_gone(pids, 15) == []
        assert glob.glob(f"/dev/shm/{before['prefix']}*") == []
        assert not os.path.exists(before["record"])
    finally:
        for kernel in kernels:
            kernel.close()
        kill(pids)


def test_an_abandoned_session_ends_at_keep_alive_leaving_nothing(tmp_path):
    runtime = str(tmp_path / "runtime")
    kernel = Kernel(NBDDP_RUNTIME_DIR=runtime)
    pids: list[int] = []
    try:
        out = kernel.run(HELPERS + """
import json, nbddp
from nbddp.session.session import get_session
import os
nbddp.start(2, backend="gloo", detach=True, keep_alive="3s")
s = get_session()
record = json.load(open(s.record_path))
out({"pids": session_pids(), "prefix": s.file_prefix, "record": s.record_path,
    "modes": [oct(os.stat(p).st_mode & 0o777) for p in
              (s.record_path, record["cluster_file"], record["connection_file"])]})
""")
        pids = out["pids"]
        assert out["modes"] == ["0o600"] * 3  # the record, ipyparallel's cluster file, the connection file
        kernel.kill()
        t0 = time.monotonic()
        time.sleep(1.5)
        assert len(alive(pids)) == len(pids), "ended before its keep_alive"
        assert wait_gone(pids, 20) == [], "still running 20 s after its 3 s keep_alive"
        assert time.monotonic() - t0 >= 3.0
        none_left(pids, out["prefix"])  # and no /dev/shm file within 5 s
        assert not os.path.exists(out["record"])
    finally:
        kernel.close()
        kill(pids)


NOTEBOOK_SHOWS = ["records so far, status 'training': now restart the kernel",  # before the restart
                  "nbddp: attached to session", "its fit goes on: nbddp.running() is its handle",
                  "detached session",  # (%ddp attach's table)
                  "completed: 60 epochs, step records", "none missing: True",
                  # the two ranks' lines stream as each rank prints: either may come first
                  ("rank 0 kept this before the restart", "rank 1 kept this before the restart"), "workers stopped"]


def _notebook_text(path: str) -> str:
    import nbformat

    nb = nbformat.read(path, as_version=4)
    return "\n".join(o.get("text", "") or o.get("data", {}).get("text/plain", "")
                     for c in nb.cells if c.cell_type == "code" for o in c.outputs)


def _in_order(text: str, wanted: list[str | tuple[str, ...]]) -> list[str]:
    """The strings of ``wanted`` not found in ``text`` in that order (those of a tuple in any order among
    themselves, all after what came before and before what comes after)."""
    at, missing = 0, []
    for item in wanted:
        group = (item,) if isinstance(item, str) else item
        ends = []
        for w in group:
            found = text.find(w, at)
            if found < 0:
                missing.append(w)
            else:
                ends.append(found + len(w))
        at = max(ends, default=at)
    return missing


def test_the_restart_mid_fit_notebook_comes_from_a_real_restart(tmp_path, monkeypatch):
    """``scripts/make_restart_mid_fit.py --run`` restarts a real kernel between its cells (nbclient cannot):
    notebooks/restart_mid_fit.ipynb's outputs come from such a run, and one is made and checked here."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        import make_restart_mid_fit
    finally:
        sys.path.remove(os.path.join(ROOT, "scripts"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("NBDDP_RUNTIME_DIR", str(tmp_path / "runtime"))
    path = make_restart_mid_fit.main(["--run"])
    made = _notebook_text(path)
    assert _in_order(made, NOTEBOOK_SHOWS) == [], made
    assert _in_order(_notebook_text(os.path.join(ROOT, "notebooks", "restart_mid_fit.ipynb")), NOTEBOOK_SHOWS) == []
    assert os.listdir(tmp_path / "runtime") == []  # %ddp stop ended the session: no record left


def _python(code: str, runtime: str) -> dict | None:
    """``code`` in a new process (a kernel of its own, without Jupyter, with ``HELPERS``); what it gave ``out()``."""
    done = subprocess.run([sys.executable, "-c", HELPERS + code], env=dict(os.environ, PYTHONPATH=ROOT, NBDDP_RUNTIME_DIR=runtime),
                          capture_output=True, text=True, timeout=240, cwd=ROOT)
    lines = [l for l in done.stdout.splitlines() if l.startswith("NBDDP-OUT")]
    assert lines or done.returncode == 0, done.stderr[-3000:]
    return json.loads(lines[-1].split(" ", 1)[1]) if lines else None


def test_a_worker_lost_while_no_kernel_is_attached_ends_the_session(tmp_path):
    """Nothing replaces a lost rank while no kernel is attached (max_restarts is the kernel's): attach() says which
    worker died, and the session is ended with nothing left."""
    runtime = str(tmp_path / "runtime")
    first = _python("""
import os, nbddp
from nbddp.session.session import get_session
nbddp.start(2, backend="gloo", detach=True, keep_alive="10m")
s = get_session()
out({"pids": session_pids(), "rank1": s.placements[1].pid, "prefix": s.file_prefix,
    "record": s.record_path})
os._exit(0)  # a kernel that dies: no clean-up
""", runtime)
    assert first is not None
    pids = first["pids"]
    try:
        os.kill(first["rank1"], signal.SIGKILL)
        out = _python("""
import json, nbddp
try:
    nbddp.attach()
except nbddp.SessionError as e:
    out({"refused": str(e)})
""", runtime)
        assert out is not None, "attach() took up a session that had lost a worker"
        assert f"(pid {first['rank1']}) died while no kernel was attached" in out["refused"]
        assert "the session was ended, leaving nothing behind" in out["refused"]
        assert wait_gone(pids, 20) == []
        assert not os.path.exists(first["record"]) and glob.glob(f"/dev/shm/{first['prefix']}*") == []
    finally:
        kill(pids)


def test_a_fit_taken_up_by_attach_stops_when_asked(tmp_path):
    """``handle.stop()`` on a fit found running: every rank stops at the same step, the History says so; then
    ``nbddp.restart()`` keeps the session detached."""
    runtime = str(tmp_path / "runtime")
    first = _python(COMMON.replace("EPOCHS", "400") + """
nbddp.start(2, backend="gloo", detach=True, keep_alive="10m")
handle = nbddp.dist_fit(net(), (X, Y), **FIT, block=False)
while len(handle.history.steps) < 2:
    time.sleep(0.02)
s = get_session()
out({"pids": session_pids()})
os._exit(0)
""", runtime)
    assert first is not None
    try:
        out = _python(COMMON.replace("EPOCHS", "400") + """
nbddp.attach()
handle = nbddp.running()
try:
    handle.profile(2)
except nbddp.NbddpError as e:
    refused = str(e)
history = handle.stop()
model = net()
handle.result(into=model)
nbddp.restart()  # fresh workers, detached again with the same keep_alive
(again,) = nbddp.sessions()
out({"status": history.status, "epochs": len(history.epochs), "refused": refused,
    "last": history.steps[-1]["step"], "again": again})
nbddp.stop()
""", runtime)
        assert out is not None and out["status"] == "interrupted" and out["epochs"] < 400, out
        assert "not available for a fit this kernel found running" in out["refused"]
        assert out["again"]["this_kernel"] and out["again"]["keep_alive_s"] == 600.0
        assert wait_gone(first["pids"], 15) == []
    finally:
        kill(first["pids"])


# ---------------------------------------------------------------- an elastic fit while no kernel is attached

CARED = HELPERS + """
import json, os, time, torch, nbddp
from nbddp.session.session import get_session
torch.manual_seed(0)
X = torch.randn(256, 8); Y = X.sum(1, keepdim=True)
class SlowNet(torch.nn.Module):
    # slow while the test's marker exists, so the fit outlasts the kills; the reference fit runs at full speed
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    def forward(self, x):
        if os.path.exists(MARK):
            time.sleep(0.25)
        return self.body(x)
class Answered(nbddp.callbacks.Callback):
    def on_epoch_end(self, record):  # a synchronous point: rank 0 waits for this kernel's answer
        return None
FIT = dict(epochs=4, batch_size=4, lr=0.01, seed=3, live=False, log_every=8)
ELASTIC = dict(max_restarts=2, snapshot_every=4)
"""

CARED_START = """
nbddp.start(2, backend="gloo", detach=True, keep_alive="10m")
handle = nbddp.dist_fit(SlowNet(), (X, Y), **FIT, **ELASTIC, callbacks=[Answered()], block=False)
while handle.history.last_step < 8:
    time.sleep(0.02)
s = get_session()
out({"pids": session_pids(), "prefix": s.file_prefix, "record": s.record_path,
    "ranks": [p.pid for p in s.placements], "fit_id": s.running.plan.launch.fit_id})
"""


def _driving(record: str, timeout: float = 90) -> int:
    """The caretaker's pid, once it drives the fit (its log says so)."""
    log = record[:-len(".json")] + "-caretaker.log"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(log) and "nbddp caretaker: driving fit" in open(log).read():
            return json.load(open(record))["caretaker_pid"]
        time.sleep(0.05)
    raise AssertionError(f"no caretaker drove the fit within {timeout} s: "
                         f"{open(log).read() if os.path.exists(log) else 'no log'}")


def _ledger(record: str, fit_id: str, until, timeout: float = 150):
    """The fit's restarts ledger once ``until(ledger)`` holds (the caretaker writes it as it relaunches)."""
    from nbddp.detached.care_spec import load_ledger

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ledger = load_ledger(record, fit_id)
        except Exception:  # noqa: BLE001 - mid-replace
            ledger = None
        if ledger is not None and until(ledger):
            return ledger
        time.sleep(0.05)
    log = record[:-len(".json")] + "-caretaker.log"
    raise AssertionError(f"the ledger never got there: {open(log).read() if os.path.exists(log) else 'no log'}")


CARED_ATTACH = """
import warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    nbddp.attach()
    handle = nbddp.running()
    os.kill(get_session().placements[1].pid, 9)  # attached now: this kernel replaces the rank and relaunches
    while len(handle.history.restarts) < 2 or handle.history.restarts[-1]["step_resumed_from"] is None:
        time.sleep(0.05)
    os.unlink(MARK)  # full speed from here: the fit ends
    model = SlowNet()
    t0 = time.monotonic()
    history = handle.wait(into=model)
    waited = time.monotonic() - t0
reference = SlowNet()
unbroken = nbddp.dist_fit(reference, (X, Y), **FIT)
s = get_session()
out({
    "steps": [r["step"] for r in history.steps], "unbroken_steps": [r["step"] for r in unbroken.steps],
    "epoch_losses": [e["loss"] for e in history.epochs], "unbroken_losses": [e["loss"] for e in unbroken.epochs],
    "weights_diff": max((a - b).abs().max().item() for a, b in zip(model.state_dict().values(),
                                                                   reference.state_dict().values())),
    "status": history.status, "restarts": history.restarts, "timings": history.timings, "waited": waited,
    "notices": [str(w.message) for w in caught], "pids": session_pids()})
nbddp.stop()
"""


def test_a_detached_elastic_fit_is_relaunched_with_no_kernel_and_skips_its_dead_kernels_callbacks(tmp_path):
    """A kernel through jupyter_client runs an elastic fit with a synchronous callback, detached, and is SIGKILLed;
    then a rank's engine is SIGKILLed with no kernel attached: the caretaker has it replaced and the fit relaunched
    from its snapshot; the callback points are skipped, not waited for; a new kernel attaches (taking the fit from
    the caretaker), loses a rank again and relaunches the fit itself, and gets the whole fit with an unbroken fit's
    weights. A kernel start, a fit that outlasts a caretaker's start and two heals, the reference fit: about 48 s
    here."""
    runtime = str(tmp_path / "runtime")
    mark = str(tmp_path / "slow")
    open(mark, "w").close()
    common = f"MARK = {mark!r}" + CARED
    first = Kernel(NBDDP_RUNTIME_DIR=runtime)
    pids: list[int] = []
    try:
        first.run(common)
        before = first.run(CARED_START, timeout=300)
        pids = before["pids"]
        first.kill()
        caretaker = _driving(before["record"])
        pids.append(caretaker)
        killed_at = time.monotonic()
        os.kill(before["ranks"][1], signal.SIGKILL)  # with no kernel attached
        ledger = _ledger(before["record"], before["fit_id"], lambda l: len(l.restarts) == 1 and not l.pending)
        relaunched_s = time.monotonic() - killed_at
        assert pid_running(caretaker), "the caretaker left before the fit ended, with no kernel attached"
        (event,) = ledger.restarts
        assert event["rank"] == 1 and event["step_resumed_from"] >= 4 and event["step_resumed_from"] % 4 == 0
        after = _python(common + CARED_ATTACH, runtime)
        assert after is not None
        pids += after["pids"]
        # continuous: every step once, in order (the replayed steps took the place of those after the snapshot),
        # to the last; every epoch's loss that of the unbroken fit
        steps = after["steps"]
        assert after["status"] == "completed" and steps == sorted(set(steps)) and steps[-1] == 4 * 32, after
        assert steps[0] == 1 and len(after["epoch_losses"]) == 4
        assert after["epoch_losses"] == pytest.approx(after["unbroken_losses"], abs=1e-6)
        assert after["weights_diff"] == 0.0  # a resume from a snapshot is exact, as in a kernel-driven restart
        seen, again = after["restarts"]  # the caretaker's restart, then the attached kernel's
        assert seen["rank"] == 1 and seen["step_resumed_from"] == event["step_resumed_from"] and seen["seconds"] > 0
        assert again["rank"] == 1 and again["step_resumed_from"] >= seen["step_resumed_from"]
        # the callback points after the kernel died were skipped at once (each would have waited 600 s), and said
        assert after["timings"]["callback_points_skipped"] >= 1 and after["waited"] < 120
        assert any("synchronous callback point(s)" in n and "were skipped" in n for n in after["notices"]), after
        print(f"relaunched {relaunched_s:.1f} s after the kill")
        none_left(pids, before["prefix"])
        assert not os.path.exists(before["record"])
    finally:
        first.close()
        _end(before["record"] if "before" in locals() and before else "", pids)


def pid_running(pid: int) -> bool:
    return bool(alive([pid]))


def _end(record: str, pids: list[int]) -> None:
    """A failed test's clean-up: the record removed, the reaper ends the session (the engines a heal started
    included), then whatever is left of ``pids`` is killed."""
    if record and os.path.exists(record):
        os.unlink(record)
        wait_gone(pids, 20)
    kill(pids)


def test_past_max_restarts_with_no_kernel_the_fit_ends_naming_the_loss_and_attach_says_so(tmp_path):
    """Two ranks lost with no kernel attached, ``max_restarts=1``: the first is relaunched, the second ends the
    fit; the next kernel's handle raises the loss with the reason. Two heals with no kernel: about 40 s here."""
    runtime = str(tmp_path / "runtime")
    mark = str(tmp_path / "slow")
    open(mark, "w").close()
    common = f"MARK = {mark!r}" + CARED
    start = CARED_START.replace(", callbacks=[Answered()]", "").replace("**ELASTIC", "max_restarts=1, snapshot_every=4")
    first = _python(common + start + "\nos._exit(0)\n", runtime)
    assert first is not None
    pids = first["pids"]
    try:
        pids.append(_driving(first["record"]))
        os.kill(first["ranks"][1], signal.SIGKILL)
        _ledger(first["record"], first["fit_id"], lambda l: len(l.restarts) == 1 and not l.pending)
        os.kill(first["ranks"][0], signal.SIGKILL)  # the second loss: max_restarts=1 is used up
        failed = _ledger(first["record"], first["fit_id"], lambda l: bool(l.failed))
        assert "max_restarts=1 were all used" in failed.failed
        out = _python(common + """
nbddp.attach()
try:
    nbddp.running().wait()
except nbddp.WorkerError as e:
    error = str(e)
s = get_session()
out({"error": error, "running": nbddp.running() is not None, "pids": session_pids()})
nbddp.stop()
""", runtime)
        assert out is not None
        pids += out["pids"]
        assert re.search(r"rank [01] \(pid \d+ on .*\): WorkerDied", out["error"]), out
        assert "max_restarts=1 were all used" in out["error"]
        none_left(pids, first["prefix"])
        assert not os.path.exists(first["record"])
    finally:
        _end(first["record"], pids)
