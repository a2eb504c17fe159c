"""What a sweep gives back: every trial's row and ``History``, the best trial's values and weights.

The leaderboard (the live text view and ``repr``) is drawn from the same
rows as ``SweepResult.trials``, so what was shown is what is returned.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

COLUMNS = ("trial", "params", "value", "epoch", "state", "seconds", "rank", "error")


@dataclass
class TrialRow:
    """One trial as the leaderboard shows it (``state``: running, complete, pruned, failed, stopped)."""

    trial: int
    params: dict[str, Any]
    state: str = "running"
    value: float | None = None
    epoch: int | None = None
    seconds: float = 0.0
    group: int = 0
    rank: int | None = None  # the rank that failed
    error: str = ""  # the failed rank's exception and remote traceback

    def as_dict(self) -> dict[str, Any]:
        return {"trial": self.trial, **{f"params_{k}": v for k, v in self.params.items()}, "value": self.value,
                "epoch": self.epoch, "state": self.state, "seconds": self.seconds, "group": self.group,
                "rank": self.rank, "error": self.error}


def fmt(v: object) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def line(row: TrialRow, metric: str) -> str:
    """One leaderboard line: trial, parameters, metric, epoch, state, time."""
    params = " ".join(f"{k}={fmt(v)}" for k, v in row.params.items())
    return (f"trial {row.trial:>3}  {params}  {metric} {fmt(row.value)}  epoch {fmt(row.epoch)}  {row.state}  "
            f"{row.seconds:.1f} s")


def ranked(rows: list[TrialRow], mode: str) -> list[TrialRow]:
    """Completed trials best first, then the others by trial number."""
    scored = [(r.value, r) for r in rows if r.state == "complete" and r.value is not None]
    scored.sort(key=lambda pair: pair[0] if mode == "min" else -pair[0])
    done = [r for _, r in scored]
    return done + sorted((r for r in rows if r not in done), key=lambda r: r.trial)


@dataclass
class SweepResult:
    """The result of ``nbddp.sweep``.

    Attributes:
        trials: a pandas DataFrame, one row per trial of this call: ``trial``
            (Optuna's number), ``params_<name>``, ``value`` (the metric's last
            value), ``epoch``, ``state`` (``complete``, ``pruned``, ``failed``,
            ``stopped``), ``seconds``, ``group`` (which workers ran it), and for
            a failed trial ``rank`` and ``error`` (the remote traceback).
        best_params, best_value: of the best completed trial (of the study, so a
            resumed sweep counts the trials done before); ``{}``/None if none.
        histories: trial number -> that trial's ``History``.
        best_model: the best trial's weights, in the notebook's ``model`` object,
            or a module built by the factory with the best parameters.
        study: the ``optuna.Study`` (its visualisations: ``optuna.visualization``).
        status: ``"completed"``, or ``"interrupted"`` when a stop ended it early.
    """

    rows: list[TrialRow]
    metric: str
    mode: str
    study: Any
    histories: dict[int, Any] = field(default_factory=dict)
    best_model: Any = None
    status: str = "completed"

    @property
    def trials(self) -> Any:
        import pandas as pd

        return pd.DataFrame([r.as_dict() for r in sorted(self.rows, key=lambda r: r.trial)])

    @property
    def best_params(self) -> dict[str, Any]:
        return dict(self._best.params) if self._best is not None else {}

    @property
    def best_value(self) -> float | None:
        return self._best.value if self._best is not None else None

    @property
    def _best(self) -> Any:
        try:
            return self.study.best_trial
        except ValueError:  # no trial of the study completed
            return None

    def leaderboard(self) -> str:
        """The leaderboard as text: best first."""
        head = f"nbddp sweep: {len(self.rows)} trials, {self.metric} ({self.mode}), {self.status}"
        return "\n".join([head, *(line(r, self.metric) for r in ranked(self.rows, self.mode))])

    def __repr__(self) -> str:
        return self.leaderboard()

    def curves(self) -> dict[int, list[tuple[int, float]]]:
        """Trial number -> ``(step, metric)`` at each epoch end and validation."""
        out = {}
        for row in self.rows:
            history = self.histories.get(row.trial)
            records = [*history.validations, *history.epochs] if history is not None else []
            out[row.trial] = sorted({r["step"]: r[self.metric] for r in records if self.metric in r}.items())
        return out

    def plot(self, kind: str = "curves", figsize: tuple[float, float] = (6.0, 3.6), params: list[str] | None = None
             ) -> Any:
        """A matplotlib ``Figure``.

        ``kind="curves"``: every trial's metric curve, the best highlighted, pruned ones grey.
        ``kind="parallel"``: parallel coordinates of the parameters (``params``, default all) against the metric, over
        the study's completed trials: Optuna's own ``optuna.visualization.matplotlib.plot_parallel_coordinate``
        (matplotlib only, no plotly). Optuna's other plots take ``result.study`` the same way.
        """
        if kind == "curves":
            best = self._best.number if self._best is not None else None
            return curves_figure(self.curves(), {r.trial: r.state for r in self.rows}, best, self.metric, figsize)
        if kind == "parallel":
            return self._parallel(figsize, params)
        raise ValueError(f"SweepResult.plot(kind={kind!r}) must be 'curves' (every trial's {self.metric} by step) or "
                         "'parallel' (parameters against the metric)")

    def _parallel(self, figsize: tuple[float, float], params: list[str] | None) -> Any:
        import warnings

        import matplotlib.pyplot as plt
        from matplotlib.figure import Figure
        from optuna.exceptions import ExperimentalWarning
        from optuna.trial import TrialState
        from optuna.visualization.matplotlib import plot_parallel_coordinate

        if not self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            raise ValueError("SweepResult.plot(kind='parallel') needs at least one completed trial, and this study has "
                             f"none (states here: {sorted({r.state for r in self.rows}) or 'no trials'}); plot the "
                             "curves with plot() instead")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ExperimentalWarning)  # Optuna's matplotlib plots are marked experimental
            ax = plot_parallel_coordinate(self.study, params=params, target_name=self.metric)
        fig = ax.figure
        assert isinstance(fig, Figure), "Optuna draws the plot on a figure of its own"
        fig.set_size_inches(*figsize)
        plt.close(fig)  # returned, not left to pyplot: a notebook shows it once, as it does History.plot()'s
        return fig


def curves_figure(curves: dict[int, list[tuple[int, float]]], states: dict[int, str], best: int | None, metric: str,
                  figsize: tuple[float, float] = (6.0, 3.6)) -> Any:
    """Every trial's curve overlaid: the best in red and thick, pruned trials grey (``Figure`` + Agg, thread-safe).

    An image as a cell's value in any kernel, as ``History.plot()``'s is (``live.plot.shown_figure``).
    """
    from nbddp.live.plot import shown_figure

    fig = shown_figure(figsize)
    ax = fig.add_subplot(1, 1, 1)
    for trial, points in curves.items():
        if not points:
            continue
        xs, ys = zip(*points)
        style = {"color": "#d62728", "lw": 2.5, "zorder": 3} if trial == best else (
            {"color": "#bbbbbb", "lw": 1} if states.get(trial) in ("pruned", "pruning") else {"lw": 1})
        ax.plot(xs, ys, marker=".", label=f"trial {trial} (best)" if trial == best else None, **style)
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.grid(alpha=0.3)
    if best is not None and curves.get(best):
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
