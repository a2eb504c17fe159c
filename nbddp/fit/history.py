"""History: what a fit recorded, in the kernel.

Records are plain dicts so they print, pickle and go into pandas
(``pd.DataFrame(history.steps)``) without nbddp.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from pandas import DataFrame
    from typing_extensions import TypeIs


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
            (``total_s - train_s``), ``watch_cpu_s`` (the kernel's watcher thread);
            with a synchronous callback, ``answer_wait_s`` (of ``train_s``: rank 0
            waiting for ``on_epoch_end``'s answers) and ``answer_points``.
        transfers: bytes shipped to each rank and returned by rank 0.
        world_size: how many ranks trained.
        batch_size: the per-rank batch size used.
        global_batch_size: the samples of one optimizer step over every
            data-parallel rank: ``batch_size`` x those ranks x ``grad_accum``
            (what Keras under ``tf.distribute`` calls the batch size).
        ranks: one dict per rank: ``rank``, ``host``, ``device``,
            ``samples_per_s``, ``samples`` (samples it trained in this fit),
            ``peak_mem`` (bytes: this fit's own peak, the
            CUDA peak allocated on GPU, the peak resident set on CPU, measured
            from the fit's start, after the previous task's memory was given
            back), ``base_mem`` (bytes resident, or allocated on GPU, when the
            fit began: the worker itself and what it keeps),
            ``fit_peak_mem`` (``peak_mem - base_mem``: what the fit itself
            added, the same whatever ran before), ``param_bytes`` (the parameter
            bytes that rank holds), and on GPU ``cuda_allocated``,
            ``cuda_reserved`` and ``cuda_peak``; ``time_split``: seconds of
            the training loop per phase (``data``, ``forward``, ``backward``,
            ``optimizer``, ``communication``, ``wait`` for a slower rank,
            ``validation``, ``checkpoint``, ``other``), see ``time_split()``.
            With ``compile=...`` also ``compile_s`` (seconds that rank spent
            in Dynamo and Inductor) and ``compile_cache_hits`` (graphs it
            found compiled already).
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
        compile_report: with ``dist_fit(compile=...)``, one dict per rank:
            ``rank``, ``compiles``, ``recompiles`` and their ``reasons`` (as
            Dynamo gives them), ``graph_breaks``, ``compile_s``, ``cache_hits``.
        profile: with ``dist_fit(profile=...)``: ``path`` (the merged
            Chrome/Perfetto trace, one process lane per rank), ``ranks`` (those
            it holds), ``top_ops`` (per rank: the operators with the most self
            time) and ``summary`` (the same in words).
        restarts: an elastic fit's (``max_restarts``) lost ranks, one dict per
            restart: ``rank``, ``cause``, ``step_lost_at`` (the furthest step the
            kernel had seen a rank reach: records and heartbeats, which come
            about once a second), ``step_resumed_from`` (the snapshot's step; 0:
            from the start), ``replace_s`` (the lost workers replaced and the
            group formed again), ``seconds`` (from the failure seen to the
            relaunched fit ready to train on), ``time`` (when the failure was
            seen, ``time.time()``). A lost Slurm job (every rank: ``rank`` is
            None) adds ``job``, ``new_job`` and ``resumed_from``, and its
            ``cause`` is Slurm's state (``NODE_FAIL``, ``PREEMPTED``...).
        metrics: a call that reported (``nbddp.report``): the names it
            reported, in the order they first came; ``steps`` holds one
            record per step, each value reduced over the ranks as asked
            (``samples`` summed, ``samples_per_s`` derived), ``time`` in
            seconds since the first report.
        rank_steps: a call that reported: each rank's own values, one dict
            per rank and step (``step``, ``rank``, the values, and
            ``samples_per_s`` when ``samples`` was reported).
    """

    status: str = "completed"
    steps: list[dict[str, Any]] = field(default_factory=list)
    epochs: list[dict[str, Any]] = field(default_factory=list)
    validations: list[dict[str, Any]] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    transfers: dict[str, int] = field(default_factory=dict)
    world_size: int = 0
    batch_size: int | None = None
    global_batch_size: int | None = None
    ranks: list[dict[str, Any]] = field(default_factory=list)
    model: Any = field(default=None, repr=False)
    stop_reason: str | None = None
    best: dict[str, Any] | None = None
    loggers: list[dict[str, Any]] = field(default_factory=list)
    errors: list[dict[str, str]] = field(default_factory=list)
    compile_report: list[dict[str, Any]] = field(default_factory=list)
    profile: dict[str, Any] | None = None
    restarts: list[dict[str, Any]] = field(default_factory=list)
    metrics: list[str] = field(default_factory=list)
    rank_steps: list[dict[str, Any]] = field(default_factory=list)

    def add(self, kind: str, record: dict[str, Any]) -> None:
        """Append one worker record (``kind`` is ``step``, ``epoch`` or ``val``)."""
        target = {"step": self.steps, "epoch": self.epochs, "val": self.validations}[kind]
        target.append(record)

    def records(self) -> list[tuple[str, dict[str, Any]]]:
        """Every record as ``(kind, record)``: the steps, then the epochs, then the validations."""
        return ([("step", r) for r in self.steps] + [("epoch", r) for r in self.epochs]
                + [("val", r) for r in self.validations])

    @property
    def history(self) -> dict[str, list[Any]]:
        """Keras's ``History.history``: each value of the epochs as a list, one entry per finished epoch.

        ``history.history["loss"]``, ``["val_loss"]``, ``["val_<metric>"]``:
        every key the epoch records hold but ``epoch`` and ``step``, in the
        order they first appear; None where an epoch lacks one.
        """
        keys = dict.fromkeys(k for record in self.epochs for k in record if k not in ("epoch", "step"))
        return {k: [record.get(k) for record in self.epochs] for k in keys}

    @property
    def last_step(self) -> int:
        return self.steps[-1]["step"] if self.steps else 0

    def plot(self, figsize: tuple[float, float] | None = None, ax: Axes | None = None, ranks: bool = False) -> Any:
        """The training and validation loss: a matplotlib ``Figure``, or drawn on ``ax`` (which is returned).

        A call that reported (``nbddp.report``, ``metrics`` not empty): one
        small plot per metric, and with ``ranks=True`` each rank's own line.

        The figure shows as an image as a cell's last value in any Jupyter
        kernel (it has a ``_repr_png_``); it is built with ``Figure`` + Agg,
        never pyplot, so it is safe from any thread and never pops up a
        window. ``ax=`` draws into a person's own axes, as pandas' ``plot`` does.
        """
        from nbddp.live.plot import loss_figure, metrics_figure

        if self.metrics and ax is None:
            return metrics_figure(self.steps, self.metrics, self.rank_steps if ranks else None,
                                  title=f"nbddp reports ({self.status})", figsize=figsize)
        return loss_figure(self.steps, self.validations, title=f"nbddp fit ({self.status})",
                           figsize=figsize or (6.0, 3.6), ax=ax)

    def to_pandas(self) -> Any:
        """Every record in one DataFrame, with a ``kind`` column: ``"step"``, ``"epoch"`` or ``"val"``.

        ``df[df.kind == "epoch"]`` is the epochs; ``to_frames()`` gives the
        three kinds as separate DataFrames. pandas is imported here.
        """
        from nbddp.fit.history import one_frame

        return one_frame(self)

    def to_frames(self) -> Any:
        """The records as three pandas DataFrames: ``.steps``, ``.epochs`` and ``.validations``."""
        from nbddp.fit.history import frames

        return frames(self)

    def time_split(self) -> Any:
        """Where each rank's training time went: a pandas DataFrame, one row per rank.

        Seconds per phase, ``total``, each phase's ``<phase>_share`` and the
        ``efficiency`` (the compute share: forward, backward, optimizer).
        ``.attrs["summary"]`` names the slowest rank, why, who waits for it,
        and the largest share that is not compute (the text view prints it).
        """
        from nbddp.profiling.time_split import split_frame

        return split_frame(self.ranks)

    def __repr__(self) -> str:
        last = self.epochs[-1] if self.epochs else (self.steps[-1] if self.steps else {})
        shown = ", ".join(f"{k}={_fmt(v)}" for k, v in last.items())
        return (
            f"History(status={self.status!r}, world_size={self.world_size}, "
            f"steps={len(self.steps)} records, epochs={len(self.epochs)}, last: {shown}"
            + (f", stop_reason={self.stop_reason!r}" if self.stop_reason else "") + ")"
        )


def _fmt(value: object) -> str:
    return f"{value:.4g}" if isinstance(value, float) else repr(value)


class HistoryFrames(NamedTuple):
    """``History.to_frames()``: one DataFrame per kind of record (unpack it, or use the names)."""

    steps: DataFrame
    epochs: DataFrame
    validations: DataFrame


def _pandas(what: str) -> Any:
    try:
        import pandas as pd
    except ImportError:
        raise ModuleNotFoundError(f"History.{what}() needs pandas: pip install pandas", name="pandas") from None
    return pd


def one_frame(history: History) -> DataFrame:
    """``History.to_pandas()``: steps, epochs and validations in one DataFrame, told apart by ``kind``."""
    pd = _pandas("to_pandas")
    rows = [{"kind": kind, **r} for kind, records in (("step", history.steps), ("epoch", history.epochs),
                                                      ("val", history.validations)) for r in records]
    return pd.DataFrame(rows, columns=_columns(rows, ("kind", "step", "epoch", "loss")))


def frames(history: History) -> HistoryFrames:
    pd = _pandas("to_frames")
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


def _is_history(obj: object) -> TypeIs[History]:
    """A ``History``, or anything that reads as one (the records and the status)."""
    return all(hasattr(obj, name) for name in ("steps", "epochs", "validations", "status"))


def plot_histories(histories: History | Sequence[History], labels: Sequence[str] | None = None, *,
                   metric: str = "loss", title: str = "", figsize: tuple[float, float] = (7.0, 4.0)) -> Any:
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

    given: list[History] = [histories] if _is_history(histories) else list(histories)
    if not given or not all(_is_history(h) for h in given):
        kinds = sorted({type(h).__name__ for h in given if not _is_history(h)}) or ["an empty list"]
        raise TypeError(f"nbddp.plot_histories(histories) takes a list of History objects (what dist_fit returns); "
                        f"got {', '.join(kinds)}")
    labels = [f"run {i + 1}" for i in range(len(given))] if labels is None else list(labels)
    if len(labels) != len(given):
        raise ValueError(f"nbddp.plot_histories: {len(labels)} labels for {len(given)} histories; give one "
                         "label per history")
    if not any(metric in r for h in given for r in h.steps):
        raise ValueError(f"nbddp.plot_histories(metric={metric!r}): no step record holds {metric!r}; the steps hold "
                         f"{sorted({k for h in given for r in h.steps for k in r})}")
    runs = [(str(label), h.steps, h.validations) for label, h in zip(labels, given)]
    return compare_figure(runs, metric, title, figsize)
