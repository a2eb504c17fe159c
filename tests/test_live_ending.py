"""The dashboard's last frame (issue 22): every rank reads its final state, and no broken image before a plot.

Driven without a browser or workers: a fake run holds what the fit's watcher
thread would, and the views draw from it. As in ``nbddp.fit.fit_run.FitRun``, the last
frame is drawn before ``run.finished`` turns true.
"""

from __future__ import annotations

import io
import time

import pytest

from nbddp.protocol.errors import RankFailure, WorkerError
from nbddp.fit.history import History
from nbddp.live.state import LiveState
from nbddp.live.text import TextView, progress_line, rank_state
from nbddp.live.widget import WidgetView, rank_rows, summary_text
from nbddp.protocol.messages import FitPlanInfo, RankInfo


class Run:
    def __init__(self):
        self.history = History(world_size=2)
        self.live_state = LiveState(
            status="training", world_size=2, backend="gloo", epochs=1,
            plan=FitPlanInfo(total_steps=20, steps_per_epoch=20, start_step=0, batch_size=8),
            placements=[RankInfo(0, "node-a", "cpu", 1), RankInfo(1, "node-b", "cpu", 2)])
        self.error = None
        self.finished = False  # FitRun sets it after the view's finish()
        self.started_at = time.perf_counter()

    def step(self, n: int) -> None:
        self.history.add("step", {"step": n, "epoch": 0, "loss": 1.0 / n, "lr": 0.1, "samples_per_s": 100.0,
                                  "time": n * 0.1})
        self.live_state.positions = [{"rank": r, "phase": "backward", "step": n, "micro": 0, "idle_s": 0.0}
                                     for r in (0, 1)]
        self.live_state.stalled = [{"rank": 1, "phase": "backward", "step": n, "micro": 0, "idle_s": 12.0}]

    def request_stop(self) -> None:
        self.live_state.status = "stopping"


def _failure(rank: int) -> RankFailure:
    return RankFailure(rank, "ValueError", "bad batch", "", 10 + rank, "node")


@pytest.mark.parametrize("status, error, states", [
    ("completed", None, ["done", "done"]),
    ("interrupted", None, ["stopped", "stopped"]),
    ("failed", WorkerError(_failure(1)), ["stopped", "failed"]),
    ("failed", WorkerError(_failure(0), [_failure(1)]), ["failed", "failed"]),
    ("training", RuntimeError("the controller went away"), ["failed", "failed"]),
])
def test_every_rank_reads_its_final_state_when_the_fit_ends(status, error, states):
    run = Run()
    view = WidgetView(every=0.0, plot_every=0.0, plot_cpu_share=None)
    view.start(run)
    run.step(17)
    view.update(run)
    assert [r["at"] for r in rank_rows(run)] == ["step 17 · backward"] * 2
    assert "stalled 12 s" in view.ranks.value
    run.live_state.status, run.error = status, error
    view.finish(run)  # drawn before run.finished turns true, as FitRun does
    assert [r["at"] for r in rank_rows(run)] == states
    assert "backward" not in view.ranks.value and "stalled" not in view.ranks.value and view.stalls.value == ""
    assert all(state in view.ranks.value for state in states)
    summary = summary_text(run).splitlines()
    assert [line.rsplit("  ", 1)[-1] for line in summary if line.startswith("  rank")] == states


def test_the_text_view_ends_without_a_phase_in_flight():
    run = Run()
    out = io.StringIO()
    view = TextView(stream=out, every=0.0)
    view.start(run)
    run.step(5)
    assert "ranks 0: step 5 backward" in progress_line(run)
    run.live_state.status = "completed"
    view.finish(run)
    assert "backward" not in out.getvalue().splitlines()[-1]
    assert rank_state(run, 0, {0: {"step": 5, "phase": "backward"}}) == "done"


def test_no_image_is_shown_before_the_first_plot():
    run = Run()
    view = WidgetView(every=0.0, plot_every=0.0, plot_cpu_share=None)
    view.start(run)
    assert view.image.layout.display == "none" and not view.image.value  # an empty Image is a broken icon
    assert view.placeholder.layout.display != "none" and "appears with the first records" in view.placeholder.value
    run.step(1)
    view.update(run)
    assert bytes(view.image.value).startswith(b"\x89PNG") and view.image.layout.display is None
    assert view.placeholder.layout.display == "none"


def test_a_fit_that_recorded_nothing_ends_with_a_line_not_an_image():
    run = Run()
    view = WidgetView(every=0.0, plot_every=0.0, plot_cpu_share=None)
    view.start(run)
    run.live_state.status, run.error = "failed", WorkerError(_failure(0))
    view.finish(run)
    assert view.image.layout.display == "none" and "no loss records to plot" in view.placeholder.value
    assert "image/png" not in view._bundle(run, final=True)
