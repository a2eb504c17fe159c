"""``EarlyStopping``: stop a fit when the monitored value stops improving.

The decision is the workers' (``worker/training/early_stop.py``): every rank
holds each check's reduced value and stops after exactly the check where
the patience runs out, whatever the machine's speed, with
``status="completed"`` and ``History.stop_reason`` saying why. In the kernel
this callback keeps the same count from the records, for ``History.best``.
A check is a validation pass for a ``val_*`` value, an epoch's end otherwise. With
``restore_best=True`` the workers keep the best check's weights
(``worker/training/best_weights.py``) and end with them, so the notebook's model gets those.
"""

from __future__ import annotations

import numbers
from typing import Any

from nbddp.callbacks.base import Callback, Record, stop_fit
from nbddp.loggers.fit_info import FitInfo
from nbddp.protocol.fit_options import MODES, BestSpec, Patience

MAX_WORDS = ("acc", "auc", "f1", "precision", "recall", "iou")  # mode="auto": higher is better for these


class EarlyStopping(Callback):
    """``dist_fit(..., callbacks=[nbddp.EarlyStopping(patience=3)])``.

    Args:
        monitor: the record value to watch: ``"val_loss"``, ``"val_<metric>"``
            (checked at every validation pass, including ``val_every``'s), or
            ``"loss"`` (the epoch's training loss, checked at each epoch's end).
        mode: ``"min"`` (lower is better), ``"max"``, or ``"auto"`` (Keras's:
            ``"max"`` for a monitor naming accuracy, AUC, F1, precision,
            recall or IoU, else ``"min"``).
        patience: checks without improvement before the fit stops.
        min_delta: how much a value must beat the best by to count as better.
        restore_best: end with the best check's weights (every rank, so also
            ``keep=``'s module), instead of those of the step the fit stopped at.
            ``restore_best_weights`` (Keras's name) is the same setting.
        baseline: Keras's: a value to beat; checks that do not beat it count
            against the patience from the first one on.
        check_finite: Lightning's: stop at once when the value is NaN or inf.

    After the fit, ``History.best`` holds ``monitor``, ``value``, ``step`` and
    ``epoch`` of the best check, and whether its weights were restored.
    """

    def __init__(self, monitor: str = "val_loss", mode: str = "min", patience: int = 3, min_delta: float = 0.0,
                 restore_best: bool = False, *, restore_best_weights: bool | None = None,
                 baseline: float | None = None, check_finite: bool = True):
        if not isinstance(monitor, str) or not monitor:
            raise TypeError(f"EarlyStopping(monitor=...) names a recorded value such as 'val_loss'; got {monitor!r}")
        if mode == "auto":
            mode = "max" if any(k in monitor for k in MAX_WORDS) else "min"
        if mode not in MODES:
            raise ValueError(f"EarlyStopping(mode=...) must be 'min' (lower is better), 'max' or 'auto'; got {mode!r}")
        restore_best = restore_best or bool(restore_best_weights)
        if baseline is not None and (isinstance(baseline, bool) or not isinstance(baseline, numbers.Real)):
            raise TypeError(f"EarlyStopping(baseline=...) is a value of the monitor to beat, a number; got {baseline!r}")
        if isinstance(patience, bool) or not isinstance(patience, numbers.Integral) or patience < 1:
            raise ValueError(f"EarlyStopping(patience=...) is a number of checks, an int >= 1; got {patience!r}")
        if isinstance(min_delta, bool) or not isinstance(min_delta, numbers.Real) or not min_delta >= 0:
            raise ValueError(f"EarlyStopping(min_delta=...) must be a number >= 0; got {min_delta!r}")
        if not isinstance(restore_best, bool):
            raise TypeError(f"EarlyStopping(restore_best=...) must be True or False; got {restore_best!r}")
        if not isinstance(check_finite, bool):
            raise TypeError(f"EarlyStopping(check_finite=...) must be True or False; got {check_finite!r}")
        self.spec: BestSpec = BestSpec(monitor, mode, float(min_delta), int(patience),
                                       None if baseline is None else float(baseline), check_finite)
        self.patience: int = int(patience)
        self.restore_best: bool = restore_best
        self.each_report: bool = False  # a call's reports (nbddp.report): each step holding the monitor is a check
        self._reset()

    @property
    def monitor(self) -> str:
        return self.spec.monitor

    def _reset(self) -> None:
        self.count = Patience(self.spec)  # the workers' rule, kept here from the records (History.best)
        self.best_epoch: int | None = None
        self.checks = 0
        self.stopped_at: int | None = None

    @property
    def best(self) -> float | None:
        return self.count.best

    @property
    def best_step(self) -> int | None:
        return self.count.best_step

    @property
    def wait(self) -> int:
        """Checks since the best one."""
        return self.count.wait

    def check_fit(self, known: set[str] | None, has_val: bool) -> None:
        """Raise before training when this fit will never record ``monitor``.

        ``known``: every value the fit's checks record, or None when a
        ``step_fn`` may add ``val_*`` values of its own.
        """
        m = self.monitor
        if m.startswith("val_") and not has_val:
            raise ValueError(f"EarlyStopping(monitor={m!r}) watches validation, but the fit has no val_data; pass "
                             "val_data=..., or monitor='loss' (the epoch's training loss)")
        if known is not None and m not in known:
            raise ValueError(f"EarlyStopping(monitor={m!r}): this fit records {sorted(known)} at its checks, not "
                             f"{m!r}. A metric needs metrics={{'{m.removeprefix('val_')}': fn}} and val_data=...")

    def on_fit_start(self, info: FitInfo) -> None:
        self._reset()

    def on_record(self, record: Record) -> None:
        if self.each_report:
            self._on_report(record)
            return None
        if record.kind != self.spec.kind:
            return None
        value = record.get(self.monitor)
        if not isinstance(value, numbers.Real):
            held = sorted(k for k in record if k not in ("step", "epoch"))
            raise KeyError(f"EarlyStopping(monitor={self.monitor!r}): the {record.kind} records hold {held}")
        self.checks += 1
        before = self.count.best_step
        ended = self.count.after_check(float(value), record["step"])
        if self.count.best_step != before:
            self.best_epoch = record.get("epoch")
        if ended is not None and self.stopped_at is None:
            self.stopped_at = record["step"]  # the workers stopped right after this check
        return None

    def _on_report(self, record: Record) -> None:
        """A reported step: a check when it holds the monitor; "stop" (the call stops) once the patience ran out."""
        value = record.get(self.monitor)
        if not isinstance(value, numbers.Real):
            return None
        self.checks += 1
        ended = self.count.after_check(float(value), record["step"])
        if ended is not None and self.stopped_at is None:
            self.stopped_at = record["step"]
            stop_fit(ended)  # History.stop_reason says why
        return None

    def summary(self) -> dict[str, Any]:
        """What ``History.best`` holds."""
        return {"monitor": self.monitor, "mode": self.spec.mode, "value": self.best, "step": self.best_step,
                "epoch": self.best_epoch, "checks": self.checks, "stopped_at": self.stopped_at, "restored": False}

    def __repr__(self) -> str:
        return (f"EarlyStopping(monitor={self.monitor!r}, mode={self.spec.mode!r}, patience={self.patience}, "
                f"min_delta={self.spec.min_delta}, restore_best={self.restore_best})")
