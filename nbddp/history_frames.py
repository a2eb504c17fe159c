"""A History as data: pandas DataFrames, and several fits on one figure.

pandas is imported only here, when ``History.to_pandas()`` is called;
figures are ``Figure`` + Agg (``live/compare.py``), never pyplot.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence


class HistoryFrames(NamedTuple):
    """``History.to_pandas()``: one DataFrame per kind of record (unpack it, or use the names)."""

    steps: Any
    epochs: Any
    validations: Any


def frames(history: Any) -> HistoryFrames:
    try:
        import pandas as pd
    except ImportError:
        raise ModuleNotFoundError("History.to_pandas() needs pandas: pip install pandas", name="pandas") from None
    return HistoryFrames(pd.DataFrame(history.steps, columns=_columns(history.steps, ("step", "epoch", "loss"))),
                         pd.DataFrame(history.epochs, columns=_columns(history.epochs, ("epoch", "step", "loss"))),
                         pd.DataFrame(history.validations, columns=_columns(history.validations,
                                                                            ("epoch", "step", "val_loss"))))


def _columns(records: list[dict[str, Any]], first: tuple[str, ...]) -> list[str]:
    """The records' keys in order of appearance, ``first`` first (an empty History still has its columns)."""
    seen = dict.fromkeys(first)
    for record in records:
        seen.update(dict.fromkeys(record))
    return list(seen)


def _is_history(obj: Any) -> bool:
    return all(hasattr(obj, name) for name in ("steps", "epochs", "validations", "status"))


def plot_histories(histories: Sequence[Any], labels: Sequence[str] | None = None, *, metric: str = "loss",
                   title: str = "", figsize: tuple[float, float] = (7.0, 4.0)) -> Any:
    """Several fits on one matplotlib ``Figure``: each one's training ``metric`` and, dashed, its validation.

    The notebook habit of trying two learning rates and looking::

        h1 = dist_fit(model_a, data, lr=1e-3, val_data=val)
        h2 = dist_fit(model_b, data, lr=3e-3, val_data=val)
        nbddp.plot_histories([h1, h2], labels=["lr 1e-3", "lr 3e-3"])

    Args:
        histories: ``History`` objects (``dist_fit``'s results).
        labels: one per history (default ``run 1``, ``run 2``, ...).
        metric: the step records' value to draw (``"loss"``, or a ``step_fn``'s
            extra); its ``val_<metric>`` is drawn too where validation recorded it.
        title: the figure's title.
    """
    from nbddp.live.compare import compare_figure

    histories = [histories] if _is_history(histories) else list(histories)
    if not histories or not all(_is_history(h) for h in histories):
        kinds = sorted({type(h).__name__ for h in histories if not _is_history(h)}) or ["an empty list"]
        raise TypeError(f"nbddp.plot_histories(histories) takes a list of History objects (what dist_fit returns); "
                        f"got {', '.join(kinds)}")
    labels = [f"run {i + 1}" for i in range(len(histories))] if labels is None else list(labels)
    if len(labels) != len(histories):
        raise ValueError(f"nbddp.plot_histories: {len(labels)} labels for {len(histories)} histories; give one "
                         "label per history")
    if not any(metric in r for h in histories for r in h.steps):
        raise ValueError(f"nbddp.plot_histories(metric={metric!r}): no step record holds {metric!r}; the steps hold "
                         f"{sorted({k for h in histories for r in h.steps for k in r})}")
    runs = [(str(label), h.steps, h.validations) for label, h in zip(labels, histories)]
    return compare_figure(runs, metric, title, figsize)
