"""The fault contract (docs/faults.md, issue 4), one test per behaviour, on 2 CPU gloo workers.

Each test asserts the stated bound, then that the next fit works with no
action from the person. Measured times go to ``faultkit.TIMES_FILE``.
"""

from __future__ import annotations

import copy
import os
import signal
import threading
import time

import sys

import cloudpickle
import psutil
import pytest
import torch

import nbddp
from interrupts import interrupt_when
from faultkit import (CountingStep, FailingData, FailingLoss, FailingMetric, Net, engine_pids, good_fit, mark,
                      read_mark, record_time, regression_data)
from nbddp.protocol.errors import WorkerDied, WorkerError

pytestmark = [pytest.mark.timeout(240), pytest.mark.faults]
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _recover(session, fault: str, t_error: float, **measured: float) -> None:
    """Wait for the heal, run the next fit, record the times."""
    t0 = time.perf_counter()
    session.wait_healed(raise_error=True)
    healed = time.perf_counter() - t0
    h, fit_s = good_fit()
    assert session.world_size == 2 and h.world_size == 2
    record_time(fault, heal_s=healed, next_fit_s=fit_s, recovered_s=time.time() - t_error, **measured)


# --------------------------------------------------------------------------- row 1: a rank raises


def _failing_call(where: str, marker: str) -> dict:
    x, y = regression_data()
    if where == "model":
        return dict(model=Net(fail=(1, 3, "raise", marker)), data=(x, y))
    if where == "loss":
        return dict(model=Net(), data=(x, y), loss_fn=FailingLoss(1, 3, marker))
    if where == "data pipeline":
        return dict(model=Net(), data=FailingData(x, y, 1, 40, marker))
    if where == "metric":
        return dict(model=Net(), data=(x, y), val_data=(x[:64], y[:64]), metrics={"mae": FailingMetric(1, marker)})
    raise AssertionError(where)


@pytest.mark.parametrize("where", ["model", "loss", "data pipeline", "metric"])
def test_rank_raises_reports_within_5s_and_next_fit_works(workers, tmp_path, where):
    marker = str(tmp_path / "raised")
    call = _failing_call(where, marker)
    with pytest.raises(WorkerError) as info:
        nbddp.dist_fit(call.pop("model"), call.pop("data"), batch_size=16, epochs=1, live=False, **call)
    t_error = time.time()
    err = info.value
    reported = t_error - read_mark(marker, timeout=1)
    assert reported < 5.0, f"the error came {reported:.1f} s after the rank raised"
    assert not isinstance(err, WorkerDied)
    assert err.rank == 1 and err.exc_type == "ValueError"
    assert f"boom in the {where} on rank 1" in err.message
    assert str(err).startswith("rank 1 (pid ") and f"ValueError: boom in the {where}" in str(err)
    assert "ValueError" in err.remote_traceback and "boom" in err.remote_traceback
    rendered = "\n".join(err._render_traceback_())
    assert "remote traceback (rank 1)" in rendered and "boom" in rendered
    assert all(o.exc_type != "PeerFailed" for o in err.others), "PeerFailed is never listed"
    _recover(workers, f"rank raises in {where}", t_error, report_s=reported)


def test_several_ranks_fail_first_is_headline_others_listed(workers, tmp_path):
    marker = str(tmp_path / "raised")
    # an engine's first remote traceback is slow to format (imports): warm both up, so the
    # finishing order the kernel sees is the order the ranks raised in
    with pytest.raises(WorkerError):
        nbddp.run(_raise_everywhere)
    workers.wait_healed(raise_error=True)
    with pytest.raises(WorkerError) as info:
        nbddp.dist_fit(Net(fail=((0, 1), 3, "raise", marker)), regression_data(), batch_size=16, live=False)
    t_error = time.time()
    err = info.value
    assert err.rank == 1, f"rank 1 failed 0.5 s before rank 0, so it is the headline: {err}"
    assert [o.rank for o in err.others] == [0] and err.others[0].exc_type == "ValueError"
    assert "also failed: rank 0" in str(err)
    _recover(workers, "two ranks raise", t_error)


# --------------------------------------------------------------------------- row 2: a worker dies


@pytest.mark.parametrize("how", ["SIGKILL by pid", "os._exit", "segfault"])
def test_worker_death_reported_within_10s_and_replaced(workers, tmp_path, how):
    marker = str(tmp_path / "dying")
    victim = workers.placements[1]
    nanny = [c.pid for c in psutil.Process(victim.pid).children()]
    action = {"SIGKILL by pid": "mark", "os._exit": "exit", "segfault": "segfault"}[how]
    killer = None
    if how == "SIGKILL by pid":
        def _kill() -> None:
            read_mark(marker, timeout=120)
            os.kill(victim.pid, signal.SIGKILL)  # a real engine process, by pid
        killer = threading.Thread(target=_kill, daemon=True)
        killer.start()
    # rank 1 marks at its 3rd step, then keeps training slowly so the kill lands mid-fit
    model = Net(fail=(1, 3, action, marker), delay=0.05)
    with pytest.raises(WorkerDied) as info:
        nbddp.dist_fit(model, regression_data(), batch_size=16, epochs=2, live=False)
    t_error = time.time()
    err = info.value
    reported = t_error - read_mark(marker, timeout=1)
    assert reported < 10.0, f"the death was reported {reported:.1f} s after it happened"
    assert err.rank == 1 and err.pid == victim.pid
    expected = {"SIGKILL by pid": "SIGKILL", "os._exit": "exited with status 3", "segfault": "SIGSEGV"}[how]
    assert expected in err.how and expected in str(err), str(err)
    assert f"pid {victim.pid}" in str(err)
    assert "IPEngine" in err.log_tail and "engine log" in str(err), str(err)
    _recover(workers, f"worker dies ({how})", t_error, report_s=reported)
    assert victim.pid not in engine_pids(workers)
    gone, alive = psutil.wait_procs([psutil.Process(p) for p in nanny if psutil.pid_exists(p)], timeout=10)
    assert not alive, f"the dead engine's nanny {alive} outlived it"


# --------------------------------------------------------------------------- row 3: interrupt


def _rank0_ran(marker_dir: str, steps: int):
    """A condition for ``interrupt_when``: rank 0's step counter in ``marker_dir`` reached ``steps``."""
    path = os.path.join(marker_dir, "rank0")

    def reached() -> bool:
        try:
            return os.path.exists(path) and float(open(path).read()) >= steps
        except ValueError:  # caught mid-write
            return False
    return reached


def test_interrupt_stops_every_rank_at_the_same_step(workers, tmp_path):
    torch.manual_seed(1)
    model = Net()
    initial = copy.deepcopy(model)
    step_s = 0.05
    times: list[float] = []
    # the stop is clean, then KeyboardInterrupt reaches the cell so that Run All stops (Keras and HF re-raise)
    with interrupt_when(_rank0_ran(str(tmp_path), 10), timeout=120, on_signal=lambda i: times.append(time.time())), \
            pytest.raises(KeyboardInterrupt, match=r"every rank stopped at step \d+ and the model holds") as caught:
        nbddp.dist_fit(model, regression_data(), batch_size=16, epochs=20, shuffle=False,
                       step_fn=CountingStep(str(tmp_path), delay=step_s), live=False)
    stopped = time.time() - times[0]
    h = caught.value.history
    assert h is nbddp.last_history() and h.status == "interrupted"
    counts = [int(read_mark(str(tmp_path / f"rank{r}"))) for r in (0, 1)]
    assert counts[0] == counts[1], f"ranks stopped at different steps: {counts}"
    assert h.steps[-1]["step"] == counts[0]
    assert stopped < 2.0 + step_s + 3.0, f"stopping took {stopped:.1f} s"
    # the model holds the weights of that step: the same fit cut at that step gives them
    again_dir = tmp_path / "again"
    again_dir.mkdir()
    t0 = time.perf_counter()
    again = nbddp.dist_fit(initial, regression_data(), batch_size=16, epochs=20, shuffle=False,
                           max_steps=counts[0], step_fn=CountingStep(str(again_dir)), live=False)
    next_fit = time.perf_counter() - t0
    assert again.status == "completed" and again.steps[-1]["step"] == counts[0]
    for a, b in zip(model.state_dict().values(), initial.state_dict().values()):
        torch.testing.assert_close(a, b)
    record_time("interrupt", stop_s=stopped, next_fit_s=next_fit, step=counts[0])


def test_interrupt_also_stops_under_torch_elastics_sigint_handler(workers, tmp_path):
    """After accelerate's notebook_launcher ran in the kernel, SIGINT raises elastic's SignalException."""
    from torch.distributed.elastic.multiprocessing.api import _terminate_process_handler

    old = signal.signal(signal.SIGINT, _terminate_process_handler)
    try:
        times: list[float] = []
        with interrupt_when(_rank0_ran(str(tmp_path), 5), timeout=120, on_signal=lambda i: times.append(time.time())), \
                pytest.raises(KeyboardInterrupt) as caught:
            nbddp.dist_fit(Net(), regression_data(), batch_size=16, epochs=20, shuffle=False,
                           step_fn=CountingStep(str(tmp_path), delay=0.05), live=False)
    finally:
        signal.signal(signal.SIGINT, old)
    h = caught.value.history
    assert h.status == "interrupted"
    counts = [int(read_mark(str(tmp_path / f"rank{r}"))) for r in (0, 1)]
    assert counts[0] == counts[1] == h.steps[-1]["step"]


def test_second_interrupt_hard_stops_and_replaces_workers(workers, tmp_path):
    model = Net()
    before = copy.deepcopy(model.state_dict())
    old_pids = engine_pids(workers)
    times: list[float] = []
    # both ranks stall 60 s in Python at step 5: the first interrupt cannot land soon
    with interrupt_when(_rank0_ran(str(tmp_path), 5), times=2, gap=1.0, timeout=120,
                        on_signal=lambda i: times.append(time.time())), \
            pytest.raises(KeyboardInterrupt, match="killed .*second interrupt.*replaced"):
        nbddp.dist_fit(model, regression_data(), batch_size=16, epochs=20,
                       step_fn=CountingStep(str(tmp_path), stall_after=5, stall_s=60), live=False)
    killed = time.time() - times[1]
    assert len(times) == 2
    assert killed < 10.0, f"the hard stop took {killed:.1f} s"
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k])
    t_error = time.time()
    _recover(workers, "second interrupt (hard stop)", t_error, stop_s=killed)
    assert not set(old_pids) & set(engine_pids(workers)), "the workers were not replaced"
    for pid in old_pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


# --------------------------------------------------------------------------- row 5: timeouts


def test_hung_collective_fails_after_the_configured_timeout(workers, tmp_path):
    from nbddp.session.session import DEFAULT_PG_TIMEOUT_S

    assert workers.options.timeout == DEFAULT_PG_TIMEOUT_S <= 600, "the default must report a hang in minutes"
    generation = workers.generation
    nbddp.start(n=2, backend="gloo", timeout=3)  # same engines, new group with a 3 s timeout
    try:
        assert workers.options.timeout == 3 and workers.generation == generation + 1
        marker = str(tmp_path / "hang")
        # rank 1 hangs in Python (never joins the all-reduce); rank 0 waits in a real collective
        with pytest.raises(WorkerError) as info:
            nbddp.run(_hang_on_rank1, marker)
        t_error = time.time()
        waited = t_error - read_mark(marker, timeout=1)
        err = info.value
        assert err.rank == 0 and ("timed out" in str(err).lower() or "timeout" in str(err).lower()), str(err)
        assert 2.5 < waited < 3 + 10, f"reported after {waited:.1f} s with a 3 s timeout"
        assert "rank(s) 1 were stuck" in str(err)
    finally:
        # back to the default (a 3 s timeout is too short for a fresh engine's first fit here)
        nbddp.start(n=2, backend="gloo", timeout=DEFAULT_PG_TIMEOUT_S)
    assert workers.options.timeout == DEFAULT_PG_TIMEOUT_S
    _recover(workers, "hung collective (timeout=3 s)", t_error, report_s=waited)
    assert nbddp.run(_all_reduce_one) == [2.0, 2.0]


def test_timeout_must_be_positive(workers):
    with pytest.raises(ValueError, match=r"start\(timeout=...\) .* must be > 0, got -1"):
        nbddp.start(n=2, backend="gloo", timeout=-1)
    with pytest.raises(ValueError, match=r"must be > 0, got 'soon'"):
        nbddp.start(n=2, backend="gloo", timeout="soon")


def _hang_on_rank1(marker: str) -> float:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(120)
    t = torch.ones(1)
    mark(marker)
    dist.all_reduce(t)
    return float(t)


def _all_reduce_one() -> float:
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return float(t)


def _raise_everywhere() -> None:
    raise RuntimeError("warm-up failure")
