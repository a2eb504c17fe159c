"""The live view: choosing it, drawing it, streaming records into it, non-blocking fits.

Unit tests drive the views with a fake run (no workers); the rest train on
the suite's two CPU workers.
"""

from __future__ import annotations

import copy
import io
import threading
import time
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nbddp
from nbddp.protocol.errors import FitRunningError
from nbddp.fit.history import History
from nbddp.live import NullView, choose_view
from nbddp.live.state import LiveState
from nbddp.protocol.messages import FitLaunch, FitPlanInfo, Progress, RankInfo
from nbddp.live.text import TextView, progress_line
from nbddp.live import widget
from nbddp.live.widget import WIDGET_VIEW, WidgetView, summary_text
from nbddp.worker.training.report import WINDOW

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------
# a fake run: what the views read


class FakeRun:
    def __init__(self, total: int = 100):
        self.history = History(world_size=2)
        self.live_state = LiveState(
            status="training", world_size=2, backend="gloo", epochs=2,
            plan=FitPlanInfo(total_steps=total, steps_per_epoch=total // 2, start_step=0, batch_size=8),
            placements=[RankInfo(0, "node-a", "cpu", 1), RankInfo(1, "node-b", "cpu", 2)])
        self.error = None
        self.finished = False
        self.stops = 0
        self.started_at = time.perf_counter()

    def request_stop(self):
        self.stops += 1
        self.live_state.status = "stopping"

    def log(self, step: int, epoch: int = 0):
        self.history.add("step", {"step": step, "epoch": epoch, "loss": 2.0 / step, "lr": 1e-3,
                                  "samples_per_s": 1000.0, "time": step * 0.01})
        self.live_state.ranks = [{"rank": 0, "samples_per_s": 510.0, "peak_mem": 300 << 20, "param_bytes": 4096},
                                 {"rank": 1, "samples_per_s": 490.0, "peak_mem": 310 << 20, "param_bytes": 4096}]


def test_choose_view_picks_one_place():
    assert isinstance(choose_view(False), NullView)
    assert isinstance(choose_view("text"), TextView)
    assert isinstance(choose_view(None), TextView)  # pytest is no notebook kernel
    assert isinstance(choose_view(True), TextView)
    assert isinstance(choose_view("widget"), WidgetView)
    with pytest.raises(ValueError, match=r"live=\.\.\.\) must be True, False, None .* got 'plot'"):
        choose_view("plot")


def test_widget_view_draws_progress_plot_ranks_and_final_state():
    run = FakeRun(total=100)
    view = WidgetView(every=0.0, plot_every=0.0, plot_cpu_share=None)
    view.start(run)
    assert "starting" in view.status.value and "node-a" in view.ranks.value
    for step in range(1, 41):
        run.log(step)
        view.update(run)
    assert view.bar.value == pytest.approx(0.40)
    assert view.percent.value == "40%"
    assert "step 40/100" in view.progress.value and "ETA" in view.progress.value
    assert "loss 0.05" in view.metrics.value and "1,000 samples/s" in view.metrics.value
    assert "310.0 MiB" in view.ranks.value and "490" in view.ranks.value
    assert bytes(view.image.value).startswith(PNG_MAGIC)
    run.history.add("val", {"epoch": 0, "step": 40, "val_loss": 0.3, "val_acc": 0.9})
    for step in range(41, 101):
        run.log(step, epoch=1)
    run.live_state.status = "completed"
    run.finished = True
    view.finish(run)
    assert view.bar.value == 1.0 and view.bar.bar_style == "success" and view.percent.value == "100%"
    assert "val_acc 0.9" in view.metrics.value and "ETA" not in view.progress.value
    assert view.stop_button.disabled
    bundle = view._bundle(run, final=True)
    assert bundle[WIDGET_VIEW]["model_id"] == view.box.model_id
    assert bundle["image/png"].startswith("iVBOR")  # base64 of the PNG magic
    assert "nbddp fit completed: step 100/100" in bundle["text/plain"]
    assert "rank 1  node-b  cpu  490 samples/s" in bundle["text/plain"]
    assert "<img src='data:image/png;base64," in bundle["text/html"]
    assert "frontend" in view._bundle(run, final=False)["text/plain"]


def test_widget_view_throttles_the_plot():
    run = FakeRun(total=10_000)
    view = WidgetView(every=0.0, plot_every=60.0, plot_cpu_share=None)
    view.start(run)
    for step in range(1, 200):
        run.log(step)
        view.update(run)
    assert view.redraws == 1  # the first records drew; the next redraw waits plot_every
    run.finished = True
    view.finish(run)
    assert view.redraws == 2  # the final state is always drawn
    view.finish(run)
    assert view.redraws == 2  # ...but not again when nothing changed


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_widget_plot_stays_within_its_cpu_budget():
    """A redraw is allowed once the plot's CPU so far plus the last redraw's cost fit in 2 % of the elapsed time."""
    run = FakeRun(total=10_000)
    view = WidgetView(every=0.0, plot_every=0.0)
    view.clock = clock = FakeClock()
    view.start(run)
    run.log(1)
    view.update(run)
    assert view.redraws == 0  # a short fit draws nothing until its end
    clock.now += widget.FIRST_PLOT_COST_S / widget.PLOT_CPU_SHARE  # 1.5 s of budget for the assumed first cost
    run.log(2)
    view.update(run)
    assert view.redraws == 1
    view._plot_cost = 0.1  # say a redraw now costs 0.1 s: the budget needs (spent + 0.1) / 0.02 s of fit
    need = (view.plot_cpu_s + 0.1) / widget.PLOT_CPU_SHARE - (clock.now - view._t_start)
    assert need > widget.MAX_PLOT_INTERVAL
    clock.now += widget.MAX_PLOT_INTERVAL - 0.1
    run.log(3)
    view.update(run)
    assert view.redraws == 1  # over budget and not yet the 3 s floor
    clock.now += 0.2
    run.log(4)
    view.update(run)
    assert view.redraws == 2  # the floor: at least every 3 s, however slow drawing is


def test_a_fit_of_a_second_draws_its_plot_once_at_the_end():
    run = FakeRun(total=100)
    view = WidgetView(every=0.0)
    view.start(run)
    for step in range(1, 101):
        run.log(step)
        view.update(run)
    run.finished = True
    view.finish(run)
    assert view.redraws == 1 and bytes(view.image.value).startswith(PNG_MAGIC)


def test_widget_view_shows_a_failure():
    run = FakeRun()
    view = WidgetView()
    view.start(run)
    run.error = RuntimeError("rank 1 (pid 7): ValueError: bad batch\nmore")
    run.live_state.status = "failed"
    run.finished = True
    view.finish(run)
    assert view.bar.bar_style == "danger"
    assert "failed" in view.status.value and "bad batch" in view.status.value
    assert "error: rank 1 (pid 7): ValueError: bad batch" in summary_text(run)


def test_stop_button_requests_a_coordinated_stop_once():
    run = FakeRun()
    view = WidgetView()
    view.start(run)
    view.stop_button.click()
    assert run.stops == 1 and view.stop_button.disabled and "stopping" in view.status.value
    run.finished = True
    view._on_stop()  # a late click after the end does nothing
    assert run.stops == 1


def _text_view_of_a_fit(out, steps: int):
    """A text view through a whole fake fit of ``steps`` steps; returns the run."""
    run = FakeRun(total=steps)
    view = TextView(stream=out, every=0.0)
    view.start(run)
    for step in range(1, steps + 1):
        run.log(step)
        view.update(run)
    run.live_state.status = "completed"
    run.finished = True
    view.finish(run)
    return run


def test_text_view_prints_progress_and_summary():
    out = io.StringIO()
    run = _text_view_of_a_fit(out, 50)
    lines = out.getvalue().splitlines()
    assert lines[0] == "nbddp: training on 2 rank(s), backend gloo"
    assert lines[-1].startswith("[completed]  step 50/50  epoch 1/2  loss 0.04")
    assert len(lines) == 52  # header, one line per update (no tty: no rewriting), final
    assert "ETA" not in progress_line(run)


def test_text_view_on_a_terminal_rewrites_one_line_and_ends_with_the_summary_once():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    out = Terminal()
    _text_view_of_a_fit(out, 10)
    header, rest = out.getvalue().split("\n", 1)
    assert header == "nbddp: training on 2 rank(s), backend gloo"
    assert rest.count("\n") == 1 and rest.endswith("\x1b[K\n"), "progress and the summary share one line"
    shown = rest.split("\r")[-1]  # what the terminal shows after the last carriage return
    assert shown.startswith("[completed]  step 10/10")


# ---------------------------------------------------------------------------
# the kernel's stream of records (FitRun._stream), with a fake AsyncResult


def _bare_run():
    from nbddp.debugging.rank_lines import DebugBoard
    from nbddp.fit.fit_run import FitRun
    from nbddp.execution.rank_tasks import RankTasks

    session = SimpleNamespace(world_size=2, backend="gloo", placements=[], debugger=DebugBoard())
    from nbddp.execution.policy import FailurePolicy

    from nbddp.protocol.fit_options import FitConfig

    plan = SimpleNamespace(ship_s=0.0, cfg=FitConfig(batch_size=8, epochs=1), policy=FailurePolicy(),
                           launch=FitLaunch(generation=0, returns="none"))
    run = FitRun(session, plan, NullView())
    ar = SimpleNamespace(data={})
    run.tasks = RankTasks(session, {0: ar}, "dist_fit", fit=True)
    return run, ar


def _publish(ar, seqs):
    records = [(s, "step", {"step": s + 1}) for s in seqs]
    ar.data = {"nbddp": Progress(seq=seqs[-1] + 1, window=records, status="training", ranks=[])}


def test_stream_takes_each_record_once_and_goes_on_after_a_gap():
    run, ar = _bare_run()
    _stream = run._stream
    _publish(ar, list(range(0, 10)))
    _stream()
    _stream()  # the same message twice: no duplicate
    _publish(ar, list(range(5, 20)))  # overlaps what was seen
    _stream()
    assert [r["step"] for r in run.history.steps] == list(range(1, 21))
    _publish(ar, list(range(40, 40 + WINDOW)))  # the poll fell behind the window: 20 records missed
    _stream()
    assert run.live_state.missed == 20
    assert [r["step"] for r in run.history.steps] == list(range(1, 21)) + list(range(41, 41 + WINDOW))
    _publish(ar, list(range(60, 60 + WINDOW + 5)))
    _stream()
    assert run.history.steps[-1]["step"] == 60 + WINDOW + 5
    steps = [r["step"] for r in run.history.steps]
    assert steps == sorted(set(steps))


# ---------------------------------------------------------------------------
# with workers


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 10)

    def forward(self, x):
        return self.lin(x)


class Recorder(NullView):
    """A view that checks what the live side receives; ``poll_s`` slows the watcher down."""

    def __init__(self, poll_s: float | None = None):
        self.poll_s = poll_s
        self.updates = 0
        self.live_steps: list[dict] = []
        self.finished_with = None

    def start(self, run):
        if self.poll_s is not None:
            run.poll_s = self.poll_s

    def update(self, run):
        self.updates += 1
        self.live_steps = list(run.history.steps)

    def finish(self, run):
        self.finished_with = run.live_state.status


def _fit_with(monkeypatch, view, *args, **kwargs):
    monkeypatch.setattr("nbddp.live.choose_view", lambda live: view)
    return nbddp.dist_fit(*args, **kwargs)


@pytest.mark.parametrize("poll_s", [0.05, 0.6], ids=["default-poll", "slow-poll"])
def test_every_record_exactly_once_in_order(workers, digits, monkeypatch, poll_s):
    (x, y), _ = digits
    view = Recorder(poll_s=poll_s)
    steps = 3 * WINDOW + 7  # more records than the publisher's window
    h = _fit_with(monkeypatch, view, Tiny(), (x, y), epochs=10, max_steps=steps, batch_size=4, log_every=1)
    assert h.status == "completed" and view.finished_with == "completed"
    assert [r["step"] for r in h.steps] == list(range(1, steps + 1))  # every logged step, once, in order
    live = view.live_steps
    assert live, "the live side received nothing"
    first = live[0]["step"]
    assert [r["step"] for r in live] == sorted({r["step"] for r in live}), "duplicate or out-of-order record"
    if poll_s == 0.05:
        # a normal poll misses nothing: what arrived live is exactly the start of the final list
        assert live == h.steps[: len(live)] and first == 1
    else:
        assert view.updates < steps / 4, "the slow poll was not slow: records did not arrive in batches"


def _slow_step(model, batch):
    time.sleep(0.02)
    x, y = batch
    return F.cross_entropy(model(x), y)


def test_block_false_stop_all_ranks_at_one_step(workers, digits):
    (x, y), _ = digits
    torch.manual_seed(3)
    model = Tiny()
    initial = copy.deepcopy(model)
    opts = dict(epochs=20, batch_size=8, log_every=5, step_fn=_slow_step, live=False, seed=1)
    t0 = time.perf_counter()
    handle = nbddp.dist_fit(model, (x, y), block=False, **opts)
    assert isinstance(handle, nbddp.FitHandle)
    assert not handle.done(), "block=False must return while training runs"
    assert time.perf_counter() - t0 < 30
    with pytest.raises(TimeoutError, match=r"still running after 0.01 s; call .wait\(\) again or .stop\(\)"):
        handle.wait(timeout=0.01)
    with pytest.raises(FitRunningError, match=r"a dist_fit is still running on these workers; wait for it"):
        nbddp.dist_fit(Tiny(), (x, y), batch_size=8, live=False)
    deadline = time.monotonic() + 120
    while len(handle.history.steps) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(handle.history.steps) >= 2, "no records arrived while training"
    assert handle.status in ("training", "validating") and "step" in repr(handle)
    h = handle.stop()
    assert handle.done() and h.status == "interrupted"
    assert handle.wait() is h and handle.history is h
    per_rank = {r: res.step for r, res in handle._run.tasks.results.items()}
    stop_step = h.steps[-1]["step"]
    assert per_rank == {0: stop_step, 1: stop_step}, per_rank
    assert 0 < stop_step < 20 * (700 // 8)
    # the notebook's model holds exactly the weights of the stop step: retrain to that step and compare
    again = copy.deepcopy(initial)
    h2 = nbddp.dist_fit(again, (x, y), max_steps=stop_step, **opts)
    assert h2.status == "completed" and h2.steps[-1]["step"] == stop_step
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), name
    assert not torch.allclose(model.lin.weight, initial.lin.weight)


def test_handle_wait_returns_history_and_a_later_fit_works(workers, digits):
    (x, y), _ = digits
    handle = nbddp.dist_fit(Tiny(), (x[:256], y[:256]), batch_size=16, log_every=2, block=False, live=False)
    h = handle.wait()
    assert h.status == "completed" and h.steps[-1]["step"] == 8 and handle.done()
    assert handle.stop() is h  # stopping a finished fit just returns its History
    h2 = nbddp.dist_fit(Tiny(), (x[:256], y[:256]), batch_size=16, live=False)
    assert h2.status == "completed"


def test_stop_from_another_thread_like_the_button(workers, digits):
    """The Stop button calls run.request_stop() from the kernel's IO loop while the notebook is free."""
    (x, y), _ = digits
    handle = nbddp.dist_fit(Tiny(), (x, y), epochs=20, batch_size=8, log_every=5, step_fn=_slow_step,
                            block=False, live=False)
    while len(handle.history.steps) < 1 and not handle.done():
        time.sleep(0.05)
    clicker = threading.Thread(target=handle._run.request_stop)
    clicker.start()
    clicker.join()
    h = handle.wait(timeout=120)
    assert h.status == "interrupted"
    assert handle.status == "interrupted"
