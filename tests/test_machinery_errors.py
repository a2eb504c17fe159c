"""The errors of the machinery itself: clusters that do not start, heals that fail, stale engines.

These paths are hard to reach with real processes (a controller that will not
start, a heal that fails), so each test drives the one function that raises
with a stand-in for what it talks to, and checks the message a person reads.
The one case that needs real workers (changing the timeout during a fit)
uses the shared ones.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

import nbddp
from nbddp.cluster.engines import ClusterError, Workers
from nbddp.protocol.errors import FitRunningError, NotStartedError
from nbddp.session.session import Session
from nbddp.session.start_options import validate_start
from nbddp.worker.training import loop
from nbddp.worker.engine.rank_state import STATE, check_generation

pytestmark = pytest.mark.timeout(120)


class _BrokenCluster:
    """An ipyparallel.Cluster whose controller fails to start."""

    controller = None
    n = 2

    def __init__(self):
        self.stopped = False

    def start_controller_sync(self):
        raise OSError("no free port for the controller")

    def stop_cluster_sync(self):
        self.stopped = True


def test_a_cluster_that_cannot_start_says_why_and_is_stopped():
    cluster = _BrokenCluster()
    with pytest.raises(ClusterError, match=r"could not start 2 engine\(s\): OSError: no free port for the controller"):
        Workers.start(2, cluster=cluster)
    assert cluster.stopped


def test_engines_that_do_not_register_in_time_are_named():
    workers = Workers(cluster=None, client=SimpleNamespace(ids=[0]), owned=True, can_add_engines=True)
    t0 = time.monotonic()
    with pytest.raises(ClusterError, match=r"only 1 of 2 engines registered within 0 s; the machine may be overloaded"):
        workers.wait_for(2, timeout=0.2)
    assert time.monotonic() - t0 < 5


def test_an_attached_cluster_cannot_get_new_engines_from_nbddp():
    workers = Workers(cluster=None, client=SimpleNamespace(ids=[0]), owned=False, can_add_engines=False)
    with pytest.raises(ClusterError, match=r"1 engine\(s\) of this attached cluster died .*ipcluster engines -n 1.*nbddp\.restart\(\)"):
        workers.add_engines(1, 2)


def test_more_nccl_workers_than_gpus_is_refused_before_starting():
    with pytest.raises(ValueError, match=r"start\(n=3\) asks for more workers than the 2 visible GPU\(s\).*n<=2, or backend='gloo'"):
        validate_start(3, "nccl", None, None, gpus=2, attach=False)
    assert validate_start(3, "gloo", None, None, gpus=2, attach=False)[0] == 3  # extra CPU workers are fine


def test_restart_and_ready_checks_on_a_session_that_never_started():
    s = Session()
    with pytest.raises(NotStartedError, match=r"nothing to restart: no workers were started in this kernel"):
        s.restart()
    with pytest.raises(NotStartedError, match=r"no workers are running; call nbddp\.start\(\) \(or %ddp start\) first"):
        s.ensure_ready()


def test_a_failed_heal_is_reported_at_the_next_use():
    s = Session()
    s.workers = SimpleNamespace(controller_problem=lambda: None, job_problem=lambda: None)  # "started", for ensure_ready
    s.group = SimpleNamespace(generation=1, placements=(), world_size=0)

    def failing_heal(killed, job_wait=None):
        raise RuntimeError("engine 3 did not register")

    s.supervisor._heal = failing_heal
    s.supervisor.recover([3])
    with s.lock:
        with pytest.raises(ClusterError, match=r"replacing failed workers did not work: RuntimeError: engine 3 did not "
                                               r"register\. Run nbddp\.restart\(\)") as info:
            s.ensure_ready()
        assert isinstance(info.value.__cause__, RuntimeError)
        s.ensure_ready()  # reported once: the next call goes ahead


def test_a_task_for_another_generation_is_refused_on_the_worker(monkeypatch):
    monkeypatch.setattr(STATE, "generation", 4)
    check_generation(4)
    with pytest.raises(RuntimeError, match=r"this engine joined process-group generation 4, the kernel expected 5; run nbddp\.restart\(\)"):
        check_generation(5)


def test_a_rank_whose_peer_failed_raises_peer_failed(monkeypatch):
    def other_rank_failed(flag, group=None):
        flag += 1.0

    monkeypatch.setattr(loop.dist, "all_reduce", other_rank_failed)
    with pytest.raises(loop.PeerFailed, match=r"another rank failed during setup"):
        loop.agree(None, torch.device("cpu"), "setup")
    with pytest.raises(KeyError):  # the failing rank raises its own error, not PeerFailed
        loop.agree(KeyError("x"), torch.device("cpu"), "setup")


def test_the_timeout_cannot_change_while_a_fit_runs(workers):
    x = torch.randn(4096, 8)
    handle = nbddp.dist_fit(torch.nn.Linear(8, 1), (x, x[:, :1]), epochs=50, batch_size=8, live=False, block=False)
    try:
        with pytest.raises(FitRunningError, match=r"cannot change the process-group timeout while .* runs; wait for it or stop it first"):
            nbddp.start(n=2, backend="gloo", timeout=workers.options.timeout + 60)
    finally:
        handle.stop()
        handle.wait()
    assert workers.running is None
