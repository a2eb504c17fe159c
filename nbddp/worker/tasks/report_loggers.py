"""Lightning's and accelerate's logging, reported to nbddp's live view: the one documented line each.

* ``Fabric(loggers=nbddp.lightning_logger())`` and
  ``Trainer(logger=nbddp.lightning_logger())``: a Lightning ``Logger``; every
  rank's ``log_metrics`` reports (Lightning calls every logger on every
  rank; its own loggers keep rank 0's), so ``self.log(...)`` without
  ``sync_dist`` is still shown as the mean over the ranks;
* ``Accelerator(log_with=nbddp.accelerate_tracker())``: an accelerate
  tracker; ``accelerator.log`` runs on the main process only, so rank 0's
  values are shown as they are (``reduce=None``).

Both report numbers only (text is skipped, as a tracker would show it
elsewhere), at the framework's step, never before this rank's last one
(a validation logged at an earlier step joins the latest). Outside nbddp
they do nothing. The classes are made on first use: they subclass the
framework's own, and nbddp imports no framework until asked.
"""

from __future__ import annotations

import numbers
import sys
from typing import Any

from nbddp.protocol.reports import is_tensor
from nbddp.worker.engine.report_channel import OPEN

_MADE: dict[str, type] = {}


def report_numbers(values: dict[str, Any], step: int | None, reduce: str | None) -> None:
    """Report the numbers (and one-element tensors) among ``values`` at ``step`` (None: the next)."""
    if not OPEN:
        return
    numbers_only = {k: v for k, v in values.items()
                    if isinstance(v, numbers.Real) or (is_tensor(v) and v.numel() == 1)}
    if not numbers_only:
        return
    channel = OPEN[-1]
    if step is not None and channel.last_step is not None:
        step = max(int(step), channel.last_step)
    channel.report(step, reduce, numbers_only)


def _lightning_base() -> type:
    """The Lightning ``Logger`` class the person's Lightning accepts (the unified package, or the standalone ones)."""
    if "pytorch_lightning" in sys.modules and "lightning" not in sys.modules:
        from pytorch_lightning.loggers import Logger as PLLogger

        return PLLogger
    try:
        from lightning.pytorch.loggers import Logger

        return Logger
    except ImportError:
        from lightning.fabric.loggers import Logger as FabricLogger

        return FabricLogger


def lightning_logger() -> Any:
    """A Lightning ``Logger`` for ``Fabric(loggers=...)`` or ``Trainer(logger=...)``: logged metrics shown live."""
    if "lightning" not in _MADE:
        base = _lightning_base()

        class NbddpLightningLogger(base):  # type: ignore[valid-type, misc]
            """Reports what Lightning logs to nbddp's live view (``nbddp.report``)."""

            @property
            def name(self) -> str:
                return "nbddp"

            @property
            def version(self) -> str:
                return "0"

            def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
                pass

            def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
                report_numbers(metrics, step, "mean")

        _MADE["lightning"] = NbddpLightningLogger
    return _MADE["lightning"]()


def accelerate_tracker() -> Any:
    """An accelerate tracker for ``Accelerator(log_with=...)``: ``accelerator.log(...)`` shown live."""
    if "accelerate" not in _MADE:
        from accelerate.tracking import GeneralTracker

        class NbddpTracker(GeneralTracker):
            """Reports ``accelerator.log`` values to nbddp's live view (rank 0's: accelerate logs there only)."""

            name = "nbddp"
            requires_logging_directory = False

            @property
            def tracker(self) -> None:
                return None

            def store_init_configuration(self, values: dict[str, Any]) -> None:
                pass

            def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
                report_numbers(values, step, None)

        _MADE["accelerate"] = NbddpTracker
    return _MADE["accelerate"]()
