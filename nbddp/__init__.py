"""nbddp: DistributedDataParallel training from a Jupyter notebook.

``%load_ext nbddp``, ``%ddp start``, then ``dist_fit(model, data)`` in a cell.
Workers are persistent ipyparallel engines; the notebook's ``model`` gets the
trained weights back.

Importing this package is instant: torch and ipyparallel are imported only
when a function that needs them is first called.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "start",
    "stop",
    "status",
    "restart",
    "detach",
    "attach",
    "sessions",
    "running",
    "kept",
    "run",
    "dist_fit",
    "last_history",
    "sweep",
    "SweepResult",
    "SweepHandle",
    "predict",
    "evaluate",
    "PredictHandle",
    "CallHandle",
    "run_cell",
    "push",
    "pull",
    "run_script",
    "report",
    "should_stop",
    "lightning_logger",
    "accelerate_tracker",
    "export_checkpoint",
    "compile_cache",
    "RecompileWarning",
    "find_batch_size",
    "scaling_report",
    "DDP",
    "FSDP",
    "Pipeline",
    "TensorParallel",
    "stacks",
    "debug",
    "History",
    "FitHandle",
    "loggers",
    "EarlyStopping",
    "stop_fit",
    "plot_histories",
    "NbddpError",
    "NotStartedError",
    "FitRunningError",
    "ClusterError",
    "SlurmError",
    "ShippingError",
    "UntrustedCheckpointError",
    "WorkerError",
    "WorkerDied",
    "WorkerStalled",
    "NothingToDebug",
    "SessionError",
    "NbddpWarning",
    "__version__",
    "load_ipython_extension",
    "unload_ipython_extension",
]

# public name -> module that defines it (imported on first use)
_LAZY = {
    "start": "nbddp.api",
    "stop": "nbddp.api",
    "status": "nbddp.api",
    "restart": "nbddp.api",
    "detach": "nbddp.api",
    "attach": "nbddp.api",
    "sessions": "nbddp.api",
    "running": "nbddp.api",
    "kept": "nbddp.api",
    "run": "nbddp.api",
    "dist_fit": "nbddp.api",
    "last_history": "nbddp.api",
    "report": "nbddp.api",
    "should_stop": "nbddp.api",
    "lightning_logger": "nbddp.api",
    "accelerate_tracker": "nbddp.api",
    "sweep": "nbddp.api",
    "SweepResult": "nbddp.sweeps.result",
    "SweepHandle": "nbddp.sweeps.handle",
    "predict": "nbddp.api",
    "evaluate": "nbddp.api",
    "PredictHandle": "nbddp.inference.predict_run",
    "CallHandle": "nbddp.cells.call_handle",
    "run_cell": "nbddp.cells.cell_code",
    "push": "nbddp.cells.cell_code",
    "pull": "nbddp.cells.cell_code",
    "run_script": "nbddp.cells.scripts",
    "export_checkpoint": "nbddp.api",
    "compile_cache": "nbddp.cells.compile_cache",
    "RecompileWarning": "nbddp.fit.compile_report",
    "find_batch_size": "nbddp.measure.batch_size",
    "scaling_report": "nbddp.measure.scaling",
    "DDP": "nbddp.protocol.parallel_settings",
    "FSDP": "nbddp.protocol.parallel_settings",
    "Pipeline": "nbddp.protocol.parallel_settings",
    "TensorParallel": "nbddp.protocol.parallel_settings",
    "stacks": "nbddp.monitor.stacks",
    "debug": "nbddp.api",
    "History": "nbddp.fit.history",
    "FitHandle": "nbddp.fit.handle",
    "loggers": "nbddp.loggers",  # a subpackage: nbddp.loggers.TensorBoard(...), ...
    "callbacks": "nbddp.callbacks",  # a subpackage: class MyCallback(nbddp.callbacks.Callback)
    "shipping": "nbddp.shipping",  # a subpackage: nbddp.shipping.ship_by_value("mylib")
    "EarlyStopping": "nbddp.callbacks",
    "stop_fit": "nbddp.callbacks",
    "plot_histories": "nbddp.fit.history",
    "NbddpError": "nbddp.protocol.errors",
    "NotStartedError": "nbddp.protocol.errors",
    "FitRunningError": "nbddp.protocol.errors",
    "ClusterError": "nbddp.protocol.errors",
    "SlurmError": "nbddp.protocol.errors",
    "ShippingError": "nbddp.protocol.errors",
    "UntrustedCheckpointError": "nbddp.protocol.errors",
    "WorkerError": "nbddp.protocol.errors",
    "WorkerDied": "nbddp.protocol.errors",
    "WorkerStalled": "nbddp.protocol.errors",
    "NothingToDebug": "nbddp.protocol.errors",
    "SessionError": "nbddp.protocol.errors",
    "NbddpWarning": "nbddp.protocol.notices",
}

if TYPE_CHECKING:  # pragma: no cover
    from nbddp.api import (accelerate_tracker, attach, detach, dist_fit, evaluate, export_checkpoint, kept,
                           last_history, lightning_logger, predict, report, restart, run, running, sessions,
                           should_stop, start, status, stop, sweep)
    from nbddp.sweeps.result import SweepResult
    from nbddp.sweeps.handle import SweepHandle
    from nbddp.inference.predict_run import PredictHandle
    from nbddp.cells.call_handle import CallHandle
    from nbddp import loggers
    from nbddp.measure.batch_size import find_batch_size
    from nbddp.cells.compile_cache import compile_cache
    from nbddp.fit.compile_report import RecompileWarning
    from nbddp.callbacks.base import stop_fit
    from nbddp.callbacks.early_stopping import EarlyStopping
    from nbddp.fit.history import plot_histories
    from nbddp.cells.cell_code import pull, push, run_cell
    from nbddp.api import debug
    from nbddp.protocol.errors import (ClusterError, FitRunningError, NbddpError, NotStartedError, NothingToDebug, SessionError, ShippingError,
                              SlurmError, UntrustedCheckpointError, WorkerDied, WorkerError, WorkerStalled)
    from nbddp.fit.handle import FitHandle
    from nbddp.fit.history import History
    from nbddp.measure.scaling import scaling_report
    from nbddp.cells.scripts import run_script
    from nbddp.protocol.parallel_settings import DDP, FSDP
    from nbddp.protocol.parallel_settings import Pipeline, TensorParallel
    from nbddp.monitor.stacks import stacks
    from nbddp.protocol.notices import NbddpWarning
    from IPython.core.interactiveshell import InteractiveShell
# modules people reached as nbddp.<name> before the code moved into packages: still reached, with a warning
_MOVED = {"modules": ("nbddp.shipping", "nbddp.shipping (ship_by_value, ship_by_reference)")}


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        from nbddp.protocol.notices import deprecated

        target, says = _MOVED[name]
        deprecated(f"nbddp.{name} is now {says}; nbddp.{name} will go in a later release")
        return importlib.import_module(target)
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'nbddp' has no attribute {name!r}")
    imported = importlib.import_module(module)
    value = imported if module == f"{__name__}.{name}" else getattr(imported, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def load_ipython_extension(ipython: InteractiveShell) -> None:
    """``%load_ext nbddp``: register ``%ddp``/``%%ddp`` and expose ``dist_fit``."""
    from nbddp.magics import register

    register(ipython)


def unload_ipython_extension(ipython: InteractiveShell) -> None:
    """``%unload_ext nbddp``: remove the magics (workers keep running)."""
    from nbddp.magics import unregister

    unregister(ipython)
