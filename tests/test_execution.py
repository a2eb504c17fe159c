"""The execution package's decisions, with fake ranks: what became of each rank, which failure is the headline, the
grace and the kill of stuck peers, what the failure policy retries, and where tasks are sent.

No engine starts here: each rank is a stand-in for ipyparallel's ``AsyncResult`` (ready or not, a value or the
error ``get`` raises), and the session is the ``SessionLike`` the package asks for (``nbddp/execution/contracts.py``).
The same decisions on real engines are in test_faults.py, test_hangs.py and test_sweeps.py.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from ipyparallel.error import EngineError, RemoteError

from nbddp.execution import outcome, send
from nbddp.execution.calls import RankCall, UnknownRanks, placements_for
from nbddp.execution.outcome import Kind
from nbddp.execution.policy import GRACE_S, RESTART_GRACE_S, FailurePolicy, Verdict
from nbddp.execution.rank_tasks import RankTasks
from nbddp.protocol.errors import RankFailure, WorkerDied, WorkerError, WorkerStalled
from nbddp.protocol.placement import Placement


class Task:
    """A rank's ``AsyncResult``: pending until ``end`` is called, then its value or its error."""

    def __init__(self, value=None, error: BaseException | None = None, done: bool = True, raised_at: float = 0.0):
        self.value, self.error, self.done = value, error, done
        self.metadata = {}
        self.data = {"nbddp-raised": raised_at} if raised_at else {}

    def ready(self) -> bool:
        return self.done

    def get(self, timeout: float = 0):
        if self.error is not None:
            raise self.error
        return self.value

    def wait(self, timeout: float) -> None:
        time.sleep(min(timeout, 0.01))


def place(rank: int) -> Placement:
    return Placement(rank, rank, 4, 4, engine_id=10 + rank, host="here", pid=4000 + rank, device="cpu",
                     address="127.0.0.1", local=True)


class FakeSession:
    """Four ranks on engines 10..13; records what was killed and handed on to be replaced."""

    def __init__(self, world: int = 4):
        self.placements = [place(r) for r in range(world)]
        self.group = SimpleNamespace(placements=self.placements, by_rank=lambda: {p.rank: p for p in self.placements})
        self.killed: list[int] = []
        self.replaced: list[int] = []
        self.supervisor = SimpleNamespace(kill_ranks=self._kill, recover=self.replaced.extend,
                                          replace_ranks=lambda ranks: self.replaced.extend(self._kill(ranks)))
        self.workers = SimpleNamespace(can_add_engines=True, how_died=lambda pid: ("was killed by signal 9 (SIGKILL)",
                                                                                   "the log's last line"),
                                       controller_problem=lambda: None, job_problem=lambda: None)
        self.debugger = SimpleNamespace(paused=lambda: [])
        self.world_size = world
        self.running = None

    def _kill(self, ranks: list[int]) -> list[int]:
        ids = [10 + r for r in ranks]
        self.killed += ids
        return ids


def remote(ename: str, evalue: str = "") -> RemoteError:
    return RemoteError(ename, evalue, f"Traceback (most recent call last):\n{ename}: {evalue}")


# ---------------------------------------------------------------- outcome.py: one rank, and the headline


@pytest.mark.parametrize("error, kind", [
    (EngineError("engine 11 died"), Kind.DIED),
    (remote("EngineError", "relayed by the controller"), Kind.DIED),
    (remote("ValueError", "bad batch"), Kind.RAISED),
    (remote("PeerFailed", "rank 0 failed"), Kind.CONSEQUENCE),
    (remote("RuntimeError", "[gloo] Connection closed by peer [127.0.0.1]:1234"), Kind.CONSEQUENCE),
    (KeyboardInterrupt(), Kind.RAISED),
])
def test_each_way_a_rank_can_fail_is_told_apart(error, kind):
    judged = outcome.judge(1, error, place(1), at=5.0)
    assert judged.kind is kind and judged.failed and judged.failure.rank == 1 and judged.failure.pid == 4001
    assert outcome.engine_died(error) is (kind is Kind.DIED)


def test_the_headline_is_a_death_then_an_own_error_then_a_consequence_then_the_earliest():
    died = outcome.judge(3, EngineError("gone"), place(3), at=9.0)
    own_late = outcome.judge(2, remote("ValueError", "late"), place(2), at=8.0)
    own_early = outcome.judge(1, remote("OSError", "early"), place(1), at=2.0)
    peer = outcome.judge(0, remote("PeerFailed", "a peer failed"), place(0), at=1.0)
    closed = outcome.judge(0, remote("RuntimeError", "Connection reset by peer"), place(0), at=0.5)
    head, others = outcome.headline([peer, own_late, own_early, died])
    assert head is died and others == [own_early, own_late]  # a PeerFailed is never listed
    assert outcome.headline([own_late, own_early, closed])[0] is own_early
    assert outcome.headline([closed, peer])[0] is closed  # nothing but consequences: the earliest that is not PeerFailed
    assert outcome.headline([peer])[0] is peer and outcome.stuck(2).kind is Kind.STUCK


# ---------------------------------------------------------------- rank_tasks.py: the grace, the kill, the error


def test_every_rank_finished_gives_the_results_by_rank():
    s = FakeSession(2)
    tasks = RankTasks(s, {0: Task("a"), 1: Task("b")}, "a cell")
    assert tasks.wait() == {0: "a", 1: "b"} and s.killed == [] and s.replaced == []


def test_a_rank_that_raised_is_the_error_and_a_peer_still_running_after_the_grace_is_killed_as_stuck():
    s = FakeSession(3)
    stuck = Task(done=False)
    tasks = RankTasks(s, {0: Task("ok"), 1: Task(error=remote("ValueError", "bad batch")), 2: stuck}, "%%ddp cell")
    assert not tasks.poll()  # a failure, and a rank still running: the grace begins
    tasks.first_failure_at -= GRACE_S + 0.1
    assert tasks.poll()
    error = tasks.fail()
    assert type(error) is WorkerError and error.rank == 1 and error.exc_type == "ValueError"
    assert "rank(s) 2 were stuck in a collective and were killed" in str(error)
    assert s.killed == [12] and s.replaced == [12]  # the stuck engine, handed to the supervisor to replace
    assert {o.rank: o.kind for o in tasks.ended} == {0: Kind.FINISHED, 1: Kind.RAISED, 2: Kind.STUCK}


def test_a_dead_rank_is_named_with_how_it_died_and_its_engine_is_replaced_by_whoever_takes_the_lost():
    s = FakeSession(2)
    lost: list[int] = []
    tasks = RankTasks(s, {0: Task(error=remote("RuntimeError", "Connection closed by peer")),
                          1: Task(error=EngineError("engine 11 died"))}, "dist_fit", lose=lost.extend)
    with pytest.raises(WorkerDied) as caught:
        tasks.wait()
    assert caught.value.rank == 1 and caught.value.how == "was killed by signal 9 (SIGKILL)"
    assert "the worker process (pid 4001) was killed by signal 9 (SIGKILL)" in str(caught.value)
    assert "a replacement worker is starting" in str(caught.value) and "the log's last line" in str(caught.value)
    assert lost == [11] and s.replaced == []  # a sweep heals later: the lost engines went to `lose`, not the supervisor


def test_on_an_attached_cluster_the_error_says_how_to_start_the_replacement():
    s = FakeSession(2)
    s.workers.can_add_engines = False
    tasks = RankTasks(s, {0: Task("ok"), 1: Task(error=EngineError("gone"))}, "dist_fit")
    assert tasks.poll()
    error = tasks.fail()
    assert "start 1 more with `ipcluster engines -n 1` (same --profile/--cluster-id)" in str(error)


def test_a_result_that_is_a_failure_gives_its_peers_the_grace_then_they_are_killed_and_the_results_returned():
    s = FakeSession(2)
    tasks = RankTasks(s, {0: Task("oom"), 1: Task(done=False)}, "find_batch_size",
                      failed_result=lambda result: result == "oom")
    assert not tasks.poll()
    tasks.first_failure_at -= GRACE_S + 0.1
    assert tasks.wait() == {0: "oom"} and s.replaced == [11]


def test_a_dead_controller_fails_the_wait_within_its_check_naming_the_work():
    s = FakeSession(1)
    s.workers.controller_problem = lambda: "the controller (pid 99) died"
    s.supervisor.controller_lost = lambda problem, what: RuntimeError(f"{problem} while {what} ran")
    tasks = RankTasks(s, {0: Task(done=False)}, "dist_fit")
    tasks._next_check = 0.0
    with pytest.raises(RuntimeError, match=r"the controller \(pid 99\) died while dist_fit ran"):
        tasks.watch()


def test_work_on_fewer_ranks_than_exist_and_an_unknown_rank_is_named():
    s = FakeSession(2)
    assert [p.rank for p in placements_for(s, [1])] == [1] and len(placements_for(s, None)) == 2
    with pytest.raises(UnknownRanks, match=r"ranks=\[0, 5\]: no rank 5; the workers have ranks 0..1"):
        placements_for(s, [0, 5])
    with pytest.raises(RuntimeError, match="a cell was not launched"):
        RankCall(s, "a cell").tasks


# ---------------------------------------------------------------- policy.py: what is retried


def died(rank: int = 1) -> WorkerDied:
    return WorkerDied(RankFailure(rank, "WorkerDied", "died"), "killed by signal 9 (SIGKILL)")


def stalled() -> WorkerStalled:
    return WorkerStalled(RankFailure(1, "WorkerStalled", "made no progress for 9 s"), [1], {})


def test_the_policy_retries_a_death_a_stall_a_consequence_and_what_retry_on_names_up_to_max_restarts():
    policy = FailurePolicy(max_restarts=2, retry_on=(OSError,))
    own = WorkerError(RankFailure(1, "ValueError", "bad batch"))
    flaky = WorkerError(RankFailure(1, "OSError", "NFS hiccup"))
    broken = WorkerError(RankFailure(0, "RuntimeError", "Connection closed by peer"))
    assert [policy.verdict(e, used=0) for e in (died(), stalled(), flaky, broken, own)] == [
        Verdict.RETRY, Verdict.RETRY, Verdict.RETRY, Verdict.RETRY, Verdict.OWN_ERROR]
    assert policy.verdict(died(), used=2) is Verdict.SPENT and FailurePolicy().verdict(died(), 0) is Verdict.SPENT
    assert policy.verdict(died(), used=0, stopping=True) is Verdict.NOT_RESTARTING
    assert policy.verdict(RuntimeError("the controller died"), used=0) is Verdict.NOT_A_RANK
    sweep = FailurePolicy(max_restarts=1, retry_stalls=False)  # a trial's stall would happen again
    assert sweep.verdict(stalled(), 0) is Verdict.STALLED and not sweep.retries(stalled()) and sweep.retries(died())


def test_the_grace_is_longer_only_for_work_that_resumes_from_snapshots():
    assert FailurePolicy().grace_s == GRACE_S and FailurePolicy(max_restarts=1).grace_s == GRACE_S
    assert FailurePolicy(max_restarts=1, snapshot_every="auto").grace_s == RESTART_GRACE_S
    assert not FailurePolicy().restarts and FailurePolicy(max_restarts=1).restarts


# ---------------------------------------------------------------- send.py: one AsyncResult per engine


class Engine:
    def __init__(self, eid: int, calls: list, answers: bool = True):
        self.eid, self.calls, self.answers = eid, calls, answers

    def apply_async(self, fn, *args):
        self.calls.append((self.eid, fn.__name__, args))
        if not self.answers:
            return SimpleNamespace(get=lambda timeout: (_ for _ in ()).throw(TimeoutError("busy")))
        return SimpleNamespace(get=lambda timeout: fn(*args))


def test_each_rank_gets_its_own_task_with_its_own_arguments_and_other_hosts_are_asked_once_each():
    calls: list = []
    client = {10 + r: Engine(10 + r, calls) for r in range(4)}
    ars = send.to_ranks(client, [place(0), place(2)], max, lambda p: (p.rank, 1))
    assert sorted(ars) == [0, 2] and [ars[r].get(0) for r in (0, 2)] == [1, 2]
    assert [c[0] for c in calls] == [10, 12]
    calls.clear()
    far = [Placement(r, 0, 4, 1, 10 + r, host, 1, "cpu", host, False) for r, host in ((0, "a"), (1, "b"), (2, "b"))]
    client[11].answers = False  # a busy engine is not waited for past the bound
    assert send.once_per_other_host(client, [place(3), *far], max, 1, 2, timeout=0.05) == ["a", "b"]
    assert [c[0] for c in calls] == [10, 11]  # host b once, through its first engine; the kernel's host never
    assert send.silent_engines(client, [10, 11], timeout=0.05) == [11]


# ---------------------------------------------------------------- work.py: an interrupt while work is launched


def test_an_interrupt_while_work_is_launched_is_held_then_counted_as_the_first(monkeypatch):
    """Kernel > Interrupt between the first task sent and the watcher set up would leave ranks running unwatched:
    it is held, and the wait that follows takes it as the first interrupt (a clean stop), not as a crash."""
    import os
    import signal

    from nbddp.execution.work import Work, interrupts_held, wait_interruptibly

    class Launched(Work):
        def __init__(self):
            super().__init__(FakeSession(1), "a fake fit")
            self.stops: list[str] = []
            self.session.attend = lambda work: None

        def request_stop(self):
            self.stops.append("clean")
            self.done_event.set()

        def hard_stop(self, reason="a second interrupt"):
            self.stops.append("hard")

    before = signal.getsignal(signal.SIGINT)
    with interrupts_held() as held:
        os.kill(os.getpid(), signal.SIGINT)  # delivered here: no KeyboardInterrupt escapes the launch
        time.sleep(0.05)
    assert held == [signal.SIGINT] and signal.getsignal(signal.SIGINT) is before
    work = Launched()
    assert wait_interruptibly(work, timeout=5.0, already=len(held)) and work.stops == ["clean"]
