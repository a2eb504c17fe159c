"""The logger base class: a fit's records written once, in the kernel.

The workers reduce every metric over all ranks; rank 0 streams the records
to the kernel; each logger writes them from there. So a run is written once
(not once per rank), from the numbers the dashboard shows, and no logger
package, credential or setting ever reaches a worker.

A logger of your own subclasses ``Logger`` and implements ``log_metrics``
(and, when it has a run to open and close, ``start`` and ``finish``)::

    class Printer(nbddp.loggers.Logger):
        def log_metrics(self, metrics, step):
            print(step, metrics)

Names in every backend: ``train/loss``, ``train/lr``,
``train/samples_per_s`` (and ``train/<name>`` for a ``step_fn``'s extra
values) at each step record; ``epoch/loss`` at each epoch's end; and
``val/loss``, ``val/<metric>`` at each validation pass.
"""

from __future__ import annotations

import importlib
import numbers
import os
import tempfile
from typing import Any

from nbddp.loggers.fit_info import FitInfo

EXTRA_HINT = 'pip install "nbddp[loggers]"'
_NOT_METRICS = ("step", "epoch", "time")


def metrics_of(kind: str, record: dict[str, Any]) -> dict[str, float]:
    """One record as tracker metrics: ``train/...`` (steps), ``epoch/...`` (epochs), ``val/...`` (validations)."""
    numbers_only = {k: float(v) for k, v in record.items()
                    if isinstance(v, numbers.Real) and not isinstance(v, bool) and k not in _NOT_METRICS}
    if kind == "val":
        return {f"val/{k.removeprefix('val_')}": v for k, v in numbers_only.items()}
    if kind == "epoch":  # its val_* values arrived as the validation record of the same step
        return {f"epoch/{k}": v for k, v in numbers_only.items() if not k.startswith("val_")}
    return {f"train/{k}": v for k, v in numbers_only.items()}


def need(module: str, package: str, who: str) -> Any:
    """Import ``module`` for the logger ``who``, or say which package (and which extra) to install."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ModuleNotFoundError(f"{who} needs the {package} package, which is not installed here ({exc}). "
                                  f"Install it in the notebook's environment: {EXTRA_HINT} (or pip install {package}). "
                                  "The workers do not need it.", name=package) from None


def writable_dir(path: str | os.PathLike, who: str) -> str:
    """``path`` as an absolute directory that exists and takes files; a clear error now if it cannot."""
    path = os.path.abspath(os.fspath(path))
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".nbddp-probe-"):
            pass
    except OSError as exc:
        raise PermissionError(f"{who} cannot write to {path!r}: {exc.strerror or exc}. "
                              "Pass a directory you can write to.") from None
    return path


class Logger:
    """Base class of ``dist_fit(loggers=[...])``' loggers. Every method is called in the kernel.

    The order for one fit: ``check()`` before any worker starts; ``start(info,
    resume)`` when the workers begin training; ``log(kind, record)`` for every
    record as it arrives, ``flush()`` after each batch of them; ``finish(status)``
    at the end. An exception from any of them is reported once and the logger
    gets no more records: the fit goes on.
    """

    name = "logger"  #: how messages and ``History.loggers`` call it

    def check(self) -> None:
        """Raise now for what can be known before training: a missing package, an unwritable place."""

    def start(self, info: FitInfo, resume: dict[str, Any] | None) -> dict[str, Any] | None:
        """Open this fit's run. ``resume``: what this method returned for the fit being resumed.

        Return what a later fit resuming this one needs to continue the same
        run (plain JSON data, kept in ``checkpoint_dir``), or None.
        """
        return None

    def log(self, kind: str, record: dict[str, Any]) -> None:
        """One record (``kind``: ``"step"``, ``"epoch"`` or ``"val"``); by default as ``log_metrics``."""
        metrics = metrics_of(kind, record)
        if metrics:
            self.log_metrics(metrics, int(record["step"]))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Write ``metrics`` (name -> value) at optimizer step ``step``."""
        raise NotImplementedError(f"{type(self).__name__} must implement log_metrics(metrics, step) or log(kind, record)")

    def flush(self) -> None:
        """Write what ``log`` buffered."""

    def finish(self, status: str) -> None:
        """Close the run: ``status`` is ``"completed"``, ``"interrupted"`` or ``"failed"``."""

    def where(self) -> str:
        """Where the run can be found (a directory, a URL), for the summary; empty if nowhere in particular."""
        return ""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
