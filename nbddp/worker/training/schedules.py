"""When a learning-rate scheduler steps: as its own docs say, unless the person says otherwise.

torch's examples write ``StepLR(step_size=30)`` meaning 30 *epochs*; HF's
``get_*_schedule_with_warmup`` (a ``LambdaLR``) and ``OneCycleLR`` count
optimizer *steps*. Stepping all of them after every optimizer step (nbddp's
old default) decayed a copied ``StepLR`` 30 steps in, and broke
``ReduceLROnPlateau``, whose ``step()`` needs the monitored value. So:

* ``scheduler_interval="step" | "epoch"`` (or a Lightning-style dict) decides;
* otherwise the scheduler's class does: the step-counting kinds per step,
  the epoch-counting kinds per epoch, anything else per epoch (Lightning's
  default) with a one-line notice saying so;
* ``ReduceLROnPlateau`` steps once per epoch with the epoch record's
  monitored value (reduced over every rank, so every rank steps alike).
"""

from __future__ import annotations

import math
from typing import Any

from torch.optim import lr_scheduler as torch_schedulers

#: built from a number of optimizer steps: HF's warmup schedules are LambdaLRs
PER_STEP = ("OneCycleLR", "LambdaLR", "CyclicLR")
#: written in epochs in torch's own docs and examples
PER_EPOCH = ("StepLR", "MultiStepLR", "ExponentialLR", "CosineAnnealingLR", "ReduceLROnPlateau",
             "CosineAnnealingWarmRestarts")


def _kind(scheduler: Any) -> str:
    """The torch class a scheduler is (or derives from), by name; ``""`` for none of the known ones."""
    for cls in type(scheduler).__mro__:
        if cls.__name__ in PER_STEP + PER_EPOCH and cls.__module__.startswith("torch."):
            return cls.__name__
    return ""


def choose_interval(scheduler: Any, asked: str | None) -> tuple[str, str]:
    """``(interval, notice)``: what the person asked, else what the scheduler's kind says.

    The notice is empty unless nbddp had to guess (a scheduler of a kind it
    does not know): then it says which interval it chose and how to choose.
    """
    kind = _kind(scheduler)
    if kind == "ReduceLROnPlateau" and asked == "step":
        raise ValueError("dist_fit(scheduler_interval='step') with ReduceLROnPlateau: its step() needs the monitored "
                         "value, which nbddp reduces over every rank once per epoch; use scheduler_interval='epoch' "
                         "(or leave it out)")
    if asked is not None:
        return asked, ""
    if kind in PER_STEP:
        return "step", ""
    if kind in PER_EPOCH:
        return "epoch", ""
    return "epoch", (f"nbddp: the scheduler {type(scheduler).__qualname__} is stepped once per epoch (nbddp cannot "
                     "tell whether it counts epochs or optimizer steps); pass scheduler_interval='step' to step it "
                     "after every optimizer step")


def is_plateau(scheduler: Any) -> bool:
    return isinstance(scheduler, torch_schedulers.ReduceLROnPlateau)


def monitored_value(record: dict[str, Any], monitor: str | None) -> float:
    """The value ``ReduceLROnPlateau`` steps on: ``monitor`` of the epoch record (default ``val_loss``, else ``loss``)."""
    name = monitor or ("val_loss" if "val_loss" in record else "loss")
    if name not in record:
        shown = sorted(k for k in record if isinstance(record[k], (int, float)))
        raise ValueError(f"the scheduler monitors {name!r}, which the epoch record does not hold; it holds {shown}. "
                         f"Name one of them in scheduler={{'scheduler': ..., 'monitor': ...}}, or pass val_data=... "
                         f"for val_loss")
    value = float(record[name])
    return value if math.isfinite(value) else math.inf


class Schedule:
    """A rank's scheduler and when it steps; ``frequency``: every k-th step or epoch."""

    def __init__(self, scheduler: Any, interval: str, frequency: int = 1, monitor: str | None = None):
        self.scheduler, self.interval, self.frequency, self.monitor = scheduler, interval, frequency, monitor

    def after_optimizer_step(self, step: int) -> None:
        """``step``: optimizer steps done, this one included."""
        if self.interval == "step" and step % self.frequency == 0:
            self.scheduler.step()

    def after_epoch(self, epochs_done: int, record: dict[str, Any]) -> None:
        if self.interval != "epoch" or epochs_done % self.frequency:
            return
        if is_plateau(self.scheduler):
            self.scheduler.step(monitored_value(record, self.monitor))
        else:
            self.scheduler.step()
