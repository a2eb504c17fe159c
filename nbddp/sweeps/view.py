"""The sweep's live view under the cell: a leaderboard and every trial's curve, or text lines.

Drawn from the waiting cell's own thread (``call._wait`` ticks it), so no
display call comes from a background thread:

* in a Jupyter kernel (or ``live="widget"``; ``"html"`` is its old
  spelling): one output, updated in place (``display(...,
  display_id=True)`` then ``.update()``) at most ``REDRAW_S`` apart: the
  leaderboard as an HTML table (trial, parameters, metric, epoch, state,
  time; best first) and the curves overlaid as a PNG, the best in red, the
  pruned grey;
* beside it, with ipywidgets, a Stop button (wired as the fit dashboard's:
  its click calls the run's ``request_stop``, the stop of Kernel >
  Interrupt). A click reaches the kernel only while the notebook is free,
  so it acts in a ``block=False`` sweep; in a blocking cell Kernel >
  Interrupt is the stop (the button's tooltip says so). When the sweep
  ends the button is replaced by nothing, so a saved notebook keeps the
  leaderboard and curves only;
* elsewhere (a terminal, a script), or ``live="text"``: one line per
  finished trial, then nothing more (``repr(result)`` is the whole table);
* ``live=False``: nothing.
"""

from __future__ import annotations

import base64
import html
import time
from typing import TYPE_CHECKING, Any, Callable, Literal

from nbddp.live.choice import LiveChoice, resolved
from nbddp.sweeps.result import TrialRow, fmt, ranked

if TYPE_CHECKING:
    from ipywidgets import Button

    from nbddp.sweeps.scheduler import SweepRun

REDRAW_S = 0.5


def leaderboard_html(rows: list[TrialRow], metric: str, mode: str) -> str:
    """The leaderboard as an HTML table, best first (the rows of ``SweepResult.trials``)."""
    head = "".join(f"<th>{h}</th>" for h in ("trial", "parameters", html.escape(metric), "epoch", "state", "time"))
    body = []
    for r in ranked(rows, mode):
        params = ", ".join(f"{k}={fmt(v)}" for k, v in r.params.items())
        cells = [str(r.trial), params, fmt(r.value), fmt(r.epoch), r.state, f"{r.seconds:.1f} s"]
        grey = " style='color:#999'" if r.state in ("pruned", "failed", "stopped") else ""
        body.append(f"<tr{grey}>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    return f"<table class='nbddp-sweep'><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


class SweepView:
    """Shows one ``SweepRun`` as the module docstring says; ``tick`` and ``finish`` from the waiting cell."""

    def __init__(self, live: LiveChoice | Literal["html"], stop: Callable[[], None] | None = None):
        """``live`` as ``live/choice.py`` reads it (``"html"``: the notebook's view, as ``"widget"``)."""
        view = resolved("widget" if live == "html" else live)
        self.mode = {"widget": "html", "text": "text", "off": "off"}[view]
        self.handle: Any = None
        self.drawn = -1
        self.last = 0.0
        self.stop = stop
        self.stop_button: Any = None
        self.button_handle: Any = None

    def _show_stop(self) -> None:
        """The Stop button under the leaderboard, in an output of its own (removed by ``close``)."""
        try:
            import ipywidgets as w
        except ImportError:
            return
        from IPython.display import display

        self.stop_button = w.Button(description="Stop", icon="stop", button_style="warning",
                                    tooltip="Stop the sweep: no new trial, the running ones stop at their next step; "
                                            "what finished is returned. Works while the notebook is free "
                                            "(nbddp.sweep(..., block=False)); in a blocking cell use Kernel > Interrupt.")
        self.stop_button.on_click(self._on_stop)
        self.button_handle = display(self.stop_button, display_id=True)

    def _on_stop(self, _button: Button | None = None) -> None:
        """The Stop button's click (ipywidgets passes the button); shown only when there is a ``stop``."""
        self.stop_button.disabled = True
        self.stop_button.description = "Stopping..."
        if self.stop is not None:
            self.stop()

    def close(self) -> None:
        """The sweep ended: the Stop button goes (its output replaced by nothing)."""
        if self.stop_button is None:
            return
        from IPython.display import HTML

        self.button_handle.update(HTML(""))
        self.stop_button.close()
        self.stop_button = None

    def tick(self, run: SweepRun, final: bool = False) -> None:
        if self.mode == "text":
            while run.lines:
                print(run.lines.pop(0), flush=True)
            return
        run.lines.clear()
        if self.mode == "off" or run.changed == self.drawn:
            return
        if not final and time.monotonic() - self.last < REDRAW_S:
            return
        self.drawn, self.last = run.changed, time.monotonic()
        self._draw(run)

    def _draw(self, run: SweepRun) -> None:
        from IPython.display import HTML, display

        from nbddp.live.plot import figure_png
        from nbddp.sweeps.result import curves_figure

        done = [r for r in run.rows if r.state == "complete" and r.value is not None]
        best = ranked(done, run.mode)[0].trial if done else None
        png = figure_png(curves_figure(dict(run.curves), {r.trial: r.state for r in run.rows}, best, run.metric))
        page = HTML(f"<div>{leaderboard_html(list(run.rows), run.metric, run.mode)}"
                    f"<img src='data:image/png;base64,{base64.b64encode(png).decode('ascii')}'/></div>")
        if self.handle is None:
            self.handle = display(page, display_id=True)
            if self.stop is not None:
                self._show_stop()
        else:
            self.handle.update(page)
