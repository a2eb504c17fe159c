"""History: what a fit recorded, in the kernel.

Records are plain dicts so they print, pickle and go into pandas
(``pd.DataFrame(history.steps)``) without nbddp.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Sequence


@dataclass
class History:
    """The result of ``dist_fit``.

    Attributes:
        status: ``"completed"``, ``"interrupted"`` (stopped by the person) or
            ``"failed"`` (only seen on a ``FitHandle``'s partial history).
        steps: one dict per logged point: ``step`` (optimizer steps done),
            ``epoch``, ``loss`` (mean over every rank's samples since the
            previous record), ``lr``, ``samples_per_s`` (all ranks together),
            ``time`` (seconds since training began), plus any extra values a
            ``step_fn`` returned.
        epochs: one dict per finished epoch: ``epoch``, ``step``, ``loss``
            (sample-weighted mean over all ranks), and with validation data
            ``val_loss`` and ``val_<metric>``. On a stream also
            ``samples_per_rank`` (what each rank trained in that epoch) and
            ``ended_on`` (the ranks whose share of the stream ended it).
        validations: every validation pass, including those run every
            ``val_every`` steps inside an epoch.
        timings: seconds: ``ship_s`` (pickling and writing the arguments),
            ``setup_s`` (rank 0 building model, data and DDP), ``train_s`` (the
            training loop on rank 0; of it ``publish_s`` sending records to the
            kernel, the same whether ``live`` is on or off), ``return_s`` (last step to weights in the
            notebook's model; of it ``pack_s`` on rank 0 and ``load_s`` in the kernel),
            ``total_s`` (the whole call), ``overhead_s``
            (``total_s - train_s``), ``watch_cpu_s`` (the kernel's watcher thread).
        transfers: bytes shipped to each rank and returned by rank 0.
        world_size: how many ranks trained.
        batch_size: the per-rank batch size used.
        ranks: one dict per rank: ``rank``, ``host``, ``device``,
            ``samples_per_s``, ``samples`` (samples it trained in this fit),
            ``peak_mem`` (bytes: this fit's own peak, the
            CUDA peak allocated on GPU, the peak resident set on CPU, measured
            from the fit's start, after the previous task's memory was given
            back), ``base_mem`` (bytes resident, or allocated on GPU, when the
            fit began: the worker itself and what it keeps; ``peak_mem -
            base_mem`` is what the fit added), ``param_bytes`` (the parameter
            bytes that rank holds), and on GPU ``cuda_allocated``,
            ``cuda_reserved`` and ``cuda_peak``.
        model: the trained module when ``dist_fit`` was given a factory (the
            given module itself otherwise).
        stop_reason: why a stop was asked for, when one was: a callback
            (``EarlyStopping``, ``"stop"``, ``nbddp.stop_fit()``, an exception
            in a hook) or the notebook (interrupt, Stop button, ``handle.stop()``).
        best: with an ``EarlyStopping``: ``monitor``, ``mode``, ``value``,
            ``step`` and ``epoch`` of the best check, and ``restored`` (the
            model holds that check's weights).
        loggers: one dict per logger: ``logger``, ``where`` (its run),
            ``logged`` and ``missed`` records, ``error`` (the first, if any).
        errors: every logger and callback exception reported during the fit
            (``source``, ``error``, ``traceback``).
        restarts: an elastic fit's (``max_restarts``) lost ranks, one dict per
            restart: ``rank``, ``cause``, ``step_lost_at`` (the furthest step the
            kernel had seen a rank reach: records and heartbeats, which come
            about once a second), ``step_resumed_from`` (the snapshot's step; 0:
            from the start), ``replace_s`` (the lost workers replaced and the
            group formed again), ``seconds`` (from the failure seen to the
            relaunched fit ready to train on), ``time`` (when the failure was
            seen, ``time.time()``).
    """

    status: str = "completed"
    steps: list[dict[str, Any]] = field(default_factory=list)
    epochs: list[dict[str, Any]] = field(default_factory=list)
    validations: list[dict[str, Any]] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    transfers: dict[str, int] = field(default_factory=dict)
    world_size: int = 0
    batch_size: int | None = None
    ranks: list[dict[str, Any]] = field(default_factory=list)
    model: Any = field(default=None, repr=False)
    stop_reason: str | None = None
    best: dict[str, Any] | None = None
    loggers: list[dict[str, Any]] = field(default_factory=list)
    errors: list[dict[str, str]] = field(default_factory=list)
    restarts: list[dict[str, Any]] = field(default_factory=list)

    def add(self, kind: str, record: dict[str, Any]) -> None:
        """Append one worker record (``kind`` is ``step``, ``epoch`` or ``val``)."""
        target = {"step": self.steps, "epoch": self.epochs, "val": self.validations}[kind]
        target.append(record)

    @property
    def last_step(self) -> int:
        return self.steps[-1]["step"] if self.steps else 0

    def plot(self, figsize: tuple[float, float] = (6.0, 3.6)):
        """A matplotlib ``Figure`` of the training and validation loss.

        Built with ``Figure`` + Agg, never pyplot, so it is safe from any
        thread and never pops up a window.
        """
        from nbddp.live.plot import loss_figure

        return loss_figure(self.steps, self.validations, title=f"nbddp fit ({self.status})", figsize=figsize)

    def to_pandas(self) -> Any:
        """The records as pandas DataFrames: ``.steps``, ``.epochs`` and ``.validations`` (pandas imported here)."""
        from nbddp.fit.history import frames

        return frames(self)

    def __repr__(self) -> str:
        last = self.epochs[-1] if self.epochs else (self.steps[-1] if self.steps else {})
        shown = ", ".join(f"{k}={_fmt(v)}" for k, v in last.items())
        return (
            f"History(status={self.status!r}, world_size={self.world_size}, "
            f"steps={len(self.steps)} records, epochs={len(self.epochs)}, last: {shown}"
            + (f", stop_reason={self.stop_reason!r}" if self.stop_reason else "") + ")"
        )


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else repr(value)


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
