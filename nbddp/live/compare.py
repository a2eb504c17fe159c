"""Several fits' curves on one figure (``nbddp.plot_histories``), drawn with ``Figure`` + Agg."""

from __future__ import annotations

from typing import Any

from nbddp.live.plot import MAX_POINTS


def _points(records: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    picked = [r for r in records if isinstance(r.get(key), (int, float))]
    stride = max(1, -(-len(picked) // MAX_POINTS))
    thinned = picked[::stride] + ([picked[-1]] if picked and (len(picked) - 1) % stride else [])
    return [r["step"] for r in thinned], [r[key] for r in thinned]


def compare_figure(runs: list[tuple[str, list[dict[str, Any]], list[dict[str, Any]]]], metric: str = "loss",
                   title: str = "", figsize: tuple[float, float] = (7.0, 4.0)) -> Any:
    """One line per run (label, steps, validations): the training ``metric`` solid, ``val_<metric>`` dashed."""
    from nbddp.live.plot import shown_figure

    fig = shown_figure(figsize)  # shows as an image in a plain Jupyter kernel
    ax = fig.add_subplot(1, 1, 1)
    for i, (label, steps, validations) in enumerate(runs):
        color = f"C{i % 10}"
        ax.plot(*_points(steps, metric), color=color, lw=1.4, label=f"{label} (train)")
        val_x, val_y = _points(validations, f"val_{metric}")
        if val_x:
            ax.plot(val_x, val_y, "o--", color=color, lw=1.2, ms=4, label=f"{label} (val)")
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig
