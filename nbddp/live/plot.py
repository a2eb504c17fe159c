"""The loss plot, drawn with ``Figure`` + Agg (thread-safe, never pyplot)."""

from __future__ import annotations

import io
from typing import Any


def loss_figure(steps: list[dict[str, Any]], validations: list[dict[str, Any]], title: str = "",
                figsize: tuple[float, float] = (6.0, 3.6)) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    if steps:
        ax.plot([r["step"] for r in steps], [r["loss"] for r in steps], label="train loss", color="#1f77b4", lw=1.4)
    if validations:
        ax.plot([r["step"] for r in validations], [r["val_loss"] for r in validations], "o-",
                label="val loss", color="#d62728", lw=1.4, ms=4)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    if title:
        ax.set_title(title, fontsize=10)
    if steps or validations:
        ax.legend(loc="upper right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def figure_png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()
