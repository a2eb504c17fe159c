"""One owner for killing and healing: stop() never starts engines; a heal holds the session's lock.

Plus the new pre-start version check and the small raises of the Python twins of the magics.
"""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch

import nbddp
from faultkit import Net, regression_data
from nbddp.cluster.engines import Workers
from nbddp.protocol.errors import ClusterError
from nbddp.session.process_group import check_versions
from nbddp.protocol.placement import Probe

pytestmark = pytest.mark.timeout(240)


@pytest.mark.faults
def test_a_heal_holds_the_lock_and_callers_wait_for_it(workers):
    """While the heal thread rebuilds, a caller that needs the workers waits, then sees the new generation."""
    before = workers.generation
    workers.supervisor.recover([])  # a heal with nothing killed: ping, then form the group again
    assert workers.supervisor.healing
    with workers.lock:  # ensure_ready gives the lock to the heal while it waits
        workers.ensure_ready()
        assert not workers.supervisor.healing and workers.generation == before + 1
    assert nbddp.run(lambda: torch.distributed.get_world_size()) == [2, 2]


@pytest.mark.faults
def test_status_is_one_generation_even_during_a_heal(workers):
    snapshots = []
    workers.supervisor.recover([])
    while workers.supervisor.healing:
        snapshots.append(nbddp.status())
        time.sleep(0.01)
    snapshots.append(nbddp.status())
    for st in snapshots:
        assert st["world_size"] == len(st["ranks"]) == 2
    assert snapshots[-1]["healing"] is False


@pytest.mark.faults
def test_an_engine_known_dead_is_unregistered_at_once_not_after_ten_missed_heartbeats(workers):
    """A frozen engine (SIGSTOP: alive to its nanny, its heartbeats stopped) that nbddp knows is lost leaves the
    client's list within seconds of ``forget_dead``; the controller alone drops it after ten missed 1 s heartbeats.
    This wait was 10 s of a lost Slurm job's recovery."""
    import os
    import signal

    victim = workers.placements[1]
    os.kill(victim.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        workers.workers.forget_dead([victim.engine_id], timeout=9.0)
        took = time.monotonic() - t0
        assert victim.engine_id not in workers.workers.client.ids, "still registered after 9 s"
        assert took < 5.0, f"took {took:.1f} s: the controller's heartbeats dropped it, not the request"
    finally:
        os.kill(victim.pid, signal.SIGKILL)
    workers.supervisor.recover([victim.engine_id])
    workers.wait_healed(raise_error=True)
    assert nbddp.status()["world_size"] == 2


def _probe(engine_id: int, python: str, torch_version: str) -> Probe:
    return Probe(engine_id=engine_id, host=f"h{engine_id}", pid=100 + engine_id, address="127.0.0.1",
                 python=python, torch_version=torch_version)


def test_workers_with_another_python_or_torch_are_refused_naming_both():
    import sys

    here_py, here_torch = sys.version.split()[0], torch.__version__
    check_versions([_probe(0, here_py, here_torch), _probe(1, here_py, here_torch.split("+")[0] + "+cu124")])
    with pytest.raises(ClusterError, match=rf"other versions than this kernel \(Python {here_py}, torch "
                                           rf"{re.escape(here_torch)}\): engine 1 on h1: Python 3\.9\.1, torch 2\.0\.0\..*same "
                                           r"Python minor version and torch release"):
        check_versions([_probe(0, here_py, here_torch), _probe(1, "3.9.1", "2.0.0")])


def test_the_python_twins_of_the_magics_check_their_arguments(workers):
    with pytest.raises(TypeError, match=r"run_cell\(code=\.\.\.\) takes the cell's source as a str, got int"):
        nbddp.run_cell(3)
    with pytest.raises(ValueError, match=r"ranks=\[0, 5\]: no rank 5; the workers have ranks 0\.\.1"):
        nbddp.run_cell("x = 1", ranks=[0, 5])
    with pytest.raises(TypeError, match=r"push\(\) needs at least one name=value pair"):
        nbddp.push()
    with pytest.raises(TypeError, match=r"pull\(\) takes the variable names as strings"):
        nbddp.pull(3)
    nbddp.push(answer=41)
    nbddp.run_cell("answer += rank + 1")
    assert nbddp.pull("answer", rank=1) == {"answer": 43}


def test_an_unknown_strategy_on_a_worker_is_named():
    from nbddp.worker.strategies import make_strategy

    with pytest.raises(ValueError, match=r"unknown strategy 'pipeline'"):
        make_strategy("pipeline", torch.device("cpu"))


# ---- stop(): last in the file. Each stops the suite's workers, so the next test that needs them starts them
# again (7 CPU-seconds): here that is only the second of these two


@pytest.mark.faults
def test_a_stop_cancels_a_heal_before_it_starts_engines(workers, monkeypatch):
    """stop() while a heal waits to replace engines: the heal ends without starting any."""
    started = []
    gate = threading.Event()

    def slow_ping_then_add(self, count, total, timeout=120.0):
        started.append(count)

    monkeypatch.setattr(Workers, "add_engines", slow_ping_then_add)
    real_forget = Workers.forget_dead

    def forget_then_wait(self, engine_ids, timeout=10.0):
        real_forget(self, engine_ids, timeout)
        gate.wait(10)

    monkeypatch.setattr(Workers, "forget_dead", forget_then_wait)
    victim = workers.placements[1]
    killed = workers.supervisor.kill_ranks([victim.rank])
    workers.supervisor.recover(killed)
    stopper = threading.Thread(target=nbddp.stop)
    stopper.start()
    time.sleep(0.2)
    gate.set()
    stopper.join(60)
    assert not stopper.is_alive() and started == [] and not workers.started


@pytest.mark.faults
@pytest.mark.fresh_workers
def test_stop_during_a_fit_kills_and_never_starts_replacements(workers, monkeypatch):
    started = []
    real = Workers.add_engines

    def recording(self, count, total, timeout=120.0):
        started.append(count)
        return real(self, count, total, timeout)

    monkeypatch.setattr(Workers, "add_engines", recording)
    x, y = regression_data(4096)
    handle = nbddp.dist_fit(Net(), (x, y), epochs=100, batch_size=8, live=False, block=False)
    deadline = time.monotonic() + 60
    while not handle.history.steps and time.monotonic() < deadline:
        time.sleep(0.05)
    nbddp.stop()
    assert handle.done()
    with pytest.raises(KeyboardInterrupt, match=r"training was killed \(nbddp.stop\(\) was called\)"):
        handle.wait()
    assert started == [], "stop() started replacement engines"
    assert not workers.supervisor.healing and not workers.started
