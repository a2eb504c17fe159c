"""The kernel's answers and profile requests through rank 0's torch store (``protocol/store_channel.py``).

A real ``TCPStore``: rank 0's side is the master (as in a group formed
across hosts), the kernel's side a second client (``KernelStore``), each in
its own thread. No workers: the end-to-end test across fake hosts is in
``test_multinode.py``.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from nbddp.protocol import store_channel
from nbddp.protocol.epoch_answer import EpochAnswer
from nbddp.protocol.messages import FitLaunch
from nbddp.protocol.notices import NbddpWarning
from nbddp.protocol.host import free_port
from nbddp.protocol.store_channel import KernelStore


@pytest.fixture
def master():
    """Rank 0's store: the master of a group's TCPStore, on a free loopback port."""
    port = free_port("127.0.0.1")
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    yield store, port
    del store


def _closed_port() -> int:
    with socket.socket() as s:  # bound, never listening: a connect is refused
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_rank_0_takes_only_its_own_point_and_deletes_it(master):
    store, port = master
    kernel = KernelStore("127.0.0.1", port, generation=3)
    # stale keys: another fit's answer to the same point, this fit's answer to an older generation and point
    kernel.set(store_channel.answer_key("otherfit", 3, 5), {"seq": 5, "stop": "not yours"})
    kernel.set(store_channel.answer_key("fit", 2, 5), {"seq": 5, "stop": "an older launch"})
    kernel.set(store_channel.answer_key("fit", 3, 4), {"seq": 4, "stop": "an older point"})
    key = store_channel.answer_key("fit", 3, 5)
    t0 = time.monotonic()
    assert store_channel.wait_value(store, key, timeout_s=0.3) is None  # none of them is this point's
    assert 0.25 <= time.monotonic() - t0 < 5

    got: list = []
    waiter = threading.Thread(target=lambda: got.append(store_channel.wait_value(store, key, timeout_s=30)))
    waiter.start()  # rank 0 blocks in the store (the GIL released: the kernel's thread below runs)
    time.sleep(0.05)
    assert waiter.is_alive()
    kernel.set(key, {"seq": 5, "stop": None, "lr": 0.01, "checkpoint": None})
    waiter.join(10)
    assert not waiter.is_alive() and got == [{"seq": 5, "stop": None, "lr": 0.01, "checkpoint": None}]
    assert not store.check([key])  # taken: deleted
    assert store.check([store_channel.answer_key("otherfit", 3, 5)])  # the others are left to their owners
    kernel.delete(store_channel.answer_key("otherfit", 3, 5))
    assert not store.check([store_channel.answer_key("otherfit", 3, 5)])
    kernel.delete(key)  # already gone: no error


def test_a_value_that_is_not_an_answer_is_none(master):
    store, _ = master
    store.set("nbddp/fit/g0/answer/0", b"\xff not json")
    assert store_channel.wait_value(store, "nbddp/fit/g0/answer/0", timeout_s=1) is None


def test_the_kernel_cannot_hang_on_a_store_it_cannot_reach():
    port = _closed_port()
    t0 = time.monotonic()
    with pytest.raises(OSError, match=rf"rank 0's torch.distributed store at 127.0.0.1:{port} did not answer "
                                      r"within 1 s"):
        KernelStore("127.0.0.1", port, generation=0, timeout_s=1.0)
    assert time.monotonic() - t0 < 15  # bounded (torch retries the connect until its timeout)


def test_profile_requests_counter_newest_taken_once(master):
    store, port = master
    kernel = KernelStore("127.0.0.1", port, generation=0)
    assert store_channel.newest_request(store, "fit", seen=0) is None  # nothing asked: one round trip, no wait
    kernel.ask("fit", 1, {"id": 1, "steps": 4})
    kernel.ask("otherfit", 1, {"id": 1, "steps": 9})
    assert store_channel.newest_request(store, "fit", seen=0) == {"id": 1, "steps": 4}
    assert not store.check([store_channel.request_key("fit", 1)])  # taken: deleted
    assert store_channel.newest_request(store, "fit", seen=1) is None
    assert store_channel.newest_request(store, "fit", seen=0) is None  # a relaunched rank 0 passes over a taken one
    kernel.ask("fit", 2, {"id": 2, "steps": 3})
    kernel.ask("fit", 3, {"id": 3, "steps": 5})  # asked again before rank 0 looked: the newest is taken
    assert store_channel.newest_request(store, "fit", seen=1) == {"id": 3, "steps": 5}
    assert store_channel.newest_request(store, "otherfit", seen=0) == {"id": 1, "steps": 9}


def _session(port: int, local: bool = False, generation: int = 0, tcp: bool = True):
    init = f"tcp://127.0.0.1:{port}" if tcp else f"file:///dev/shm/nbddp-test-{os.getpid()}-pg-{generation}"
    group = SimpleNamespace(master_addr="127.0.0.1", master_port=port, generation=generation, init_method=init)
    return SimpleNamespace(placements=[SimpleNamespace(rank=0, host="far-away", local=local)], group=group,
                           generation=generation, file_prefix=f"nbddp-test-{os.getpid()}-link")


def test_the_link_is_the_file_on_one_host_and_the_store_across_hosts(master):
    from nbddp.fit.rank0_store import Rank0Link

    _, port = master
    one_host = Rank0Link.open(_session(port, local=True, tcp=False))  # a FileStore: never opened by the kernel
    assert not one_host.remote and one_host.reachable and one_host.channel == ""
    for local in (True, False):  # across hosts the store is used, with rank 0 on this host or not (it is faster)
        there = Rank0Link.open(_session(port, local=local))
        assert there.remote and there.reachable and len(there.channel) == 16
        assert there.answer_key(7) == f"nbddp/{there.channel}/g0/answer/7"
    unreachable_but_here = Rank0Link.open(_session(_closed_port(), local=True), timeout_s=1.0)
    assert not unreachable_but_here.remote and unreachable_but_here.reachable  # the file still reaches rank 0
    gone = Rank0Link.open(_session(_closed_port()), timeout_s=1.0)
    assert not gone.remote and not gone.reachable and "did not answer within 1 s" in gone.reason
    stopped = Rank0Link.open(_session(port))
    stopped.session.group = None  # nbddp.stop() during the fit: the group and its store are gone
    with pytest.raises(OSError, match=r"the workers were stopped \(nbddp.stop\(\)\): rank 0's store went with"):
        stopped.store()
    there.close()  # the fit ended: the client goes, and nothing reconnects
    with pytest.raises(OSError, match=r"this fit has ended: its link to rank 0's store is closed"):
        there.store()


def test_answers_go_through_the_store_and_rank_0_takes_them(master):
    from nbddp.callbacks.epoch_answers import Answers
    from nbddp.fit.rank0_store import Rank0Link
    from nbddp.worker.training.kernel_answers import KernelAnswers

    store, port = master
    link = Rank0Link.open(_session(port, generation=2))
    answers = Answers("unused-prefix", ("epoch",), link)
    assert answers.path == ""  # no file in /dev/shm for a rank 0 elsewhere
    rank0 = KernelAnswers(0, ("epoch",), "prefix", timeout_s=0.3, channel=link.channel, generation=2)
    assert rank0.kinds == ("epoch",) and rank0.path == ""
    rank0_store = store_channel.rank_store
    store_channel.rank_store = lambda: store  # rank 0's default group store (no process group in this test)
    try:
        answers.set_lr(0.5)
        answers.stop("on_epoch_end of Stopper")
        answers.answer(1)
        assert rank0.wait(0) is None  # point 0 was never answered: its own key only, after the timeout
        assert rank0.wait(1) == EpochAnswer(seq=1, stop="on_epoch_end of Stopper", lr=0.5, checkpoint=None)
        answers.answer(2)
        assert store.check([link.answer_key(2)])
        answers.close()  # the fit ended before rank 0 took it: the kernel removes it
        assert not store.check([link.answer_key(2)])
    finally:
        store_channel.rank_store = rank0_store


def test_unreachable_store_hooks_go_asynchronous_and_profile_is_refused_saying_why():
    from nbddp.callbacks.fit_hooks import FitHooks
    from nbddp.fit.rank0_store import Rank0Link
    from nbddp.profiling.requests import ProfileRequests

    class Hook:
        def on_epoch_end(self, info, record):
            pass

    session = _session(_closed_port())
    link = Rank0Link.open(session, timeout_s=1.0)
    hooks = FitHooks([], [Hook()], {})
    with pytest.warns(NbddpWarning, match=r"rank 0 runs on far-away, and the callbacks' answers could not reach it: rank "
                                     r"0's torch.distributed store at 127.0.0.1:\d+ did not answer within 1 s"):
        launch = hooks.attach(FitLaunch(generation=0, returns="none"), session, link)
    assert hooks.answers is None and launch.answers == ()
    with pytest.raises(RuntimeError, match=r"handle.profile\(\) could not reach rank 0 on far-away: rank 0's "
                                           r"torch.distributed store .* dist_fit\(\.\.\., profile=True\)"):
        ProfileRequests(session, link).ask(3)


def test_profile_requests_go_through_the_store_and_go_when_the_fit_ends(master):
    from nbddp.fit.rank0_store import Rank0Link
    from nbddp.profiling.requests import ProfileRequests
    from nbddp.worker.training.asked_profile import LOOK_EVERY_S, AskedProfiles

    store, port = master
    session = _session(port)
    link = Rank0Link.open(session)
    requests = ProfileRequests(session, link)
    rank0 = AskedProfiles(0, None, 0.0, "prefix", channel=link.channel)
    assert rank0.path == ""
    rank0_store = store_channel.rank_store
    store_channel.rank_store = lambda: store
    try:
        assert rank0.pending() == (0.0, 0.0)
        first = requests.ask(4)
        assert requests.path == ""  # no file
        assert rank0.pending() == (0.0, 0.0)  # looked less than LOOK_EVERY_S ago: no round trip at every step
        rank0.looked -= LOOK_EVERY_S
        assert rank0.pending() == (float(first), 4.0)
        rank0.seen, rank0.looked = first, rank0.looked - LOOK_EVERY_S
        assert rank0.pending() == (0.0, 0.0)
        requests.ask(2)  # never taken: the fit ends first
        requests.close()
        assert not store.check([store_channel.asked_key(link.channel)])
        assert not store.check([store_channel.request_key(link.channel, first + 1)])
    finally:
        store_channel.rank_store = rank0_store


def test_a_record_handed_before_a_relaunch_is_not_answered_into_the_new_launch(master):
    """The new ranks count their records from 0 again: a late answer to the old launch's record 1 must not be
    taken as the answer to the new launch's record 1."""
    from nbddp.callbacks.epoch_answers import Answers
    from nbddp.fit.rank0_store import Rank0Link

    store, port = master
    session = _session(port, generation=1)
    link = Rank0Link.open(session)
    answers = Answers("unused-prefix", ("epoch",), link)
    handed = answers.launch  # record 1 handed to the hooks in this launch
    answers.due.add(1)
    session.generation = session.group.generation = 2  # the group re-formed; the fit is relaunched on it
    answers.close()
    answers.stop("a hook of the old launch")
    answers.answer(1, handed)  # its hooks finish only now
    assert not store.check([link.answer_key(1)])  # nothing written for the new launch's record 1
    answers.answer(1, answers.launch)  # the new launch's own record 1
    assert store_channel.wait_value(store, link.answer_key(1), timeout_s=5)["seq"] == 1
    answers.close()
