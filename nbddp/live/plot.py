"""The loss plot, drawn with ``Figure`` + Agg (thread-safe, never pyplot).

``loss_figure`` builds a fresh figure (``History.plot()``); ``LossPlot``
keeps one figure alive and only swaps the line data, which the dashboard
redraws from its background thread (a redraw costs ~20 ms of CPU here, most
of it laying out tick labels; building a new figure costs several times more,
and the first figure of a process ~0.5 s with the matplotlib import).
"""

from __future__ import annotations

import functools
import io
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

MAX_POINTS = 600  # the train line is thinned to about this many points: a plot is ~600 px wide


def _thin(records: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    stride = max(1, -(-len(records) // MAX_POINTS))
    picked = records[::stride]
    if records and picked[-1] is not records[-1]:
        picked.append(records[-1])  # always show the latest point
    return [r["step"] for r in picked], [r[key] for r in picked]


def _style(ax: Axes) -> None:
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)


def shown_figure(figsize: tuple[float, float], dpi: int = 100) -> Figure:
    """A ``Figure`` (Agg canvas, no pyplot) that a plain Jupyter kernel displays as an image.

    IPython shows a figure as a PNG only when matplotlib's inline backend
    registered a formatter for it, which happens once pyplot is imported; a
    figure made without pyplot showed as ``<Figure size 600x360 with 1 Axes>``.
    A ``_repr_png_`` needs no backend (and where the formatter exists, it wins:
    one image either way).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = _shown_figure_class()(figsize=figsize, dpi=dpi)
    FigureCanvasAgg(fig)
    return fig


@functools.lru_cache(maxsize=1)
def _shown_figure_class() -> type[Figure]:
    """Made on first use: importing matplotlib costs ~0.5 s, and importing nbddp must stay instant."""
    from matplotlib.figure import Figure

    class ShownFigure(Figure):
        def _repr_png_(self) -> bytes:
            return figure_png(self)

    return ShownFigure


def loss_figure(steps: list[dict[str, Any]], validations: list[dict[str, Any]], title: str = "",
                figsize: tuple[float, float] = (6.0, 3.6), ax: Axes | None = None) -> Figure | Axes:
    """The loss curves on a new figure (returned), or on ``ax`` (returned, as pandas' ``plot(ax=...)`` does)."""
    if ax is not None:
        _draw_losses(ax, steps, validations, title)
        return ax
    fig = shown_figure(figsize)
    _draw_losses(fig.add_subplot(1, 1, 1), steps, validations, title)
    fig.tight_layout()
    return fig


def _draw_losses(ax: Axes, steps: list[dict[str, Any]], validations: list[dict[str, Any]], title: str) -> None:
    if steps:
        ax.plot(*_thin(steps, "loss"), label="train loss", color="#1f77b4", lw=1.4)
    if validations:
        ax.plot([r["step"] for r in validations], [r["val_loss"] for r in validations], "o-",
                label="val loss", color="#d62728", lw=1.4, ms=4)
    _style(ax)
    if title:
        ax.set_title(title, fontsize=10)
    if steps or validations:
        ax.legend(loc="upper right", fontsize=8)


def figure_png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


class LossPlot:
    """One figure, redrawn in place: ``png(steps, validations)`` -> PNG bytes.

    The dashboard keeps one per kernel. Fits do not overlap, but one fit's
    final redraw may meet the next fit's first, so redraws take a lock.
    """

    def __init__(self, figsize: tuple[float, float] = (6.0, 3.2), dpi: int = 80):
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        self.fig = Figure(figsize=figsize, dpi=dpi)
        FigureCanvasAgg(self.fig)
        self.ax = self.fig.add_subplot(1, 1, 1)
        (self.train,) = self.ax.plot([], [], label="train loss", color="#1f77b4", lw=1.4)
        (self.val,) = self.ax.plot([], [], "o-", label="val loss", color="#d62728", lw=1.4, ms=4)
        _style(self.ax)
        self.ax.legend(loc="upper right", fontsize=8)
        self.title = self.ax.set_title("", fontsize=10)
        # tick labels are most of a redraw's cost (text layout): four per axis suit a 480 px plot
        self.ax.locator_params(nbins=4)
        # fixed margins: tight_layout on every redraw would double its cost
        self.fig.subplots_adjust(left=0.11, right=0.97, top=0.9, bottom=0.15)
        self.renders = 0
        self._lock = threading.Lock()

    def png(self, steps: list[dict[str, Any]], validations: list[dict[str, Any]], title: str = "") -> bytes:
        with self._lock:
            self.train.set_data(*_thin(steps, "loss"))
            self.val.set_data([r["step"] for r in validations], [r["val_loss"] for r in validations])
            self.title.set_text(title)
            self.ax.relim()
            self.ax.autoscale_view()
            buf = io.BytesIO()
            self.fig.savefig(buf, format="png", pil_kwargs={"compress_level": 1})
            self.renders += 1
            return buf.getvalue()


RANK_STYLE = {"lw": 0.9, "ls": "--", "alpha": 0.75}
PLOTTED_SKIPPED = ("samples",)  # summed sample counts: their rate is shown as samples/s instead


def plotted_metrics(names: list[str]) -> list[str]:
    """The reported names that get a curve each."""
    return [n for n in names if n not in PLOTTED_SKIPPED]


def metrics_figure(steps: list[dict[str, Any]], names: list[str], rank_steps: list[dict[str, Any]] | None = None,
                   title: str = "", figsize: tuple[float, float] | None = None, dpi: int = 100) -> Figure:
    """One small plot per reported metric (each on its own scale), each rank's own line too when ``rank_steps``.

    What a call that reports (``nbddp.report``) draws, live and in
    ``History.plot()``: loss, accuracy and a learning rate differ by orders of
    magnitude, so one shared axis would flatten all but the largest.
    """
    shown = plotted_metrics(names) or ["(no metric)"]
    cols = min(len(shown), 3)
    rows = -(-len(shown) // cols)
    fig = shown_figure(figsize or (3.2 * cols, 2.3 * rows + (0.3 if title else 0.0)), dpi=dpi)
    ranks = sorted({r["rank"] for r in rank_steps}) if rank_steps else []
    for i, name in enumerate(shown):
        ax = fig.add_subplot(rows, cols, i + 1)
        points = [r for r in steps if name in r]
        if points:
            ax.plot(*_thin(points, name), color="#1f77b4", lw=1.4, label="reduced" if ranks else None)
        for rank in ranks:
            own = [r for r in rank_steps or () if r["rank"] == rank and name in r]
            if own:
                ax.plot(*_thin(own, name), label=f"rank {rank}", **RANK_STYLE)  # type: ignore[arg-type]
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.locator_params(nbins=4)
        ax.grid(alpha=0.3)
        if ranks and i == 0:
            ax.legend(fontsize=7, loc="best")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig
