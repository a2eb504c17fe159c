"""``%ddp`` and ``%%ddp`` through a real IPython shell, on the suite's 2 CPU workers."""

from __future__ import annotations

import re
import time

import pytest
from IPython.core.error import UsageError

import nbddp
from interrupts import interrupt_when
from nbddp.monitor import status as health
from nbddp.cells import rank_output as output
from nbddp.protocol.errors import FitRunningError


@pytest.fixture
def written(monkeypatch):
    """Every labelled line the magics print, with the time it was printed."""
    lines: list[tuple[float, str, str]] = []
    real = output.write

    def record(kind, text):
        lines.append((time.monotonic(), kind, text))
        real(kind, text)

    monkeypatch.setattr(output, "write", record)
    return lines


def texts(written, kind="stdout"):
    return [text.rstrip("\n") for _, k, text in written if k == kind]


# ---- usage ----------------------------------------------------------------------
def test_usage_errors_name_the_problem_and_show_usage(ip):
    with pytest.raises(UsageError, match=r"needs a sub-command\.\nusage:\n  %ddp start .*\n.*%ddp stop"):
        ip.run_line_magic("ddp", "")
    with pytest.raises(UsageError, match=r"(?s)no sub-command 'frobnicate'.*%%ddp \[--targets TARGETS\] \[--no-stream\]"):
        ip.run_line_magic("ddp", "frobnicate")
    with pytest.raises(UsageError, match="invalid choice: 'mpi'"):
        ip.run_line_magic("ddp", "start --backend mpi")
    with pytest.raises(UsageError, match="required: NAME"):
        ip.run_line_magic("ddp", "pull")
    with pytest.raises(UsageError, match="comma-separated integers like 0,2; got 'a,b'"):
        ip.run_cell_magic("ddp", "--ranks a,b", "pass")
    with pytest.raises(UsageError, match="needs at least one rank"):
        ip.run_cell_magic("ddp", "--ranks ,", "pass")


def test_syntax_error_is_raised_before_any_rank_runs(ip, workers):
    with pytest.raises(SyntaxError, match="never closed|invalid syntax|unexpected EOF"):
        ip.run_cell_magic("ddp", "", "x = (")


# ---- %%ddp -----------------------------------------------------------------------
def test_cell_output_is_labelled_by_rank_and_streams_live(ip, workers, written):
    cell = ("import sys, time\n"
            "print(f'hello from {rank} of {world_size} on {device}', flush=True)\n"
            "time.sleep(3)\n"
            "print('warning', rank, file=sys.stderr)\n"
            "local_rank * 100 + rank")
    t0 = time.monotonic()
    ip.run_cell_magic("ddp", "", cell)
    ended = time.monotonic()
    out = texts(written)
    assert "[rank 0] hello from 0 of 2 on cpu" in out
    assert "[rank 1] hello from 1 of 2 on cpu" in out
    assert "[rank 0] 0" in out and "[rank 1] 101" in out  # the last expression's value
    assert sorted(texts(written, "stderr")) == ["[rank 0] warning 0", "[rank 1] warning 1"]
    first = min(t for t, _, text in written if "hello from" in text)
    assert first - t0 < ended - t0 - 1.5, "the first line should be printed while the cell still runs"


def test_a_widget_opened_on_a_rank_does_not_stop_the_output_of_later_cells(ip, workers, written):
    """A progress bar on a worker is an ipywidget: the comm it opens reached ipyparallel's output handler, which
    raised in a shell that is not a Jupyter kernel's, and no output of any later cell arrived (nbddp/cluster/iopub_guard.py)."""
    ip.run_cell_magic("ddp", "", "from comm import create_comm\nc = create_comm(target_name='nbddp-test')\n"
                                 "c.close()\ndel c, create_comm")
    t0 = time.monotonic()
    ip.run_cell_magic("ddp", "", "print('after', rank)")
    assert {"[rank 0] after 0", "[rank 1] after 1"} <= set(texts(written))
    assert time.monotonic() - t0 < output.OUTPUT_WAIT_S  # the output arrived: nothing waited it out


def test_names_persist_across_cells_and_ranks_selects_a_subset(ip, workers, written):
    ip.run_cell_magic("ddp", "", "x = rank * 10\ndef twice(v):\n    return 2 * v")
    ip.run_cell_magic("ddp", "--ranks 1", "only_one = twice(x)\nprint('x is', x, 'twice', only_one)")
    assert texts(written) == ["[rank 1] x is 10 twice 20"]
    written.clear()
    ip.run_cell_magic("ddp", "", "print('only_one' in globals(), twice(x))")
    assert sorted(texts(written)) == ["[rank 0] False 0", "[rank 1] True 20"]
    with pytest.raises(UsageError, match=r"--ranks 0,5: no rank 5; the workers have ranks 0\.\.1"):
        ip.run_cell_magic("ddp", "--ranks 0,5", "pass")


def test_no_stream_prints_each_ranks_output_grouped_at_the_end(ip, workers, written):
    ip.run_cell_magic("ddp", "--no-stream", "import time\nfor i in range(3):\n    print('line', i, flush=True)\n"
                                             "    time.sleep(0.3)")
    assert texts(written) == [f"[rank {r}] line {i}" for r in (0, 1) for i in range(3)]


@pytest.mark.faults
def test_exception_on_one_rank_is_raised_quickly_and_the_next_cell_works(ip, workers, written):
    cell = ("import torch.distributed as dist\n"
            "if rank == 1:\n"
            "    raise ValueError('boom on purpose')\n"
            "dist.barrier()  # rank 0 waits here for a peer that never comes\n")
    t0 = time.monotonic()
    with pytest.raises(nbddp.WorkerError, match=r"rank 1 \(pid \d+.*\): ValueError: boom on purpose") as info:
        ip.run_cell_magic("ddp", "", cell)
    took = time.monotonic() - t0
    assert info.value.rank == 1
    plain = re.sub(r"\x1b\[[0-9;]*m", "", info.value.remote_traceback)
    assert "raise ValueError('boom on purpose')" in plain and "%%ddp cell" in plain  # the cell's own line
    assert "rank(s) 0 were stuck" in str(info.value)
    assert took < 30, f"the failure took {took:.1f} s to surface"
    written.clear()
    ip.run_cell_magic("ddp", "", "print('alive', rank, world_size)")
    assert sorted(texts(written)) == ["[rank 0] alive 0 2", "[rank 1] alive 1 2"]


def _printed(written, marker, count):
    return lambda: sum(marker in text for _, _, text in written) >= count


def test_interrupt_stops_the_cell_on_every_rank(ip, workers, written):
    cell = "import time\nprint('started', flush=True)\nwhile True:\n    time.sleep(0.01)"
    pids = {p.engine_id: p.pid for p in workers.placements}
    t0 = time.monotonic()
    with interrupt_when(_printed(written, "started", 2)), \
            pytest.raises(KeyboardInterrupt, match="interrupted on every rank.*KeyboardInterrupt"):
        ip.run_cell_magic("ddp", "", cell)
    assert time.monotonic() - t0 < 60
    assert {p.engine_id: p.pid for p in workers.placements} == pids  # nothing was killed
    written.clear()
    ip.run_cell_magic("ddp", "", "print('next', rank)")
    assert sorted(texts(written)) == ["[rank 0] next 0", "[rank 1] next 1"]


@pytest.mark.faults
def test_second_interrupt_kills_ranks_that_ignore_the_first(ip, workers, written):
    cell = ("import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nprint('deaf', flush=True)\n"
            "while True:\n    time.sleep(0.01)")
    with interrupt_when(_printed(written, "deaf", 2), times=2), \
            pytest.raises(KeyboardInterrupt, match="killed the ranks still running after a second interrupt"):
        ip.run_cell_magic("ddp", "", cell)
    written.clear()
    ip.run_cell_magic("ddp", "", "print('replaced', rank)")  # waits for the replacements
    assert sorted(texts(written)) == ["[rank 0] replaced 0", "[rank 1] replaced 1"]


# ---- push / pull --------------------------------------------------------------------
def test_push_and_pull_round_trip_tensors_and_notebook_classes(ip, workers, written):
    ip.run_cell("import torch\n"
                "class Box:\n"
                "    def __init__(self, v):\n"
                "        self.v = v\n"
                "box = Box(torch.arange(5))\n"
                "weights = torch.ones(3, 2)\n"
                "factor = 7\n")
    ip.run_line_magic("ddp", "push Box box weights factor")
    ip.run_cell_magic("ddp", "", "import torch\nbox.v = box.v * (rank + factor)\nprint(type(box).__name__, weights.sum().item())\n"
                                 "made_here = Box(torch.full((2,), float(rank)))")
    assert sorted(texts(written)) == ["[rank 0] Box 6.0", "[rank 1] Box 6.0"]
    ip.run_line_magic("ddp", "pull box made_here --rank 1")
    Box = ip.user_ns["Box"]
    assert isinstance(ip.user_ns["box"], Box) and isinstance(ip.user_ns["made_here"], Box)
    assert ip.user_ns["box"].v.tolist() == [0, 8, 16, 24, 32]
    assert ip.user_ns["made_here"].v.tolist() == [1.0, 1.0]
    ip.run_line_magic("ddp", "pull box")  # default: rank 0
    assert ip.user_ns["box"].v.tolist() == [0, 7, 14, 21, 28]


def test_push_and_pull_errors_name_the_missing_variable(ip, workers):
    ip.run_cell_magic("ddp", "", "defined_here = 1")
    with pytest.raises(NameError, match=r"rank 0 has no variable named 'nope'; the names defined there are: .*defined_here"):
        ip.run_line_magic("ddp", "pull nope")
    with pytest.raises(UsageError, match=r"%ddp pull --rank 7: no rank 7; the workers have ranks 0\.\.1"):
        ip.run_line_magic("ddp", "pull defined_here --rank 7")
    ip.user_ns.pop("missing_in_kernel", None)
    with pytest.raises(NameError, match="no variable named 'missing_in_kernel' in the notebook"):
        ip.run_line_magic("ddp", "push missing_in_kernel")
    with pytest.raises(UsageError, match=r"(?s)no variable named 'missing_in_kernel'.*\nusage: %ddp push"):
        ip.run_line_magic("ddp", "push missing_in_kernel")  # misuse of the magic: a UsageError, and a NameError
    with pytest.raises(UsageError, match=r"(?s)rank 0 has no variable named 'nope'.*\nusage: %ddp pull"):
        ip.run_line_magic("ddp", "pull nope")


# ---- ipyparallel's spellings: --targets, --noblock ----------------------------------------
def test_targets_take_ipyparallels_lists_and_slices(ip, workers, written):
    ip.run_cell_magic("ddp", "--targets ::2", "print('here', rank)")
    assert texts(written) == ["[rank 0] here 0"]
    written.clear()
    ip.run_cell_magic("ddp", "--targets 1:", "print('here', rank)\nmine = rank * 3")
    ip.run_cell_magic("ddp", "--targets=-1", "print('last', rank)")
    ip.run_cell_magic("ddp", "--targets all", "print('all', rank)")
    assert texts(written)[:2] == ["[rank 1] here 1", "[rank 1] last 1"]
    assert sorted(texts(written)[2:]) == ["[rank 0] all 0", "[rank 1] all 1"]
    ip.run_line_magic("ddp", "pull mine --targets 1")
    assert ip.user_ns["mine"] == 3
    ip.run_cell_magic("ddp", "", "mine = rank + 100")
    ip.run_line_magic("ddp", "pull mine --targets 0,1")  # several ranks: a list each, in rank order (DirectView.pull)
    assert ip.user_ns["mine"] == [100, 101]
    ip.run_line_magic("ddp", "pull mine --targets ::1")
    assert ip.user_ns["mine"] == [100, 101]
    stacks = ip.run_line_magic("ddp", "stacks --targets 1")
    assert stacks is None  # shown, not returned
    assert [e.rank for e in nbddp.stacks(ranks=[1])] == [1]


def test_targets_misuse_is_a_usage_error_with_the_usage_line(ip, workers):
    for line, match in [("--targets a:b", r"--targets takes a slice like ::2.*got 'a:b'\nusage: %%ddp \[--targets"),
                        ("--targets ::0", r"got '::0'"), ("--targets 1:2:3:4", r"got '1:2:3:4'"),
                        ("--targets 5:", r"%%ddp --targets 5:: the slice 5: takes no rank of 0\.\.1\nusage: %%ddp"),
                        ("--nope", r"unrecognized arguments: --nope\nusage: %%ddp")]:
        with pytest.raises(UsageError, match=match):
            ip.run_cell_magic("ddp", line, "pass")
    with pytest.raises(UsageError, match=r"%ddp stacks --targets 3: no rank 3.*\nusage: %ddp stacks"):
        ip.run_line_magic("ddp", "stacks --targets 3")
    with pytest.raises(UsageError, match=r"%ddp pull --targets 2,3: no rank 2, 3.*\nusage: %ddp pull"):
        ip.run_line_magic("ddp", "pull x --targets 2,3")


def test_noblock_returns_a_handle_as_the_cells_value(ip, workers, written):
    from nbddp.cells.call_handle import CallHandle

    ip.run_cell("%%ddp --noblock\nimport time\ntime.sleep(0.2)\nprint('ran on', rank)\nrank * 10")
    handle = ip.user_ns["_"]
    assert isinstance(handle, CallHandle) and handle.result(timeout=60) == [0, 10]
    assert texts(written) == [] and handle.stdout == {0: "ran on 0\n0\n", 1: "ran on 1\n10\n"}
    assert "CallHandle %%ddp cell on ranks [0, 1]: done" in repr(handle)
    handle = ip.run_cell_magic("ddp", "--targets 1 --noblock", "rank")
    assert handle.result(timeout=60) == [1]
    assert ip.run_cell_magic("ddp", "--noblock --block", "rank") is None  # the last of the two says


# ---- status, start, stop, restart ---------------------------------------------------------
def test_status_shows_one_row_per_rank(ip, workers, capsys):
    ip.run_line_magic("ddp", "status")
    out = capsys.readouterr().out
    assert "nbddp: 2 worker(s), backend gloo, started by this kernel" in out
    header = "rank  local rank  host  pid"
    assert header in out and "alive" in out and "memory" in out and "fit running" in out
    for p in workers.placements:
        row = next(line for line in out.splitlines() if f" {p.pid} " in line)
        assert row.split()[:2] == [str(p.rank), str(p.local_rank)]
        assert " yes " in row and " MB " in row and row.rstrip().endswith("no")
    html = health.status_table()._repr_html_()
    assert html.count("<tr>") == 3 and "<th>fit running</th>" in html


@pytest.mark.heavy
def test_status_during_a_background_fit_marks_ranks_busy(ip, workers, digits, capsys):
    """Heavy: a background fit long enough to be seen busy in %ddp status."""
    import torch.nn as nn

    (x, y), _ = digits
    handle = nbddp.dist_fit(nn.Linear(64, 10), (x, y), epochs=8, batch_size=16, block=False, live=False)
    try:
        ip.run_line_magic("ddp", "status")
        out = capsys.readouterr().out
        rows = [line for line in out.splitlines() if line.startswith(("0 ", "1 "))]
        if not handle.done():
            assert len(rows) == 2 and all("yes (busy)" in r and r.rstrip().endswith("yes") for r in rows), out
        if not handle.done():
            with pytest.raises(FitRunningError, match="a dist_fit is still running on these workers"):
                ip.run_cell_magic("ddp", "", "print(rank)")
    finally:
        handle.wait()


@pytest.mark.fresh_workers  # stops the suite's workers, starts and restarts its own through the magics
def test_stop_status_start_restart_through_the_magic(ip, workers, capsys):
    ip.run_line_magic("ddp", "stop")
    ip.run_line_magic("ddp", "status")
    assert "no workers are running; start them with %ddp start" in capsys.readouterr().out
    ip.run_line_magic("ddp", "start -n 2 --backend gloo")
    assert "nbddp: 2 worker(s), backend gloo" in capsys.readouterr().out
    generation = workers.generation
    old = {p.pid for p in workers.placements}
    ip.run_line_magic("ddp", "restart")
    assert "nbddp: 2 worker(s), backend gloo" in capsys.readouterr().out
    assert workers.generation > generation and not old & {p.pid for p in workers.placements}


def test_unload_ext_removes_the_magics(ip):
    manager = ip.magics_manager
    assert "ddp" in manager.magics["line"] and "ddp" in manager.magics["cell"]
    assert ip.user_ns.get("dist_fit") is nbddp.dist_fit
    ip.run_line_magic("unload_ext", "nbddp")
    try:
        assert "ddp" not in manager.magics["line"] and "ddp" not in manager.magics["cell"]
        assert "DDPMagics" not in manager.registry and "dist_fit" not in ip.user_ns
        with pytest.raises(UsageError, match="not found"):
            ip.run_line_magic("ddp", "status")
    finally:
        ip.run_line_magic("load_ext", "nbddp")
    assert "ddp" in manager.magics["line"]
