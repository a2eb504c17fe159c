"""Hangs you can see into (issue 17), on 2 CPU gloo workers: heartbeats, stacks, stall timeouts, a dead controller.

Each misbehaving rank writes ``time.time()`` to a marker right before it
stops advancing, so the tests measure from the stall itself. Bounds carry a
wide margin: the machine is shared. Measured times go to
``faultkit.TIMES_FILE``. The unit tests at the end need no workers.
"""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import cloudpickle
import psutil
import pytest
import torch
import torch.nn as nn

import nbddp
from faultkit import FailingData, Net, good_fit, mark, rank, read_mark, record_time, regression_data
from nbddp.execution import stalls
from nbddp.protocol.errors import ClusterError, NotStartedError, WorkerError, WorkerStalled

pytestmark = pytest.mark.timeout(240)
cloudpickle.register_pickle_by_value(sys.modules[__name__])

FAST_STALL_S = 4.0  # the display threshold in tests that are not about it (the real one, 10 s, is tested once)


@pytest.fixture
def fast_stalls(monkeypatch):
    monkeypatch.setattr(stalls, "MIN_STALL_S", FAST_STALL_S)


# --------------------------------------------------------------------------- what misbehaves (sent by value)


def wait_for_network_disk() -> None:
    time.sleep(600)


def spin_forever() -> None:
    n = 0
    while True:
        n += 1


class BlockingData(FailingData):
    """Rank ``who`` blocks in ``__getitem__`` at its ``after``-th sample, after writing ``marker``."""

    def misbehave(self) -> None:
        mark(self.marker)
        wait_for_network_disk()


class LoopingStep:
    """``step_fn`` that spins forever in Python on rank ``who`` at its ``call``-th step."""

    def __init__(self, who: int, call: int, marker: str):
        self.who, self.call, self.marker, self.calls = who, call, marker, 0

    def __call__(self, model: nn.Module, batch):
        self.calls += 1
        if rank() == self.who and self.calls == self.call:
            mark(self.marker)
            spin_forever()
        x, y = batch
        return nn.functional.mse_loss(model(x), y)


def _notices(recwarn) -> str:
    """What nbddp told the person through warnings (stall hints, how a stop ended), one notice a line."""
    return "\n".join(str(w.message) for w in recwarn if issubclass(w.category, nbddp.NbddpWarning))


def _recover(session, fault: str, **measured: float) -> None:
    t0 = time.perf_counter()
    session.wait_healed(raise_error=True)
    healed = time.perf_counter() - t0
    h, fit_s = good_fit()
    assert session.world_size == 2 and h.world_size == 2
    record_time(fault, heal_s=healed, next_fit_s=fit_s, **measured)


def _wait_for(condition, timeout: float = 60.0, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout} s")
        time.sleep(0.05)


def _interrupt_main_when_stalled(session, found: dict, stacks: bool = True) -> threading.Thread:
    """From a helper thread: once the running work shows a stalled rank, take every stack, then interrupt."""
    main = threading.main_thread().ident

    def _go() -> None:
        def stalled():
            work = session.running
            return work is not None and work.tasks is not None and bool(work.tasks.stalls.stalled)
        _wait_for(stalled, what="a stall")
        found["stalled"] = list(session.running.tasks.stalls.stalled)
        if stacks:
            t0 = time.monotonic()
            found["stacks"] = nbddp.stacks()
            found["stacks_s"] = time.monotonic() - t0
        found["interrupted_at"] = time.monotonic()
        signal.pthread_kill(main, signal.SIGINT)

    thread = threading.Thread(target=_go, daemon=True)
    thread.start()
    return thread


# --------------------------------------------------------------------------- fits


@pytest.mark.faults
def test_a_rank_blocked_in_getitem_is_shown_with_its_stack_and_a_stop_still_returns(workers, tmp_path, ip, capsys,
                                                                                  recwarn):
    marker = str(tmp_path / "blocked")
    torch.manual_seed(0)
    model = Net()
    before = copy.deepcopy(model.state_dict())
    x, y = regression_data()
    handle = nbddp.dist_fit(model, BlockingData(x, y, 1, 40, marker), batch_size=8, epochs=1, live="text",
                            block=False)
    state = handle._run.live_state
    t_block = read_mark(marker, timeout=60)
    _wait_for(lambda: state.stalled, what="the stall shown")
    shown = time.time() - t_block
    stall = state.stalled[0]
    assert [s["rank"] for s in state.stalled] == [1], state.stalled
    assert stall["phase"] == "data" and "wait_for_network_disk" in stall["stack"], stall
    assert stalls.MIN_STALL_S - 1.5 <= shown <= stalls.MIN_STALL_S + 10, f"shown {shown:.1f} s after the stall"
    where = {p["rank"]: p for p in state.positions}
    assert where[0]["phase"] == "backward" and where[1]["phase"] == "data", where  # rank 0 waits in DDP's all-reduce
    assert where[0]["step"] == where[1]["step"] >= 1
    t0 = time.monotonic()
    ip.run_line_magic("ddp", "stacks")
    stacks_s = time.monotonic() - t0
    printed = capsys.readouterr().out
    assert stacks_s < 5, f"%ddp stacks took {stacks_s:.1f} s"
    one, zero = printed.split("rank 1 (pid")[-1], printed.split("rank 0 (pid")[-1].split("rank 1 (pid")[0]
    # code shipped by value keeps its names and line numbers, not its file (cloudpickle: "<dynamic-code>")
    assert "__getitem__" in one and "wait_for_network_disk" in one, printed
    assert "backward" in zero and "train_micro_batch" in zero, printed
    assert _notices(recwarn).count("dist_fit(stall_timeout=SECONDS)") == 1, "the hint is given once"
    t0 = time.monotonic()
    h = handle.stop()
    stopped = time.monotonic() - t0
    assert h.status == "interrupted"
    assert stopped < stalls.STOP_GRACE_S + 10, f"the stop took {stopped:.1f} s"
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k])
    said = _notices(recwarn)  # notices are NbddpWarnings: a person can filter them
    assert "the model keeps the weights it had before this call" in said.lower(), said
    assert said.count("dist_fit(stall_timeout=SECONDS)") == 1
    _recover(workers, "stalled in __getitem__, then stopped", shown_s=shown, stacks_s=stacks_s, stop_s=stopped)


@pytest.mark.faults
def test_stall_timeout_fails_an_endless_loop_in_step_fn_and_the_next_fit_works(workers, tmp_path):
    marker = str(tmp_path / "spinning")
    timeout = 4.0
    old_pids = [p.pid for p in workers.placements]
    with pytest.raises(WorkerStalled, match=r"rank 1 \(pid \d+ .*\): WorkerStalled: made no progress for \d+ s in "
                                            r"forward .*stall_timeout=4 s") as info:
        nbddp.dist_fit(Net(), regression_data(), batch_size=16, epochs=2, step_fn=LoopingStep(1, 3, marker),
                       stall_timeout=timeout, live=False)
    t_error = time.time()
    waited = t_error - read_mark(marker, timeout=1)
    err = info.value
    assert isinstance(err, WorkerError) and err.rank == 1 and err.ranks == [1]
    assert timeout - 0.5 <= waited <= timeout + 10, f"WorkerStalled came {waited:.1f} s after the stall"
    assert "spin_forever" in err.stacks[1] and "fit_task" in err.stacks[1]
    assert 0 in err.stacks, "the rank waiting for it shows where it waits"
    assert "were killed" in str(err) and "spin_forever" in str(err)
    rendered = "\n".join(err._render_traceback_())
    assert "stack of rank 1 (stalled)" in rendered and "stack of rank 0 (waiting)" in rendered
    _recover(workers, "endless loop in step_fn, stall_timeout=4 s", report_s=waited)
    assert not set(old_pids) & {p.pid for p in workers.placements}, "the stalled ranks were replaced"


def test_start_sets_the_default_stall_timeout_and_dist_fit_overrides_it(workers):
    nbddp.start(n=2, backend="gloo", stall_timeout=120)
    try:
        assert nbddp.status()["stall_timeout"] == 120.0
        handle = nbddp.dist_fit(Net(), regression_data(), batch_size=16, max_steps=4, live=False, block=False)
        assert handle._run.policy.stall_timeout == 120.0 and handle.wait().status == "completed"
        handle = nbddp.dist_fit(Net(), regression_data(), batch_size=16, max_steps=4, live=False, block=False,
                                stall_timeout=30)
        assert handle._run.policy.stall_timeout == 30.0 and handle.wait().status == "completed"
    finally:
        workers.options.stall_timeout = None


@pytest.mark.parametrize("bad, error, text", [(0, ValueError, "must be > 0 seconds"), (-3, ValueError, "got -3"),
                                               ("soon", TypeError, "a number of seconds or None, got str 'soon'"),
                                               (True, TypeError, "got bool True")])
def test_a_bad_stall_timeout_is_refused_before_anything_runs(bad, error, text):
    with pytest.raises(error, match=rf"dist_fit\(stall_timeout=\.\.\.\).*{text}"):
        nbddp.dist_fit(Net(), regression_data(), stall_timeout=bad, live=False)


@pytest.mark.faults
def test_a_process_group_timeout_error_carries_the_ranks_last_stacks(workers):
    from nbddp.session.session import DEFAULT_PG_TIMEOUT_S

    nbddp.start(n=2, backend="gloo", timeout=3)
    try:
        with pytest.raises(WorkerError, match=r"(?i)timed out") as info:
            nbddp.run(_one_rank_never_joins)
    finally:
        nbddp.start(n=2, backend="gloo", timeout=DEFAULT_PG_TIMEOUT_S)
    text = str(info.value)
    assert "the ranks' last stacks:" in text, text
    last = text.split("the ranks' last stacks:")[1]
    zero, one = last.split("[rank 1]")
    assert "[rank 0]" in zero and "all_reduce" in zero, text
    assert "wait_for_network_disk" in one, text
    _recover(workers, "process-group timeout with stacks")


def _one_rank_never_joins() -> float:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        wait_for_network_disk()
    t = torch.ones(1)
    dist.all_reduce(t)
    return float(t)


# --------------------------------------------------------------------------- %%ddp cells

BLOCKED_CELL = """
import time, torch, torch.distributed as dist
def wait_for_network_disk():
    time.sleep(600)
if rank == 1:
    wait_for_network_disk()          # rank 1 is stuck here
dist.all_reduce(torch.ones(1))       # rank 0 waits for it here
"""

SKIPPED_COLLECTIVE_CELL = """
import torch, torch.distributed as dist
if rank == 0:
    dist.all_reduce(torch.ones(1))   # rank 1 skips it and finishes
"""


@pytest.mark.faults
def test_stacks_name_the_blocked_frame_and_the_collective_its_peer_waits_in(workers, ip, fast_stalls):
    found: dict = {}
    thread = _interrupt_main_when_stalled(workers, found)
    with pytest.raises(KeyboardInterrupt, match=r"%%ddp cell interrupted"):
        ip.run_cell_magic("ddp", "", BLOCKED_CELL)
    thread.join(30)
    assert [s["rank"] for s in found["stalled"]] == [1], found["stalled"]
    stacks = found["stacks"]
    assert found["stacks_s"] < 5, f"stacks() took {found['stacks_s']:.1f} s"
    assert [e.rank for e in stacks] == [0, 1]
    one, zero = stacks[1], stacks[0]
    assert one.state == "busy" and "wait_for_network_disk" in one.text and "time.sleep(600)" in one.text, one
    assert "waiting in a collective" in zero.label and "all_reduce" in zero.text, zero
    assert "dist.all_reduce(torch.ones(1))" in zero.text, "the cell's own line, from the kernel's copy of the cell"
    assert "rank 1 (pid" in repr(stacks) and "<pre>" in stacks._repr_html_()
    workers.wait_healed(raise_error=True)
    ip.run_cell_magic("ddp", "", "x = rank")
    record_time("%%ddp cell blocked, stacks()", stacks_s=found["stacks_s"])


@pytest.mark.faults
def test_a_cell_that_skips_a_collective_shows_the_stall_and_an_interrupt_replaces_the_stuck_rank(
        workers, ip, fast_stalls, recwarn):
    found: dict = {}
    old = {p.rank: p.pid for p in workers.placements}
    thread = _interrupt_main_when_stalled(workers, found, stacks=False)
    with pytest.raises(KeyboardInterrupt, match=r"rank 0 has made no progress for \d+ s in collective, so it could "
                                                r"not stop: rank\(s\) 0 were killed"):
        ip.run_cell_magic("ddp", "", SKIPPED_COLLECTIVE_CELL)
    stopped = time.monotonic() - found["interrupted_at"]
    thread.join(30)
    assert [(s["rank"], s["phase"]) for s in found["stalled"]] == [(0, "collective")]
    assert stopped < stalls.STOP_GRACE_S + 10, f"the interrupt took {stopped:.1f} s"
    said = _notices(recwarn)
    assert said.count("rank 0 has made no progress") == 1 and "all_reduce" in said, said
    assert "Kernel > Interrupt stops it" in said
    workers.wait_healed(raise_error=True)
    assert {p.rank: p.pid for p in workers.placements}[0] != old[0], "the stuck rank was replaced"
    ip.run_cell_magic("ddp", "", "import torch, torch.distributed as dist\ndist.all_reduce(torch.ones(1))")
    record_time("%%ddp cell skipped a collective, interrupt", stop_s=stopped)


# --------------------------------------------------------------------------- nbddp.run and scripts

NAPPING_SCRIPT = """
import os, time

def napping():
    open(os.path.join({folder!r}, "started-%d" % os.getpid()), "w").close()
    while not os.path.exists({release!r}):  # napping until the test has taken the stacks
        time.sleep(0.02)

napping()
"""


def napping(folder: str, release: str) -> int:
    open(os.path.join(folder, f"started-{os.getpid()}"), "w").close()
    deadline = time.monotonic() + 60
    while not os.path.exists(release) and time.monotonic() < deadline:  # until the test has taken the stacks
        time.sleep(0.02)
    return rank()


def _stacks_taken_meanwhile(folder, release: str) -> tuple[dict, threading.Thread]:
    """A thread that takes ``nbddp.stacks()`` once both ranks are in the call (each wrote its file), then lets the
    call end; what it found (``stacks``, ``stacks_s``) once joined."""
    found: dict = {}

    def take_stacks() -> None:
        try:
            _wait_for(lambda: len(list(folder.glob("started-*"))) == 2, what="both ranks in the call")
            t0 = time.monotonic()
            found["stacks"] = nbddp.stacks()
            found["stacks_s"] = time.monotonic() - t0
        finally:
            open(release, "w").close()

    thread = threading.Thread(target=take_stacks, daemon=True)
    thread.start()
    return found, thread


@pytest.mark.faults
@pytest.mark.parametrize("how", ["run", "script"])
def test_stacks_see_into_nbddp_run_and_scripts(workers, tmp_path, how):
    """Both ranks are inside the call (each wrote its file) when the stacks are taken; then the call ends."""
    release = str(tmp_path / "release")
    found, thread = _stacks_taken_meanwhile(tmp_path, release)
    if how == "run":
        assert nbddp.run(napping, str(tmp_path), release) == [0, 1]
    else:
        script = tmp_path / "nap.py"
        script.write_text(NAPPING_SCRIPT.format(folder=str(tmp_path), release=release))
        assert [r.exit_code for r in nbddp.run_script(str(script))] == [0, 0]
    thread.join(30)
    stacks = found["stacks"]
    assert found["stacks_s"] < 5
    for entry in stacks:
        assert entry.state == "busy" and "in napping" in entry.text, entry
    if how == "script":
        assert "time.sleep(0.02)" in stacks[0].text, "a script's own lines (its file is on this machine)"


def sigusr1_to_default() -> None:
    """What Lightning's Trainer does as it ends: every signal set back to what ``signal.getsignal`` said before it
    started, SIG_DFL for SIGUSR1 (faulthandler's handler is invisible to Python). SIG_DFL ends a process."""
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)


def napping_after_reset(folder: str, release: str) -> int:
    sigusr1_to_default()
    return napping(folder, release)


@pytest.mark.faults
@pytest.mark.parametrize("where", ["in the call", "in an earlier call"])
def test_stacks_never_end_a_rank_whose_code_set_sigusr1_back_to_its_default(workers, tmp_path, where):
    """nbddp.stacks() signals a busy rank with SIGUSR1. After the person's code set SIGUSR1 back to its default
    (Lightning's Trainer does, as it ends), the rank gets its handler back (at the next task, or from its monitor
    within a beat) before the kernel signals it: both ranks answer with their stacks and none is replaced."""
    before = [p.pid for p in workers.placements]
    release = str(tmp_path / "release")
    if where == "in an earlier call":
        nbddp.run(sigusr1_to_default)
    found, thread = _stacks_taken_meanwhile(tmp_path, release)
    call = napping_after_reset if where == "in the call" else napping
    assert nbddp.run(call, str(tmp_path), release) == [0, 1]
    thread.join(30)
    for entry in found["stacks"]:
        assert entry.state == "busy" and "in napping" in entry.text, entry
    assert [p.pid for p in workers.placements] == before  # no rank ended (and was replaced)
    assert nbddp.run(rank) == [0, 1]


def test_catches_signal_reads_whether_a_handler_is_installed_now():
    """The kernel's check before SIGUSR1 (no engine): a process with faulthandler's handler catches it, one whose
    handler was set back to the default does not (and is not signalled once the wait for its monitor is over),
    and a process that is gone gives no answer (signalled as before: where /proc cannot say)."""
    from nbddp.execution.rank_stacks import _catches
    from nbddp.protocol.host import catches_signal

    code = ("import faulthandler, signal, sys\nfaulthandler.register(signal.SIGUSR1)\nprint('set', flush=True)\n"
            "sys.stdin.readline()\nsignal.signal(signal.SIGUSR1, signal.SIG_DFL)\nprint('reset', flush=True)\n"
            "sys.stdin.readline()\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "set\n"
        assert catches_signal(child.pid, signal.SIGUSR1) is True and _catches(child.pid, time.monotonic())
        assert catches_signal(child.pid, signal.SIGUSR2) is False
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline() == "reset\n"
        assert catches_signal(child.pid, signal.SIGUSR1) is False
        t0 = time.monotonic()
        assert not _catches(child.pid, t0 + 0.2) and time.monotonic() - t0 >= 0.2  # waited, then gave up
        child.stdin.write("\n")
        child.stdin.flush()
        child.wait(10)
        assert catches_signal(child.pid, signal.SIGUSR1) is None and _catches(child.pid, time.monotonic())
    finally:
        child.kill()
        child.wait()


# --------------------------------------------------------------------------- a dead controller


def _kill_controller(session) -> list[int]:
    """SIGKILL this session's controller and the scheduler processes it started (only those); return every pid."""
    controller = session.workers.cluster.controller.process.pid
    helpers = [p.pid for p in psutil.Process(controller).children(recursive=True)]
    for pid in [controller, *helpers]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return [controller, *helpers]


def _engine_pids(session) -> list[int]:
    engines = [p.pid for p in session.placements]
    return engines + [c.pid for pid in engines for c in psutil.Process(pid).children(recursive=True)]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:  # also when it exits between the look-up and the status
        return False


def _gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in pids if _alive(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


@pytest.mark.faults
def test_a_controller_that_dies_during_a_fit_fails_it_within_seconds_and_restart_recovers(workers):
    engines = _engine_pids(workers)
    x, y = regression_data(4096)
    handle = nbddp.dist_fit(Net(delay=0.01), (x, y), epochs=20, batch_size=8, live=False, block=False)
    _wait_for(lambda: handle.history.steps, what="training")
    killed = _kill_controller(workers)
    t_kill = time.monotonic()
    with pytest.raises(ClusterError, match=r"the ipyparallel controller \(pid \d+\) has exited while dist_fit ran.*"
                                           r"engines this kernel started were stopped.*nbddp\.restart\(\)"):
        handle.wait(timeout=60)
    reported = time.monotonic() - t_kill
    assert reported < 10, f"the dead controller was reported {reported:.1f} s after it died"
    assert _gone(engines, 10) == [], "our engines outlived their controller"
    t0 = time.monotonic()
    with pytest.raises(ClusterError, match=r"controller \(pid \d+\) has exited, so the workers cannot be reached.*"
                                           r"nbddp\.restart\(\)"):
        nbddp.run(os.getpid)
    next_call = time.monotonic() - t0
    assert next_call < 5
    with pytest.raises(ClusterError, match=r"has exited, so the workers cannot be asked for their stacks.*restart"):
        nbddp.stacks()
    restart_s = _restart_and_fit(workers)
    assert _gone(engines + killed, 10) == [], "a process of the old cluster was left behind"
    record_time("controller killed during a fit", report_s=reported, next_call_s=next_call, restart_s=restart_s)


@pytest.mark.faults
def test_a_controller_that_died_between_calls_is_named_at_the_next_call(workers):
    engines = _engine_pids(workers)
    killed = _kill_controller(workers)
    t0 = time.monotonic()
    with pytest.raises(ClusterError, match=r"controller .* (has exited|does not answer).*nbddp\.restart\(\)"):
        nbddp.dist_fit(Net(), regression_data(), batch_size=16, max_steps=2, live=False)
    next_call = time.monotonic() - t0
    assert next_call < 5, f"the next call took {next_call:.1f} s to fail"
    restart_s = _restart_and_fit(workers)
    assert _gone(engines + killed, 10) == [], "a process of the old cluster was left behind"
    record_time("controller killed between calls", next_call_s=next_call, restart_s=restart_s)


def _restart_and_fit(session) -> float:
    t0 = time.monotonic()
    nbddp.restart()
    restart_s = time.monotonic() - t0
    assert restart_s < 90, f"restart took {restart_s:.1f} s"
    good_fit()
    assert session.world_size == 2
    return restart_s


# --------------------------------------------------------------------------- units (no workers)


def _beat(rank: int, seq: int, progress: int, phase: str, micro: int = 1, step: int = 0, step_time_s: float = 0.0):
    from nbddp.protocol.messages import Beat

    return Beat(rank=rank, seq=seq, progress=progress, phase=phase, step=step, micro=micro, step_time_s=step_time_s,
                idle_s=0.0, stack=f'  File "x.py", line 1, in {phase}_here\n')


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_a_rank_is_stalled_after_10_s_without_progress_while_another_is_ahead():
    clock = Clock()
    watch = stalls.StallWatch([0, 1], clock=clock)
    watch.feed(0, _beat(0, 1, 5, "backward", micro=3))
    watch.feed(1, _beat(1, 1, 4, "data", micro=3))
    clock.now += 9.9
    assert watch.stalled() == []
    clock.now += 0.2
    found = watch.stalled()
    assert [(s["rank"], s["phase"], s["micro"]) for s in found] == [(1, "data", 3)]  # rank 0 only waits for it
    assert found[0]["idle_s"] == pytest.approx(10.1) and "data_here" in found[0]["stack"]
    watch.feed(1, _beat(1, 2, 5, "forward", micro=3))  # it moved: no longer stalled
    assert watch.stalled() == []
    watch.feed(1, _beat(1, 3, 5, "forward", micro=3))  # a new beat, same progress: the clock keeps running
    clock.now += 10.5
    assert [s["rank"] for s in watch.stalled()] == [1]


def test_the_stall_threshold_is_ten_step_times_for_slow_steps():
    clock = Clock()
    watch = stalls.StallWatch([0, 1], clock=clock)
    watch.feed(0, _beat(0, 1, 9, "collective", micro=2, step_time_s=3.0))
    watch.feed(1, _beat(1, 1, 7, "forward", micro=2, step_time_s=3.0))
    clock.now += 29
    assert watch.stalled() == []
    clock.now += 2
    assert [s["rank"] for s in watch.stalled()] == [1]
    assert [s["rank"] for s in watch.stalled(threshold=5.0)] == [1]  # stall_timeout overrides it


def test_when_every_rank_is_stuck_at_the_same_place_all_are_shown_in_a_fit_not_in_a_cell():
    clock = Clock()
    watch = stalls.StallWatch([0, 1], clock=clock)
    for r in (0, 1):
        watch.feed(r, _beat(r, 1, 3, "data", micro=2))
    clock.now += 11
    assert [s["rank"] for s in watch.stalled()] == [0, 1]
    assert watch.stalled(all_quiet=False) == []  # two cells sleeping alike wait for nobody


def test_in_a_cell_a_finished_rank_or_one_in_a_collective_is_ahead():
    clock = Clock()
    watch = stalls.StallWatch([0, 1], clock=clock)
    watch.feed(0, _beat(0, 1, 1, "collective", micro=0))
    watch.feed(1, _beat(1, 1, 1, "cell", micro=0))
    clock.now += 11
    assert [s["rank"] for s in watch.stalled(all_quiet=False)] == [1]
    watch.finish(1)
    assert [(s["rank"], s["phase"]) for s in watch.stalled(all_quiet=False)] == [(0, "collective")]
    assert [p["phase"] for p in watch.positions()] == ["collective", "done"]


def test_faulthandlers_dump_gives_the_main_threads_task_frames():
    from nbddp.execution.rank_stacks import main_thread_text

    dump = ('Thread 0x00007f0000000002 (most recent call first):\n'
            '  File "/lib/threading.py", line 320 in wait\n\n'
            'Current thread 0x00007f0000000001 (most recent call first):\n'
            '  File "/x/data.py", line 12 in __getitem__\n'
            '  File "/x/loop.py", line 40 in run_epoch\n'
            '  File "<string>", line 1 in <module>\n'
            '  File "/venv/site-packages/ipyparallel/engine/kernel.py", line 157 in do_apply\n'
            '  File "/venv/site-packages/ipykernel/kernelbase.py", line 506 in dispatch_shell\n')
    text = main_thread_text(dump, 0x7F0000000001)
    assert text == ('  File "/x/loop.py", line 40, in run_epoch\n'
                    '  File "/x/data.py", line 12, in __getitem__\n')
    assert "threading.py" in main_thread_text(dump, 0x7F0000000002)


def test_the_monitor_samples_a_stack_that_changes_only_when_the_code_moves():
    from nbddp.worker.engine import heartbeat as monitor

    def here(line: int = 0):
        frames = monitor.user_frames(sys._getframe())
        return frames, monitor.stack_signature(frames)

    frames, first = here()
    _, second = here()
    assert first[1:] != second[1:], "called from two lines: the code moved"
    assert first[0] == second[0] == (frames[0].f_code.co_filename, "here"), "the innermost frame keeps no line"
    assert here(1)[1] == here(2)[1], "the same call site: no progress"
    assert not monitor.in_collective(frames)


def test_a_step_time_does_not_count_the_set_up():
    from nbddp.worker.engine.heartbeat import Heartbeat

    beat = Heartbeat()
    beat.reset("setup")
    time.sleep(0.3)  # set-up
    beat.micro_batch()
    beat.step_done(1)
    assert beat.step_time_s < 0.2 and beat.step == 1 and beat.phase == "optimizer" and beat.micro == 1


def test_the_stacks_answer_is_labelled_by_rank_and_says_what_it_lacks():
    from nbddp.monitor.stacks import RankStack, RankStacks

    answer = RankStacks([RankStack(1, "h", 11, "idle", "", "idle"),
                         RankStack(0, "h", 10, "busy", '  File "/t/distributed_c10d.py", line 3, in all_reduce\n',
                                   "faulthandler")], 0.1)
    assert [e.rank for e in answer] == [0, 1] and len(answer) == 2
    assert repr(answer).startswith("rank 0 (pid 10 on h): busy, waiting in a collective\n")
    assert "rank 1 (pid 11 on h): idle\n  (no task running)" in repr(answer)
    with pytest.raises(KeyError, match=r"no rank 5; the stacks are of ranks \[0, 1\]"):
        answer[5]


def test_stacks_needs_workers_and_a_positive_timeout(monkeypatch):
    from nbddp.session import session as session_mod
    from nbddp.session.session import Session

    import nbddp.monitor.stacks  # noqa: F401 - a submodule named like the function would shadow it

    assert callable(nbddp.stacks)
    with pytest.raises(ValueError, match=r"stacks\(timeout=\.\.\.\) is in seconds and must be > 0, got 0"):
        nbddp.stacks(timeout=0)
    monkeypatch.setattr(session_mod, "_SESSION", Session())
    with pytest.raises(NotStartedError, match=r"no workers are running, so there are no stacks"):
        nbddp.stacks()


def test_the_views_show_each_ranks_position_and_the_stalled_ranks_frames():
    from nbddp.fit.history import History
    from nbddp.live.state import LiveState
    from nbddp.live.text import progress_line
    from nbddp.live.widget import rank_table_html, rank_rows, stalls_html
    from nbddp.protocol.messages import RankInfo

    state = LiveState(status="training", world_size=2, placements=[RankInfo(0, "a", "cpu", 1),
                                                                    RankInfo(1, "b", "cpu", 2)])
    state.positions = [{"rank": 0, "phase": "backward", "step": 4, "micro": 5, "idle_s": 12.0},
                       {"rank": 1, "phase": "data", "step": 4, "micro": 5, "idle_s": 12.0}]
    state.stalled = [{"rank": 1, "phase": "data", "step": 4, "micro": 5, "idle_s": 12.4,
                      "stack": '  File "a.py", line 1, in f\n  File "d.py", line 9, in __getitem__\n    sleep()\n'}]
    run = SimpleNamespace(live_state=state, history=History(world_size=2), finished=False, started_at=None)
    line = progress_line(run)
    assert "ranks 0: step 4 backward · 1: step 4 data, stalled 12 s" in line
    table = rank_table_html(rank_rows(run))
    assert "step 4 · backward" in table and "stalled 12 s" in table
    box = stalls_html(state)
    assert "rank 1 stalled 12 s in data (step 4, micro-batch 5)" in box and "__getitem__" in box


def test_a_worker_stalled_error_names_the_rank_and_shows_the_stacks():
    from nbddp.protocol.errors import RankFailure

    failure = RankFailure(1, "WorkerStalled", "made no progress for 12 s in data; stall_timeout=10 s",
                          '  File "d.py", line 9, in __getitem__\n', pid=7, host="h")
    err = WorkerStalled(failure, [1], {1: failure.remote_traceback, 0: '  File "l.py", line 3, in backward\n'},
                        note="rank(s) 0, 1 were killed")
    assert str(err).startswith("rank 1 (pid 7 on h): WorkerStalled: made no progress for 12 s in data")
    assert "rank 1 is here (innermost frames):\n  File \"d.py\"" in str(err)
    rendered = _render(err)
    assert rendered.index("stack of rank 1 (stalled)") < rendered.index("stack of rank 0 (waiting)")


def _render(err: WorkerError) -> str:
    return "\n".join(err._render_traceback_())
