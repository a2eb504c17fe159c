"""``nbddp.report`` and ``nbddp.should_stop``: any loop's metrics in dist_fit's view, History, loggers and stop.

On the suite's 2 CPU workers: ``%%ddp`` cells, ``nbddp.run`` and scripts that
report; the reduction checked against each rank's own values; the stop agreed
through the reports (Kernel > Interrupt, the Stop button, ``EarlyStopping``).
The rules that need no engine (the channel, the collector) are tested
without one at the end.
"""

from __future__ import annotations

import csv
import io
import threading
import time
import warnings

import pytest

import nbddp
from interrupts import interrupt_when
from nbddp.cells import reported_call
from nbddp.live.text import TextView
from nbddp.live.widget import WidgetView
from nbddp.protocol.notices import NbddpWarning
from nbddp.protocol.reports import ReportBatch, ReportRecord
from nbddp.reports.collector import ReportCollector
from nbddp.worker.engine.report_channel import ReportChannel

pytestmark = pytest.mark.timeout(300)

LOOP = """
import torch, nbddp
for step in range(1, 13):
    loss = torch.tensor(1.0 / step + 0.1 * rank)
    nbddp.report(step, loss=loss, acc=0.5 + 0.01 * step * (rank + 1), samples=4)
"""


@pytest.fixture
def views(monkeypatch):
    """Every view a reporting call made, drawing at every tick (no throttling)."""
    made: list[object] = []

    def choose(live):
        view = WidgetView(every=0.0, plot_every=0.0, plot_cpu_share=None) if live == "widget" else \
            TextView(stream=io.StringIO(), every=0.0)
        made.append(view)
        return view

    monkeypatch.setattr(reported_call, "choose_view", choose)
    real_init = reported_call.ReportedRun.__init__

    def remember(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        RUNS.append(self)

    monkeypatch.setattr(reported_call.ReportedRun, "__init__", remember)
    RUNS.clear()
    return made


RUNS: list[reported_call.ReportedRun] = []  # the reporting calls of the running test (the views fixture)


def _mean_of_ranks(history, name):
    by_step: dict[int, list[float]] = {}
    for row in history.rank_steps:
        by_step.setdefault(row["step"], []).append(row[name])
    return {step: sum(v) / len(v) for step, v in by_step.items()}


# ---- a %%ddp loop that reports -----------------------------------------------------------
def test_a_cell_that_reports_shows_the_text_view_and_its_history_is_the_ranks_mean(ip, workers, views, tmp_path):
    ip.user_ns["report_hooks"] = [nbddp.loggers.CSV(tmp_path / "m.csv")]
    ip.run_cell_magic("ddp", "--hooks report_hooks", LOOP)
    history = nbddp.last_history()
    assert history is not None and history.status == "completed"
    assert [r["step"] for r in history.steps] == list(range(1, 13))
    assert history.metrics == ["loss", "acc", "samples"]
    for name in ("loss", "acc"):
        means = _mean_of_ranks(history, name)
        for record in history.steps:
            assert record[name] == pytest.approx(means[record["step"]], abs=1e-6)
    assert {(r["step"], r["rank"]) for r in history.rank_steps} == {(s, k) for s in range(1, 13) for k in (0, 1)}
    assert all(r["samples"] == 8 for r in history.steps)  # summed over the ranks
    text = views[-1].stream.getvalue()
    assert "what 2 rank(s) report" in text and "[completed]  step 12 · loss" in text and "acc" in text
    with open(tmp_path / "m.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["kind"] == "step"]
    assert [int(r["step"]) for r in rows] == list(range(1, 13))
    for row, record in zip(rows, history.steps):
        assert float(row["loss"]) == pytest.approx(record["loss"], abs=1e-6)
        assert float(row["acc"]) == pytest.approx(record["acc"], abs=1e-6)


def test_the_widget_draws_a_plot_per_metric_and_each_ranks_lines_on_demand(workers, views):
    nbddp.run_cell(LOOP, live="widget")
    view = views[-1]
    assert isinstance(view, WidgetView)
    assert bytes(view.image.value).startswith(b"\x89PNG")
    assert "step 12 · loss" in view.progress.value and "acc" in view.progress.value
    assert view.bar.layout.display == "none" and view.rank_lines.layout.display is None
    plain = bytes(view.image.value)
    view.rank_lines.value = True  # the checkbox: drawn again with every rank's own line
    assert bytes(view.image.value) != plain
    history = nbddp.last_history()
    fig = history.plot(ranks=True)
    assert [ax.get_title() for ax in fig.axes] == ["loss", "acc"]
    assert len(fig.axes[0].lines) == 3  # the reduced line and one per rank
    frame = history.to_pandas()
    assert list(frame[frame.kind == "step"].step) == list(range(1, 13))


def test_a_cell_that_reports_nothing_shows_nothing_and_keeps_the_last_history(ip, workers, views):
    ip.run_cell_magic("ddp", "", LOOP)
    before = nbddp.last_history()
    ip.run_cell_magic("ddp", "", "x = rank")
    assert views and len(views) == 1 and nbddp.last_history() is before


def test_run_returns_the_ranks_values_with_the_history_and_reduce_picks_the_reduction(workers, views):
    def loop():
        import torch.distributed as dist

        r = dist.get_rank()
        for step in range(1, 4):
            nbddp.report(loss=float(r + step))  # step=None counts from 1
            nbddp.report(step, reduce="sum", tokens=10 * (r + 1))
            nbddp.report(step, reduce="max", peak=float(r))
            nbddp.report(step, reduce=None, seed=float(100 + r))
        return r

    out = nbddp.run(loop)
    assert out == [0, 1] and isinstance(out, list)
    history = out.history
    assert history is nbddp.last_history()
    assert [(r["step"], r["loss"], r["tokens"], r["peak"], r["seed"]) for r in history.steps] == [
        (1, 1.5, 30, 1.0, 100.0), (2, 2.5, 30, 1.0, 100.0), (3, 3.5, 30, 1.0, 100.0)]


def test_a_script_that_reports_runs_unchanged_under_run_script(workers, views, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import nbddp, torch.distributed as dist\n"
                      "dist.init_process_group('gloo')\n"
                      "for step in range(5):\n"
                      "    nbddp.report(step, loss=float(dist.get_rank() + step))\n")
    results = nbddp.run_script(script)
    assert [r.exit_code for r in results] == [0, 0]
    assert [r["loss"] for r in results.history.steps] == [0.5, 1.5, 2.5, 3.5, 4.5]


# ---- the stop, agreed through the reports ----------------------------------------------------
STOPPABLE = """
import time, nbddp
stopped_at = None
for step in range(1, 100000):
    time.sleep(0.005)
    nbddp.report(step, loss=1.0 / step)
    if nbddp.should_stop():
        stopped_at = step
        break
"""


def _reported(n):
    """The running call's History holds ``n`` steps (the ranks are in their loop)."""
    return lambda: bool(RUNS) and len(RUNS[-1].history.steps) >= n


def test_kernel_interrupt_stops_a_loop_that_asks_should_stop_on_both_ranks_at_one_step(ip, workers, views):
    with interrupt_when(_reported(5)), pytest.raises(KeyboardInterrupt, match="same step") as caught:
        ip.run_cell_magic("ddp", "", STOPPABLE)
    stopped = nbddp.pull("stopped_at", ranks=[0, 1])["stopped_at"]
    assert stopped[0] is not None and stopped[0] == stopped[1]
    history = caught.value.history
    assert history.status == "interrupted" and history.last_step == stopped[0]
    ip.run_cell_magic("ddp", "", "after = rank")  # the workers were not touched
    assert nbddp.pull("after", ranks=[0, 1]) == {"after": [0, 1]}


def test_the_stop_button_ends_a_loop_at_one_step_and_the_call_returns(workers, views):
    def click():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not _reported(5)():
            time.sleep(0.02)
        views[-1]._on_stop()

    clicker = threading.Thread(target=click, daemon=True)
    clicker.start()
    nbddp.run_cell(STOPPABLE, live="widget")
    clicker.join(10)
    stopped = nbddp.pull("stopped_at", ranks=[0, 1])["stopped_at"]
    assert stopped[0] is not None and stopped[0] == stopped[1]
    history = nbddp.last_history()
    assert history.status == "interrupted" and history.last_step == stopped[0]
    assert "Stop button" in history.stop_reason


def test_early_stopping_on_a_reported_metric_ends_the_loop_on_every_rank(workers, views):
    def loop():
        import time

        for step in range(1, 100000):
            time.sleep(0.005)
            nbddp.report(step, val=1.0 if step > 3 else 1.0 / step)  # stops improving after step 3
            if nbddp.should_stop():
                return step
        return None

    stopper = nbddp.EarlyStopping(monitor="val", patience=3)
    out = nbddp.run(loop, callbacks=[stopper])
    assert out[0] is not None and out[0] == out[1]
    assert stopper.stopped_at == 6 and "did not improve" in out.history.stop_reason


# ---- bad input -------------------------------------------------------------------------------
BAD = """
import torch, nbddp
refused = []
for call in (lambda: nbddp.report(1, name="adam"), lambda: nbddp.report(1, grads=torch.ones(3)),
             lambda: nbddp.report(1, reduce="median", loss=1.0)):
    try:
        call()
    except (TypeError, ValueError) as exc:
        refused.append(str(exc))
nbddp.report(2, loss=2.0)
try:
    nbddp.report(1, loss=1.0)
except ValueError as exc:
    refused.append(str(exc))
nbddp.report(3, loss=3.0)
"""


def test_bad_reports_are_refused_at_the_call_naming_the_metric_and_the_loop_goes_on(ip, workers, views):
    ip.run_cell_magic("ddp", "", BAD)
    refused = nbddp.pull("refused", rank=1)["refused"]
    assert "report(name=...): got str 'adam'" in refused[0]
    assert "report(grads=...): a tensor of shape (3,)" in refused[1]
    assert "reduce='median'" in refused[2] and "loss" in refused[2]
    assert "step=1" in refused[3] and "reported step 2 already" in refused[3] and "loss" in refused[3]
    assert [(r["step"], r["loss"]) for r in nbddp.last_history().steps] == [(2, 2.0), (3, 3.0)]


def test_an_uncaught_bad_report_fails_the_cell_naming_rank_and_metric(ip, workers, views):
    with pytest.raises(nbddp.WorkerError, match=r"report\(loss=\.\.\.\): got str"):
        ip.run_cell_magic("ddp", "", "import nbddp\nnbddp.report(loss='high')")


def test_two_ranks_reporting_different_names_at_a_step_are_told_naming_both(workers, views):
    cell = ("import nbddp\nfor step in range(3):\n"
            "    nbddp.report(step, loss=1.0, **({'acc': 0.5} if rank == 1 else {}))")
    with pytest.warns(NbddpWarning, match=r"rank 0 reported \['loss'\] and rank 1 reported \['acc', 'loss'\]"):
        nbddp.run_cell(cell)
    assert [r["acc"] for r in nbddp.last_history().steps] == [0.5, 0.5, 0.5]  # over the ranks that reported it


def test_hooks_name_a_notebook_variable_that_exists(ip, workers):
    from IPython.core.error import UsageError

    with pytest.raises(UsageError, match="no variable named 'nope'"):
        ip.run_cell_magic("ddp", "--hooks nope", "x = 1")
    ip.user_ns["bad_hooks"] = {"loggers": [], "callback": []}
    with pytest.raises(ValueError, match="keys are 'loggers' and 'callbacks'"):
        ip.run_cell_magic("ddp", "--hooks bad_hooks", "x = 1")


def test_run_refuses_hooks_without_blocking(workers):
    with pytest.raises(ValueError, match="block=False.*no loggers"):
        nbddp.run(print, block=False, callbacks=[nbddp.EarlyStopping("loss")])


# ---- without an engine -------------------------------------------------------------------------
def test_outside_nbddp_report_does_nothing_and_should_stop_is_false():
    nbddp.report(loss="not even checked")  # no task of nbddp's: nothing happens, nothing is refused
    assert nbddp.should_stop() is False


def test_the_channel_merges_one_step_and_refuses_bad_input_keeping_nothing_of_it():
    sent: list[ReportBatch] = []
    channel = ReportChannel(0, lambda data: sent.append(next(iter(data.values()))), None)
    channel.report(None, "mean", {"loss": 1})
    channel.report(1, "sum", {"n": 2})
    with pytest.raises(TypeError, match="report\\(\\) was given no metric"):
        channel.report(None, "mean", {})
    with pytest.raises(TypeError, match=r"step=-1"):
        channel.report(-1, "mean", {"loss": 1.0})
    with pytest.raises(ValueError, match="a tensor of shape"):
        import torch

        channel.report(2, "mean", {"ok": 1.0, "bad": torch.zeros(2, 2)})
    channel.close()
    final = sent[-1]
    assert final.final and [(seq, *r) for seq, r in final.window if type(r) is tuple] == [  # plain tuples
        (0, 1, final.window[0][1][1], {"loss": 1.0, "n": 2.0}, {"loss": "mean", "n": "sum"})]


def _batch(rank, records, final=False):
    return ReportBatch(rank, len(records), list(enumerate(records)), final)


def test_the_collector_reduces_a_step_once_every_rank_went_past_it():
    c = ReportCollector([0, 1])
    c.take(_batch(0, [ReportRecord(1, 10.0, {"loss": 1.0}), ReportRecord(2, 11.0, {"loss": 2.0})]))
    assert c.ready() == ([], [])  # rank 1 said nothing yet
    c.take(_batch(1, [ReportRecord(1, 10.0, {"loss": 3.0})]))
    assert c.ready() == ([], [])  # rank 1 may still add to step 1
    c.take(_batch(1, [ReportRecord(1, 10.0, {"loss": 3.0}), ReportRecord(2, 11.5, {"loss": 4.0})]))
    reduced, rows = c.ready()
    assert [(r["step"], r["loss"]) for r in reduced] == [(1, 2.0)] and len(rows) == 2
    c.ended(0)
    c.ended(1)
    assert [(r["step"], r["loss"], r["time"]) for r in c.ready()[0]] == [(2, 3.0, 1.5)]


def test_a_rank_that_never_reports_is_left_out_after_a_while():
    now = [0.0]
    c = ReportCollector([0, 1], clock=lambda: now[0])
    c.take(_batch(0, [ReportRecord(1, 0.0, {"loss": 1.0}), ReportRecord(2, 0.1, {"loss": 2.0})]))
    assert c.ready()[0] == []
    now[0] = 5.0  # rank 1 reports nothing (accelerate logs from rank 0 only)
    assert [r["loss"] for r in c.ready()[0]] == [1.0]


def test_samples_per_second_is_each_ranks_rate_summed():
    c = ReportCollector([0, 1])
    c.take(_batch(0, [ReportRecord(1, 0.0, {"samples": 4}), ReportRecord(2, 0.5, {"samples": 4})], final=True))
    c.take(_batch(1, [ReportRecord(1, 0.0, {"samples": 4}), ReportRecord(2, 1.0, {"samples": 4})], final=True))
    reduced, rows = c.ready()
    assert reduced[1]["samples_per_s"] == pytest.approx(8.0 + 4.0) and reduced[1]["samples"] == 8
    assert [r["samples_per_s"] for r in rows[2:]] == [8.0, 4.0]


def test_mismatched_names_are_told_once_per_pair(recwarn):
    c = ReportCollector([0, 1])
    c.take(_batch(0, [ReportRecord(s, s, {"loss": 1.0}) for s in (1, 2)], final=True))
    c.take(_batch(1, [ReportRecord(s, s, {"loss": 1.0, "acc": 1.0}) for s in (1, 2)], final=True))
    with warnings.catch_warnings(record=True) as told:
        warnings.simplefilter("always")
        c.ready()
    assert len([w for w in told if issubclass(w.category, NbddpWarning)]) == 1 and c.mismatches == 2


def test_reduce_checks_name_the_metrics():
    from nbddp.protocol.reports import check_reduce, metric_value

    with pytest.raises(ValueError, match="reduce='median'.*for loss, acc"):
        check_reduce("median", ["loss", "acc"])
    assert metric_value("x", True) == 1.0 and metric_value("x", 3) == 3.0
    with pytest.raises(TypeError, match=r"report\(x=...\): got NoneType"):
        metric_value("x", None)


def test_a_loop_that_asks_but_does_not_stop_is_interrupted_after_the_grace(ip, workers, views, monkeypatch):
    monkeypatch.setattr(reported_call, "STOP_GRACE_S", 1.0)  # the setting, lowered: 10 s by default
    cell = ("import time, nbddp\nfor step in range(1, 100000):\n    time.sleep(0.005)\n"
            "    nbddp.report(step, loss=1.0)\n    nbddp.should_stop()  # asked, and ignored")
    with interrupt_when(_reported(5)), pytest.raises(KeyboardInterrupt, match="interrupted on every rank"):
        ip.run_cell_magic("ddp", "", cell)
    assert nbddp.last_history().status == "interrupted"


def test_a_framework_logging_an_earlier_step_joins_the_latest():
    from nbddp.worker.engine.report_channel import OPEN
    from nbddp.worker.tasks.report_loggers import report_numbers

    channel = ReportChannel(0, None, None)  # as a task opens it (nothing to publish to outside an engine)
    OPEN.append(channel)
    try:
        report_numbers({"loss": 1.0, "note": "text"}, 5, "mean")
        report_numbers({"val_loss": 2.0}, 3, "mean")  # Lightning's validation, logged at an earlier step
        report_numbers({"only": "text"}, 6, "mean")   # nothing numeric: nothing reported
    finally:
        OPEN.remove(channel)
    assert [(step, values) for step, _, values, _ in channel.records] == [(5, {"loss": 1.0, "val_loss": 2.0})]


def test_phase_seconds_reported_give_the_time_split(workers, views):
    def loop():
        import torch.distributed as dist

        slow = 2.0 if dist.get_rank() == 1 else 1.0
        for step in range(1, 5):
            nbddp.report(step, loss=1.0, time_data=0.01 * slow, time_forward=0.02, time_backward=0.03,
                         time_optimizer=0.01)

    history = nbddp.run(loop).history
    split = history.time_split()
    assert list(split.index) == [0, 1]
    assert split.loc[1, "data"] == pytest.approx(0.08) and split.loc[0, "data"] == pytest.approx(0.04)
    assert split.loc[0, "forward"] == pytest.approx(0.08)
    assert "time_forward" in history.metrics  # the phase seconds are metrics too (their mean over the ranks)


def test_a_call_that_does_not_block_keeps_its_reports_and_stops_at_one_step(workers, views):
    def loop():
        import time

        for step in range(1, 100000):
            time.sleep(0.005)
            nbddp.report(step, loss=1.0 / step)
            if nbddp.should_stop():
                return step
        return None

    handle = nbddp.run(loop, block=False)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not _reported(5)():
        time.sleep(0.02)
    stopped = handle.stop()
    assert stopped[0] is not None and stopped[0] == stopped[1]
    assert handle.history is nbddp.last_history() and handle.history.last_step == stopped[0]
    assert handle.history.status == "interrupted" and not views  # no view: the cell that made it has moved on


def test_inside_dist_fit_report_does_nothing(workers, views):
    import torch

    def step_fn(model, batch):
        x, y = batch
        loss = torch.nn.functional.mse_loss(model(x), y)
        nbddp.report(loss=loss)  # dist_fit records its own values: return extras from step_fn instead
        assert nbddp.should_stop() is False
        return loss

    x = torch.randn(32, 2)
    history = nbddp.dist_fit(torch.nn.Linear(2, 1), (x, x[:, :1]), max_steps=2, batch_size=8, step_fn=step_fn,
                             live=False)
    assert history.status == "completed" and not history.metrics and not views


def test_a_report_with_no_metric_and_hooks_on_a_call_not_waited_for_are_refused():
    """Two refusals that need no engine: report() naming no value, and run(block=False) given loggers/callbacks
    (their records are fed while a cell waits)."""
    from nbddp.worker.engine.report_channel import OPEN

    channel = ReportChannel(0, None, None)
    OPEN.append(channel)
    try:
        with pytest.raises(TypeError, match=r"nbddp.report\(\) was given no metric: name each value, e.g. "
                                            r"report\(loss=loss\)"):
            nbddp.report(3)
    finally:
        OPEN.remove(channel)
    assert channel.records == []
    with pytest.raises(ValueError, match=r"nbddp.run\(block=False\) takes no loggers= or callbacks= yet: .*"
                                         r"Use block=True, or call nbddp.last_history\(\)"):
        nbddp.run(print, block=False, callbacks=[nbddp.EarlyStopping(monitor="loss")])
