"""The merged profiler trace drawn as a timeline: a lane per rank, its steps above its operators.

For a look without Perfetto or TensorBoard (a saved notebook, a page in the
docs): ``timeline_figure(history.profile["path"])``. Beside each lane, a
stacked bar of that rank's breakdown over its traced steps (compute,
communication, memory copies, idle: ``profiling/trace_analysis.py``, as the
summary prints it), so the ranks compare at a glance. Built with ``Figure`` +
Agg, never pyplot, like every nbddp plot.

It lives in ``live/`` because it draws: ``profiling/`` measures and imports
nothing of ``live/``; this module reads its breakdown from there.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes

from nbddp.live.plot import shown_figure
from nbddp.profiling.trace_analysis import trace_breakdown

KINDS = (("communication", "#9467bd", ("all_reduce", "allreduce", "gloo", "nccl", "c10d", "broadcast")),
         ("backward", "#2ca02c", ("Backward", "backward")),
         ("optimizer", "#17becf", ("Optimizer", "optim")),
         ("forward and other operators", "#1f77b4", ("",)))

DRAWN = ("aten::", "c10d::", "gloo:", "nccl:", "Optimizer.", "autograd::engine::evaluate_function")
SHARE_COLOURS = {"compute": "#1f77b4", "communication": "#9467bd", "memory": "#ff7f0e", "idle": "#dddddd"}


def kind_of(name: str) -> str:
    return next(kind for kind, _, keys in KINDS if any(k in name for k in keys))


def timeline_figure(path: str, figsize: tuple[float, float] = (10.0, 2.6)) -> Any:
    """A matplotlib ``Figure`` of the trace at ``path`` (``History.profile["path"]``), time in ms.

    An image as a cell's value in any kernel, as ``History.plot()``'s is (``shown_figure``).
    """
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    ranks = sorted({e["pid"] for e in events if isinstance(e.get("pid"), int)})
    fig = shown_figure(figsize)
    ax, bars = fig.subplots(1, 2, sharey=True, gridspec_kw={"width_ratios": [6, 1]})
    colours = {kind: colour for kind, colour, _ in KINDS}
    drawn: set[str] = set()
    for lane, rank in enumerate(ranks):
        mine = [e for e in events if e["pid"] == rank]
        steps = [(e["ts"] / 1000, e["dur"] / 1000) for e in mine if e["name"].startswith("ProfilerStep#")]
        ax.broken_barh(steps, (lane * 2 + 1.05, 0.7), facecolors="#dddddd", edgecolors="#888888", linewidth=0.5)
        for kind in colours:
            spans = [(e["ts"] / 1000, e["dur"] / 1000) for e in mine
                     if e["name"].startswith(DRAWN)
                     and kind_of(e["name"]) == kind]
            if spans:
                ax.broken_barh(spans, (lane * 2 + 0.15, 0.8), facecolors=colours[kind], alpha=0.6,
                               label=None if kind in drawn else kind)
                drawn.add(kind)
    ax.set_yticks([lane * 2 + 0.9 for lane in range(len(ranks))], [f"rank {r}" for r in ranks])
    ax.set_xlabel("ms (steps in grey above each rank's operators)")
    ax.set_ylim(0, max(1, len(ranks)) * 2)
    if drawn:
        ax.legend(fontsize=7, loc="upper right", ncol=len(drawn))
    breakdown_bars(bars, trace_breakdown(events), ranks)
    fig.tight_layout()
    return fig


def breakdown_bars(ax: Axes, breakdown: dict[int, dict[str, Any]], ranks: list[int]) -> None:
    """One stacked bar a rank, beside its lane: the shares of its traced steps by kind, adding up to 1."""
    for lane, rank in enumerate(ranks):
        left = 0.0
        for kind, colour in SHARE_COLOURS.items():
            share = breakdown.get(rank, {}).get(f"{kind}_share", 0.0)
            ax.barh(lane * 2 + 0.9, share, left=left, height=1.2, color=colour, label=kind if lane == 0 else None)
            left += share
    ax.set_xlim(0, 1)
    ax.set_xticks([0, 0.5, 1], ["0", "50 %", "100 %"], fontsize=7)
    ax.tick_params(axis="y", left=False, labelleft=False)
    ax.set_title("breakdown", fontsize=8)
    ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.02, 0.5), frameon=False)
