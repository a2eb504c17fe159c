"""Loggers for ``dist_fit(loggers=[...])``: TensorBoard, W&B, MLflow and CSV, written once from the kernel.

``"tensorboard"``, ``"wandb"``, ``"mlflow"`` and ``"csv"`` name each with its
defaults; ``TensorBoard(log_dir=...)``, ``WandB(project=...)``,
``MLflow(tracking_uri=..., experiment=...)`` and ``CSV(path)`` take settings;
``Logger`` is the base class of a logger of your own. The backends are the
``nbddp[loggers]`` extra, imported only by the logger that uses them, and
only in the kernel. See ``docs/loggers.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeAlias, Union

from nbddp.loggers.base import Logger, metrics_of
from nbddp.loggers.csv_file import CSV
from nbddp.loggers.mlflow_run import MLflow
from nbddp.loggers.tboard import TensorBoard
from nbddp.loggers.wandb_run import WandB

NAMES = {"tensorboard": TensorBoard, "wandb": WandB, "mlflow": MLflow, "csv": CSV}
#: one of ``dist_fit(loggers=[...])``: a name in ``NAMES`` or a ``Logger`` object
LoggerChoice: TypeAlias = Union[str, Logger]


def resolve(loggers: LoggerChoice | Sequence[LoggerChoice] | None) -> list[Logger]:
    """``dist_fit(loggers=...)`` as logger objects; unknown names and other objects raise here, before training."""
    if loggers is None:
        return []
    items = [loggers] if isinstance(loggers, (str, Logger)) else loggers
    if not isinstance(items, (list, tuple)):
        raise TypeError(f"dist_fit(loggers=...) takes a list of loggers, got {type(loggers).__name__} {loggers!r}")
    out: list[Logger] = []
    for item in items:
        if isinstance(item, str):
            if item.lower() not in NAMES:
                raise ValueError(f"dist_fit(loggers=[{item!r}]): unknown logger name; the names are "
                                 f"{', '.join(repr(n) for n in NAMES)}, or pass a logger object "
                                 "(nbddp.loggers.TensorBoard(log_dir=...), WandB(project=...), ...)")
            item = NAMES[item.lower()]()
        elif not isinstance(item, Logger):
            what = f"the class {item.__name__}" if isinstance(item, type) else f"{type(item).__name__} {item!r}"
            raise TypeError(f"dist_fit(loggers=[...]) takes the names {', '.join(repr(n) for n in NAMES)} or "
                            f"nbddp.loggers.Logger objects (TensorBoard(...), WandB(...), MLflow(...), CSV(...) or a "
                            f"subclass of your own); got {what}" + (". HINT: call it: TensorBoard()"
                                                                     if isinstance(item, type) else ""))
        if any(item is seen for seen in out):
            raise ValueError(f"dist_fit(loggers=[...]) lists the same logger object twice ({item!r}); one run per "
                             "logger: pass it once, or two objects with their own settings")
        out.append(item)
    return out


__all__ = ["Logger", "TensorBoard", "WandB", "MLflow", "CSV", "metrics_of", "resolve"]
