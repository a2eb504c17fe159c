"""Debugging a rank from the notebook (issue "debug"), on the suite's shared workers.

The person's code is defined in IPython cells (``ip.run_cell``), as in a
notebook: its file is ``<ipython-input-N-...>``, which exists only in the
kernel's ``linecache``, so every source line a worker shows came with the
call (``nbddp.shipping.source_lines``). pytest's stdin is no terminal: a breakpoint during
a blocking call is released (the headless rule), and prompts are driven with
``nbddp.debug(commands=[...])`` from the test; the real prompt in a real
kernel is ``test_debug_kernel.py``.
"""

from __future__ import annotations

import linecache
import re
import socket
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from IPython.core.error import UsageError

import nbddp
from nbddp.debugging.conversation import NoPrompt, parse_ranks
from nbddp.protocol.errors import NothingToDebug, WorkerError

pytestmark = pytest.mark.timeout(240)
ANSI = re.compile(r"\x1b\[[0-9;]*m")

CELLS = '''
import os, time, torch, nbddp
import torch.nn.functional as F

def pick(batch, rank):
    h = batch * (rank + 1)
    if rank == 1:
        h = h @ torch.ones(5, 2)
    return h.sum()

def both_fail():
    x = 10 * (torch.distributed.get_rank() + 1)
    torch.distributed.barrier()  # both raise at once: neither is left running into the kill grace
    raise ValueError(f"x is {x}")

class PauseOnce:
    """A step_fn that stops rank 1 at breakpoint() on its `at`-th step (never for at=0)."""
    def __init__(self, at):
        self.at, self.n = at, 0
    def __call__(self, model, batch):
        x, y = batch
        loss = F.mse_loss(model(x), y)
        self.n += 1
        if torch.distributed.get_rank() == 1 and self.n == self.at:
            breakpoint()
        return loss

def wait_on_rank_1(model, batch):
    x, y = batch
    if torch.distributed.get_rank() == 1:
        while not os.path.exists(marker):
            time.sleep(0.05)
    return F.mse_loss(model(x), y)

def ask_on_rank_1(value):
    if torch.distributed.get_rank() == 1:
        breakpoint()
    return value

def set_env(name, value):
    import os
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value

def breakpoint_in_a_thread():
    import threading
    t = threading.Thread(target=breakpoint)
    t.start()
    t.join()
'''


def cell(ip, code):
    result = ip.run_cell(code)
    error = result.error_before_exec or result.error_in_exec
    if error is not None:
        raise error
    return result.result


@pytest.fixture(scope="module")
def shell(ip):
    cell(ip, CELLS)
    ip.user_ns["data"] = (torch.randn(64, 4, generator=torch.Generator().manual_seed(0)),
                          torch.randn(64, 3, generator=torch.Generator().manual_seed(1)))
    return ip


def _wait(condition, timeout=30.0, what="the condition"):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout} s"
        time.sleep(0.02)


def _fit(shell, step, **options):
    shell.user_ns["fit_options"] = dict(batch_size=8, epochs=1, live=False, step_fn=step, **options)
    return cell(shell, "torch.manual_seed(0); model = torch.nn.Linear(4, 3)\n"
                       "nbddp.dist_fit(model, data, **fit_options)")


# ---- without workers -------------------------------------------------------------------


def test_code_keeps_its_file_and_its_lines_travel_once_per_worker_per_content():
    from nbddp.shipping import pickling as shipping
    from nbddp.session.source_ledger import SourceLedger

    name = "/tmp/ipykernel_0/notebook-cell-only.py"
    text = "def f(x):\n    y = x + 1\n    return y / 0\n"
    linecache.cache[name] = (len(text), None, text.splitlines(True), name)
    ns = {"__name__": "__main__"}
    exec(compile(text, name, "exec"), ns)
    ledger, worker = SourceLedger(), SimpleNamespace(host="h", pid=1)
    parcel = shipping.pack(ns["f"], local=False)
    assert parcel.source_files == (name,)
    first, again = ledger.attach(parcel, worker), ledger.attach(parcel, worker)
    assert [s.lines for s in first.sources] == [tuple(text.splitlines(True))]
    assert again.sources == () and again is parcel, "the same content travels once per worker"
    assert ledger.attach(parcel, SimpleNamespace(host="h", pid=2)).sources, "another worker gets it too"
    del linecache.cache[name]  # as on a worker: only the shipped lines know the file
    f = shipping.unpack(first)
    assert f.__code__.co_filename == name
    with pytest.raises(ZeroDivisionError) as info:
        f(1)
    assert "return y / 0" in "".join(__import__("traceback").format_tb(info.tb))
    edited = text.replace("/ 0", "/ 0.0")
    linecache.cache[name] = (len(edited), None, edited.splitlines(True), name)
    assert ledger.attach(parcel, worker).sources[0].lines[2] == "    return y / 0.0\n", "a new content travels again"


def test_a_paused_rank_and_the_ranks_waiting_for_it_are_never_stalled():
    from nbddp.protocol.messages import Beat
    from nbddp.execution.stalls import StallWatch

    now = [0.0]
    watch = StallWatch([0, 1], clock=lambda: now[0])
    watch.feed(0, Beat(0, 1, 5, "backward", 2, 3, 0.1, 0.0))
    watch.feed(1, Beat(1, 1, 5, "paused", 2, 3, 0.1, 0.0, paused_at="cell:4"))
    for t in range(1, 40):  # the paused rank's beats keep coming, the peer waits in its collective
        now[0] = float(t)
        watch.feed(1, Beat(1, 1 + t, 5, "paused", 2, 3, 0.1, 0.0, paused_at="cell:4"))
        assert watch.stalled() == [] and watch.stalled(threshold=2.0) == []
    now[0] = 40.5  # resumed: quiet time counts from the last moment a rank was seen paused
    watch.feed(1, Beat(1, 99, 6, "data", 2, 4, 0.1, 0.0))
    assert watch.quiet_s(0) == pytest.approx(1.5)


def test_bad_input_says_what_exists(monkeypatch):
    from nbddp.session import session
    with pytest.raises(TypeError, match=r"commands=\['p x', 'c'\]; got str 'p x'"):
        nbddp.debug(commands="p x")
    with pytest.raises(TypeError, match=r"takes a rank number, e\.g\. debug\(1\); got str '1'"):
        nbddp.debug("1")
    assert parse_ranks("0, 2:4") == [0, 2, 3]
    monkeypatch.setattr(nbddp.api, "get_session", lambda: session.Session())
    with pytest.raises(NothingToDebug, match=r"no workers are running \(start them with nbddp.start\(\)\)"):
        nbddp.debug()


# ---- on the shared workers -------------------------------------------------------------


def test_remote_traceback_shows_the_line_and_a_post_mortem_reads_the_failing_frame(workers, shell, capsys):
    shell.run_line_magic("ddp", "debug --clear")  # a failure an earlier file's test left on a shared rank is not ours
    with pytest.raises(WorkerError) as info:
        cell(shell, "nbddp.run(lambda: pick(torch.ones(8, 3), torch.distributed.get_rank()))")
    tb = ANSI.sub("", info.value.remote_traceback)
    assert info.value.rank == 1 and re.search(r"Cell In\[\d+\], line 7", tb), tb
    assert "h = h @ torch.ones(5, 2)" in tb, "the worker shows the person's own line"
    with pytest.raises(ValueError, match=r"rank 0 keeps no failure to debug\. Failures kept: rank 1: RuntimeError "
                                         r"at Cell In\[\d+\], line 7"):
        nbddp.debug(0, commands=["w"])
    with pytest.raises(NoPrompt, match=r"no prompt can open here \(stdin is not a terminal\); pass the commands"):
        nbddp.debug()
    t0 = time.monotonic()
    text = nbddp.debug(1, commands=["p h.shape", "p rank", "ll", "q"])
    took = time.monotonic() - t0
    assert "[rank 1] (Pdb) p h.shape\ntorch.Size([8, 3])\n" in text, text
    assert "-> h = h @ torch.ones(5, 2)" in text and "failed: RuntimeError: mat1 and mat2" in text
    assert "post-mortem ended" in text
    assert took < 5, f"a post-mortem of four commands took {took:.1f} s"
    again = nbddp.debug(commands=["p rank"])  # kept until the next fit or --clear
    assert "[rank 1] (Pdb) p rank\n1\n" in again, again
    capsys.readouterr()


def test_several_failed_ranks_are_listed_then_attach_detach_cast_and_clear(workers, shell, capsys):
    with pytest.raises(WorkerError, match=r"rank 0 .*ValueError: x is 10"):
        cell(shell, "nbddp.run(both_fail)")
    text = nbddp.debug(commands=["list", "attach 1", "p x", "detach", "cast ranks(0,1) p x", "continue all"])
    assert "ranks in the debugger (attach R to talk to one):\n  rank 0" in text, text
    assert "[rank 1] (Pdb) p x\n20\n" in text and "[rank 0] 10\n[rank 1] 20\n" in text, text
    shell.run_line_magic("ddp", "debug --clear")
    assert "dropped the failure kept on rank 0, 1" in capsys.readouterr().out
    with pytest.raises(UsageError, match=r"%ddp debug: nothing to debug: No rank is paused at breakpoint\(\) and "
                                         r"none keeps a failure"):
        shell.run_line_magic("ddp", "debug")
    with pytest.raises(UsageError, match=r"%ddp debug 7: no rank 7: the workers have ranks 0\.\.1\. No rank is paused"):
        shell.run_line_magic("ddp", "debug 7")


def test_stacks_and_stall_frames_show_the_cells_lines(workers, shell, tmp_path):
    shell.user_ns["marker"] = str(tmp_path / "go")
    shell.user_ns["fit_options"] = dict(batch_size=8, epochs=1, live=False, step_fn=shell.user_ns["wait_on_rank_1"],
                                        block=False)
    handle = cell(shell, "nbddp.dist_fit(torch.nn.Linear(4, 3), data, **fit_options)")
    try:
        watch = handle._run.tasks.stalls.watch
        line = "time.sleep(0.05)"
        _wait(lambda: line in watch.stacks().get(1, ""), what="rank 1's heartbeat stack")
        assert re.search(r'File "<ipython-input-\d+-\w+>", line \d+, in wait_on_rank_1\n\s+time.sleep', watch.stacks()[1])
        assert line in nbddp.stacks()[1].text
        with pytest.raises(NothingToDebug, match=r"a dist_fit is running and no rank is paused at breakpoint\(\)"):
            nbddp.debug(commands=["w"])
    finally:
        open(shell.user_ns["marker"], "w").close()
        handle.wait()


def test_breakpoint_paused_past_stall_timeout_is_not_killed_and_the_fit_ends_as_without_it(workers, shell):
    from nbddp.live.text import paused_lines, rank_positions

    reference = _fit(shell, shell.user_ns["PauseOnce"](0))
    expected = {k: v.clone() for k, v in shell.user_ns["model"].state_dict().items()}
    pids = [p.pid for p in workers.placements]
    stall_timeout = 2.0
    handle = _fit(shell, shell.user_ns["PauseOnce"](3), block=False, stall_timeout=stall_timeout)
    state = handle._run.live_state
    _wait(lambda: state.paused, what="rank 1 paused")
    since = state.paused[0]["since"]
    _wait(lambda: time.monotonic() - since > stall_timeout + 1.5, timeout=stall_timeout + 10)
    assert not handle.done() and handle.status == "training", "no WorkerStalled while a rank is paused"
    assert re.fullmatch(r"rank 1 paused at Cell In\[\d+\], line \d+ \(__call__\), `%ddp debug 1` to attach",
                        paused_lines(state)[0]), paused_lines(state)
    assert "1: paused" in rank_positions(state) and "waiting for rank 1" in rank_positions(state)
    with pytest.raises(ValueError, match=r"rank 0 is not in the debugger\. In the debugger: rank 1 \(pid \d+\): "
                                         r"paused at breakpoint\(\)"):
        nbddp.debug(0, commands=["w"])
    text = nbddp.debug(commands=["p self.n", "p loss.shape", "c"])
    assert "[rank 1] (Pdb) p self.n\n3\n" in text and "-> return loss" in text, text
    assert "nbddp: rank 1: continued" in text
    history = handle.wait()
    assert history.status == "completed" and len(history.steps) == len(reference.steps)
    for k, v in shell.user_ns["model"].state_dict().items():
        torch.testing.assert_close(v, expected[k], rtol=0, atol=0)
    assert [p.pid for p in workers.placements] == pids, "no rank was killed or replaced"


def test_q_at_a_breakpoint_ends_the_work_with_a_clear_error(workers, shell):
    outcome = {}

    def call():
        try:
            outcome["result"] = nbddp.run(shell.user_ns["ask_on_rank_1"], 41)
        except BaseException as exc:  # noqa: BLE001 - inspected below
            outcome["error"] = exc

    caller = threading.Thread(target=call)  # not the main thread: no prompt opens by itself
    caller.start()
    _wait(lambda: workers.debugger.paused(), what="rank 1 paused")
    text = nbddp.debug(1, commands=["p value + 1", "q"])
    caller.join(60)
    assert "[rank 1] (Pdb) p value + 1\n42\n" in text, text
    error = outcome.get("error")
    assert isinstance(error, WorkerError) and error.rank == 1, outcome
    assert re.search(r"DebuggerQuit: debugger quit on rank 1 at <ipython-input-\d+-\w+>:\d+", str(error)), error


def test_headless_breakpoints_go_on_and_PYTHONBREAKPOINT_0_skips_them(workers, shell, capsys):
    history = _fit(shell, shell.user_ns["PauseOnce"](2))
    assert history.status == "completed"
    out = capsys.readouterr().out
    assert re.search(r"nbddp: rank 1 stopped at breakpoint\(\) at Cell In\[\d+\], line \d+ in __call__, but no prompt "
                     r"can open here: stdin is not a terminal; it continues", out), out
    shell.run_cell_magic("ddp", "", "before = 1\nbreakpoint()\nafter = 2")
    out = capsys.readouterr().out
    assert "stopped at breakpoint() at <%%ddp cell" in out and nbddp.pull("after", rank=1) == {"after": 2}, out
    nbddp.run(shell.user_ns["breakpoint_in_a_thread"])
    assert "no debugger prompt could open (it was called outside the task's main thread); continuing" in \
        capsys.readouterr().err
    nbddp.run(shell.user_ns["set_env"], "PYTHONBREAKPOINT", "0")
    try:
        shell.run_cell_magic("ddp", "", "breakpoint()\nskipped = 3")
        out = capsys.readouterr().out
        assert "breakpoint()" not in out and nbddp.pull("skipped", rank=1) == {"skipped": 3}, out
    finally:
        nbddp.run(shell.user_ns["set_env"], "PYTHONBREAKPOINT", None)


def test_the_debugger_listens_on_loopback_and_drops_a_wrong_token(workers):
    board = workers.debugger
    host, port = board.listener.getsockname()[:2]
    assert host == "127.0.0.1"
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.sendall(b'{"hello": "not-the-token", "rank": 1, "kind": "breakpoint"}\n')
        _wait(lambda: not board.poll() and not board._pending, what="the stranger dropped")
        sock.settimeout(5)
        assert sock.recv(10) == b"", "the board closed the connection"
