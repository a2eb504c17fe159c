"""The dashboard under a ``dist_fit`` cell (ipywidgets), with a static ending.

Layout::

    [status]  nbddp · 2 ranks · gloo
    [=========>          ] step 120/400 · epoch 1/3 · 0:12 elapsed · ETA 0:30
    loss 0.412 · val_loss 0.398 · val_acc 0.91 · lr 0.001 · 5,120 samples/s
    +-----------------------+  rank  host   device  samples/s  peak memory
    |  loss plot (PNG)      |  0     node1  cuda:0  2,560      1.2 GiB
    +-----------------------+  [Stop]

Everything is drawn from the fit's watcher thread: trait changes from a
thread reach the browser even while the cell blocks (``docs/ipyparallel-notes.md``,
"Notebooks and widgets").
Text and progress are refreshed at most ``every`` seconds. The plot is the
expensive part (20-45 ms of CPU per Agg render here), so it runs on a CPU
budget: a redraw happens only when the plot's CPU so far, plus what the last
redraw cost, stays within 1 % of the fit's elapsed time (and at most every
``plot_every`` seconds; at least every 3 s however slow drawing is). A fit of
under 2-3 s therefore draws once, at the end; a long one every 2-3 s. With
CPU workers the kernel's CPU is taken from training: on 2 cores a 2 % budget
cost the MLP benchmark 6-7 % of its throughput (a preempted rank holds up
the other at the next all-reduce), 1 % costs 1.5-2 %, as much as the text
view. One figure is kept for the whole kernel (fits never overlap).

The output is one display (``display_id``). When the fit ends, that display
is updated with the final widget AND a static PNG + text summary in the same
bundle: live frontends keep the widget, while a notebook saved by nbclient,
papermill or nbconvert (or viewed where widgets do not render) shows the
final plot and numbers instead of a frozen "0 %" bar.
"""

from __future__ import annotations

import base64
import functools
import html
import time
from typing import TYPE_CHECKING, Any

from nbddp.live.plot import LossPlot, figure_png, metrics_figure
from nbddp.live.profile_button import ProfileButton
from nbddp.live.time_bars import bar_html, rank_splits, split_html, split_sentence
from nbddp.live.text import (ended_status, fmt_bytes, fmt_time, paused_lines, progress_fields, rank_state,
                             report_text)
from nbddp.live.state import LiveState, ViewedFit
from nbddp.protocol.messages import innermost_frames

if TYPE_CHECKING:
    from IPython.display import DisplayHandle

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
STATUS_COLOURS = {"starting": "#777", "training": "#1f77b4", "validating": "#9467bd", "stopping": "#ff7f0e",
                  "stalled": "#d62728", "recovering": "#ff7f0e", "completed": "#2ca02c", "interrupted": "#ff7f0e",
                  "failed": "#d62728"}
BAR_STYLES = {"completed": "success", "interrupted": "warning", "failed": "danger"}
PLOT_CPU_SHARE = 0.01  # the plot may use at most this share of one core (on CPU workers, it is taken from them)
MAX_PLOT_INTERVAL = 3.0  # however slow the drawing, redraw at least this often
FIRST_PLOT_COST_S = 0.03  # what a redraw is assumed to cost before one was measured


def _num(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"
    return str(v)


def metrics_text(f: dict[str, Any]) -> str:
    parts = [f"loss {_num(f['loss'])}"]
    parts += [f"{k} {_num(v)}" for k, v in f["val"].items()]
    if f["lr"] is not None:
        parts.append(f"lr {f['lr']:.3g}")
    if f["samples_per_s"]:
        parts.append(f"{f['samples_per_s']:,.0f} samples/s")
    return " · ".join(parts)


def progress_text(f: dict[str, Any]) -> str:
    epochs = f["epochs"] or "?"
    epoch = min(f["epoch"] + 1, f["epochs"]) if f["epochs"] else f["epoch"] + 1
    text = f"step {f['step']}/{f['total_text']} · epoch {epoch}/{epochs} · {fmt_time(f['elapsed'])} elapsed"
    if f["eta"] is not None:
        text += f" · ETA {fmt_time(f['eta'])}"
    return text


def rank_rows(run: ViewedFit) -> list[dict[str, Any]]:
    """One row per rank: placement from the launch, figures from every rank's last report."""
    state = run.live_state
    figures = {r["rank"]: r for r in state.ranks or []}
    stalled = {s["rank"]: s for s in state.stalled}
    positions = {pos["rank"]: pos for pos in state.positions}
    ended = ended_status(run) is not None
    splits = dict(enumerate(rank_splits(run)))
    rows = []
    for p in state.placements:
        fig = figures.get(p.rank, {})
        rows.append({"rank": p.rank, "host": p.host, "device": p.device, "samples_per_s": fig.get("samples_per_s"),
                     "peak_mem": fig.get("peak_mem"), "param_bytes": fig.get("param_bytes"),
                     "cuda_reserved": fig.get("cuda_reserved"), "stalled": None if ended else stalled.get(p.rank),
                     "at": rank_state(run, p.rank, positions), "split": splits.get(p.rank)})
    return rows


RANK_COLUMNS = (("rank", "right"), ("host", "left"), ("device", "left"), ("at", "left"), ("samples/s", "right"),
                ("peak memory", "right"), ("parameters", "right"), ("time split", "left"))


def rank_table_html(rows: list[dict[str, Any]]) -> str:
    cuda = any(r.get("cuda_reserved") is not None for r in rows)
    columns = RANK_COLUMNS + ((("CUDA reserved", "right"),) if cuda else ())
    head = "".join(f"<th style='padding:0 6px;text-align:{a};white-space:nowrap'>{h}</th>" for h, a in columns)
    body = []
    for r in rows:
        sps = f"{r['samples_per_s']:,.0f}" if r["samples_per_s"] else "-"
        if r.get("stalled"):
            sps = f"<span style='color:#d62728'>stalled {r['stalled']['idle_s']:.0f} s</span>"
        cells = [(str(r["rank"]), "right"), (html.escape(str(r["host"])), "left"), (html.escape(str(r["device"])), "left"),
                 (html.escape(r.get("at", "-")), "left"), (sps, "right"), (fmt_bytes(r["peak_mem"]), "right"), (fmt_bytes(r.get("param_bytes")), "right"),
                 (bar_html(r.get("split")), "left")]
        if cuda:
            cells.append((fmt_bytes(r.get("cuda_reserved")), "right"))
        body.append("<tr>" + "".join(f"<td style='padding:0 6px;text-align:{a};white-space:nowrap'>{c}</td>"
                                     for c, a in cells) + "</tr>")
    return (f"<table class='nbddp-ranks' style='font-size:12px;border-collapse:collapse'><thead><tr>{head}</tr></thead>"
            f"<tbody>{''.join(body)}</tbody></table>")


def stalls_html(state: LiveState) -> str:
    """Each stalled rank: how long, where in the loop, and the innermost frames of its stack."""
    out = []
    for s in state.stalled:
        where = f"{html.escape(s['phase'])}" + (f" (step {s['step']}, micro-batch {s['micro']})" if s["micro"] else "")
        frames = innermost_frames(s.get("stack") or "")
        out.append(f"<div class='nbddp-stall' style='color:#d62728;font-size:12px'>rank {s['rank']} stalled "
                   f"{s['idle_s']:.0f} s in {where}</div>"
                   + (f"<pre style='font-size:11px;margin:0 0 4px 0'>{html.escape(frames)}</pre>" if frames else ""))
    return "".join(out)


def status_html(run: ViewedFit, status: str) -> str:
    state = run.live_state
    colour = STATUS_COLOURS.get(status, "#777")
    badge = (f"<span class='nbddp-status' style='background:{colour};color:white;border-radius:3px;"
             f"padding:1px 6px;font-weight:bold'>{html.escape(status)}</span>")
    where = f"nbddp · {state.world_size or '?'} rank(s) · {html.escape(state.backend or '?')}"
    if state.batch_size:
        where += f" · {state.batch_text()}"
    error = getattr(run, "error", None)
    if status == "failed" and error is not None:
        first = html.escape(str(error).splitlines()[0] if str(error) else type(error).__name__)
        where += f" · <span style='color:#d62728'>{first}</span>"
    return f"<div style='font-size:13px'>{badge} {where}</div>"


def summary_text(run: ViewedFit) -> str:
    """The plain-text ending: what a saved notebook or a terminal shows."""
    f = progress_fields(run)
    if run.live_state.kind == "report":
        lines = [f"nbddp reports {f['status']}: {report_text(run)}"]
    else:
        lines = [f"nbddp fit {f['status']}: {progress_text(f)}", metrics_text(f)]
    for r in rank_rows(run):
        sps = f"{r['samples_per_s']:,.0f}" if r["samples_per_s"] else "-"
        lines.append(f"  rank {r['rank']}  {r['host']}  {r['device']}  {sps} samples/s  peak {fmt_bytes(r['peak_mem'])}"
                     f"  params {fmt_bytes(r.get('param_bytes'))}  {r['at']}")
    sentence = split_sentence(run)
    if sentence:
        lines.append(f"time split: {sentence}")
    error = getattr(run, "error", None)
    if error is not None:
        lines.append(f"error: {str(error).splitlines()[0] if str(error) else type(error).__name__}")
    return "\n".join(lines)


def _placeholder_html(text: str) -> str:
    return f"<div style='color:#777;font-size:12px;padding:20px 0'>{html.escape(text)}</div>"


@functools.cache
def _shared_plot() -> LossPlot:
    """One figure per kernel: building one costs more than a redraw."""
    return LossPlot()


def reports_png(hist: Any, ranks: bool) -> bytes:
    """A reporting call's plot, one small plot per metric (``live/plot.py``), as PNG (a new figure: the metrics
    are known only as they come)."""
    fig = metrics_figure(hist.steps, list(getattr(hist, "metrics", [])),
                         getattr(hist, "rank_steps", None) if ranks else None, dpi=80)
    return figure_png(fig)


class WidgetView:
    """The live dashboard (see the module docstring)."""

    def __init__(self, every: float = 0.5, plot_every: float = 1.0, plot_cpu_share: float | None = PLOT_CPU_SHARE):
        """``plot_cpu_share=None`` redraws every ``plot_every`` seconds whatever it costs (tests)."""
        self.every = every
        self.plot_every = plot_every
        self.plot_cpu_share = plot_cpu_share
        self.clock = time.monotonic
        self._t_start = self.clock()
        self._last_text = 0.0
        self._last_plot = 0.0
        self._plot_cost = FIRST_PLOT_COST_S
        self._plotted = (-1, -1)  # (steps, validations) drawn last
        self._handle: DisplayHandle | None = None
        self._run: ViewedFit | None = None
        self.redraws = 0
        self.plot_cpu_s = 0.0  # CPU seconds spent drawing the plot
        self._build()

    # -- widgets -----------------------------------------------------------
    def _build(self) -> None:
        import ipywidgets as w

        self.status = w.HTML(value="<div>nbddp: starting...</div>")
        self.bar = w.FloatProgress(value=0.0, min=0.0, max=1.0, bar_style="info",
                                   layout=w.Layout(width="45%", min_width="200px"))
        self.percent = w.HTML(value="0%", layout=w.Layout(width="4em"))
        self.progress = w.HTML(value="waiting for the workers")
        self.metrics = w.HTML(value="")
        # an Image without a PNG shows as a broken image in JupyterLab: hidden, with a line in its place, until drawn
        self.image = w.Image(format="png", layout=w.Layout(width="480px", min_height="60px", display="none"))
        self.placeholder = w.HTML(value=_placeholder_html("the loss plot appears with the first records"),
                                  layout=w.Layout(width="480px"))
        self.ranks = w.HTML(value="")
        self.stalls = w.HTML(value="")
        self.stop_button = w.Button(description="Stop", icon="stop", button_style="warning",
                                    tooltip="Stop training on every rank at the same step. Works while the notebook is "
                                            "free (dist_fit(..., block=False)); in a blocking cell use Kernel > Interrupt.")
        self.stop_button.on_click(self._on_stop)
        self.profile_button = ProfileButton()
        # a call's reports (nbddp.report): each rank's own line on each metric's plot, on demand
        self.rank_lines = w.Checkbox(value=False, description="per-rank lines", indent=False,
                                     layout=w.Layout(display="none", width="auto"))
        self.rank_lines.observe(self._on_rank_lines, names="value")
        self.box = w.VBox([
            self.status,
            w.HBox([self.bar, self.percent, self.progress]),
            self.metrics,
            w.HBox([self.placeholder, self.image,
                    w.VBox([self.ranks, w.HBox([self.stop_button, self.profile_button.widget, self.rank_lines])],
                           layout=w.Layout(margin="0 0 0 12px"))],
                   layout=w.Layout(flex_flow="row wrap")),
            self.stalls,
        ])
        self.box.add_class("nbddp-dashboard")
        self.percent.add_class("nbddp-percent")
        self.image.add_class("nbddp-plot")
        self.placeholder.add_class("nbddp-plot-placeholder")

    def _on_stop(self, _button: object = None) -> None:
        run = self._run
        if run is None or run.finished:
            return
        self.stop_button.disabled = True
        self.stop_button.description = "Stopping..."
        run.request_stop()
        self.status.value = status_html(run, "stopping")

    def _on_rank_lines(self, _change: object = None) -> None:
        self._plotted = (-1, -1)  # drawn again, with or without the ranks' lines
        if self._run is not None:
            self._draw_plot(self._run)

    # -- view protocol -------------------------------------------------------
    def start(self, run: ViewedFit) -> None:
        """Called in the cell's thread: show the dashboard."""
        from IPython.display import display

        self._run = self.profile_button.run = run
        self._t_start = self.clock()
        if run.live_state.kind == "report":  # no total to count towards, nothing to profile
            self.bar.layout.display = self.percent.layout.display = "none"
            self.profile_button.widget.layout.display = "none"
            self.rank_lines.layout.display = None
            self.image.layout.width = self.placeholder.layout.width = "auto"  # a plot per metric, side by side
            self.placeholder.value = _placeholder_html("a plot per metric appears with the first reports")
        _shared_plot()  # import matplotlib and build the figure now, while the workers set up
        self.status.value = status_html(run, "starting")
        self.ranks.value = rank_table_html(rank_rows(run)) + split_html(run)
        self._handle = display(self._bundle(run, final=False), raw=True, display_id=True)

    def update(self, run: ViewedFit) -> None:
        now = self.clock()
        if now - self._last_text < self.every:
            return
        self._last_text = now
        self._draw_text(run, run.live_state.status)
        if self.plot_due(now):
            self._draw_plot(run)

    def plot_due(self, now: float) -> bool:
        """May the plot be redrawn now? (the CPU budget of the module docstring)"""
        if now - self._last_plot < self.plot_every:
            return False
        if self.plot_cpu_share is None:
            return True
        within_budget = self.plot_cpu_s + self._plot_cost <= self.plot_cpu_share * (now - self._t_start)
        return within_budget or now - max(self._last_plot, self._t_start) >= MAX_PLOT_INTERVAL

    def finish(self, run: ViewedFit) -> None:
        """The final state, whatever ended the fit; then the static fallback in the same display."""
        status = ended_status(run) or run.live_state.status
        self._draw_text(run, status)
        self._draw_plot(run)  # unless the last redraw already shows every record
        if not self.image.value:
            self.placeholder.value = _placeholder_html("no loss records to plot")
        self.bar.bar_style = BAR_STYLES.get(status, "info")
        self.stop_button.disabled = True
        self.stop_button.description = "Stop"
        self.profile_button.finish()
        if self._handle is not None:
            self._handle.update(self._bundle(run, final=True), raw=True)

    # -- drawing -------------------------------------------------------------
    def _draw_text(self, run: ViewedFit, status: str) -> None:
        f = progress_fields(run)
        if status == "completed":
            f["fraction"] = 1.0 if f["total"] and f["step"] >= f["total"] else f["fraction"]
        stalled = run.live_state.stalled if ended_status(run) is None else []
        if stalled and status in ("starting", "training", "validating"):
            status = "stalled"
        self.status.value = status_html(run, status)
        paused = paused_lines(run.live_state) if not getattr(run, "finished", False) else []
        paused += run.live_state.restarts  # an elastic fit's lost ranks, and where it resumed
        self.stalls.value = (stalls_html(run.live_state) if stalled else "") + "".join(
            f"<div class='nbddp-paused' style='color:#1f77b4;font-size:12px'>{html.escape(p)}</div>" for p in paused)
        self.bar.value = f["fraction"]
        self.percent.value = f"{f['fraction'] * 100:.0f}%"
        if run.live_state.kind == "report":
            self.progress.value = html.escape(report_text(run))
        else:
            self.progress.value = html.escape(progress_text(f))
            self.metrics.value = html.escape(metrics_text(f))
        self.ranks.value = rank_table_html(rank_rows(run)) + split_html(run)

    def _draw_plot(self, run: ViewedFit) -> None:
        hist = run.history
        drawn = (len(hist.steps), len(hist.validations))
        if drawn == self._plotted:
            return
        if not hist.steps and not hist.validations:
            return
        plot = _shared_plot()
        warm = plot.renders > 0  # a figure's first render loads fonts and caches: not what the next cost
        t0 = time.thread_time()  # CPU, not wall time: on a busy machine wall time counts other processes
        if run.live_state.kind == "report":
            self.image.value = reports_png(hist, self.rank_lines.value)
        else:
            self.image.value = plot.png(hist.steps, hist.validations)
        self.image.layout.display = None
        self.placeholder.layout.display = "none"
        cost = time.thread_time() - t0
        self.plot_cpu_s += cost
        self._plotted = drawn
        self.redraws += 1
        self._last_plot = self.clock()
        if warm:
            self._plot_cost = cost

    def _bundle(self, run: ViewedFit, final: bool) -> dict[str, Any]:
        """The display's mime bundle; the final one adds the static fallback."""
        bundle: dict[str, Any] = {WIDGET_VIEW: {"version_major": 2, "version_minor": 0, "model_id": self.box.model_id}}
        if not final:
            bundle["text/plain"] = "nbddp dashboard (needs a Jupyter frontend with ipywidgets; the final plot and summary appear here when training ends)"
            return bundle
        summary = summary_text(run)
        bundle["text/plain"] = summary
        png = bytes(self.image.value)
        if png:
            bundle["image/png"] = base64.b64encode(png).decode("ascii")
        img = f"<img src='data:image/png;base64,{bundle['image/png']}'/>" if png else ""
        bundle["text/html"] = (f"<div class='nbddp-summary'>{img}<pre>{html.escape(summary)}</pre></div>")
        return bundle
