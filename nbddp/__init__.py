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
    "run",
    "dist_fit",
    "run_cell",
    "push",
    "pull",
    "run_script",
    "export_checkpoint",
    "find_batch_size",
    "scaling_report",
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
    "WorkerError",
    "WorkerDied",
    "WorkerStalled",
    "NothingToDebug",
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
    "run": "nbddp.api",
    "dist_fit": "nbddp.api",
    "run_cell": "nbddp.cells",
    "push": "nbddp.cells",
    "pull": "nbddp.cells",
    "run_script": "nbddp.scripts",
    "export_checkpoint": "nbddp.api",
    "find_batch_size": "nbddp.batchsize",
    "scaling_report": "nbddp.scaling",
    "FSDP": "nbddp.sharding",
    "Pipeline": "nbddp.topologies",
    "TensorParallel": "nbddp.topologies",
    "stacks": "nbddp.rank_stacks",
    "debug": "nbddp.debugging",
    "History": "nbddp.history",
    "FitHandle": "nbddp.handle",
    "loggers": "nbddp.loggers",  # a subpackage: nbddp.loggers.TensorBoard(...), ...
    "EarlyStopping": "nbddp.early_stopping",
    "stop_fit": "nbddp.callbacks",
    "plot_histories": "nbddp.history_frames",
    "NbddpError": "nbddp.errors",
    "NotStartedError": "nbddp.errors",
    "FitRunningError": "nbddp.errors",
    "ClusterError": "nbddp.errors",
    "SlurmError": "nbddp.errors",
    "ShippingError": "nbddp.errors",
    "WorkerError": "nbddp.errors",
    "WorkerDied": "nbddp.errors",
    "WorkerStalled": "nbddp.errors",
    "NothingToDebug": "nbddp.errors",
}

if TYPE_CHECKING:  # pragma: no cover
    from nbddp.api import dist_fit, export_checkpoint, restart, run, start, status, stop
    from nbddp import loggers
    from nbddp.batchsize import find_batch_size
    from nbddp.callbacks import stop_fit
    from nbddp.early_stopping import EarlyStopping
    from nbddp.history_frames import plot_histories
    from nbddp.cells import pull, push, run_cell
    from nbddp.debugging import debug
    from nbddp.errors import (ClusterError, FitRunningError, NbddpError, NotStartedError, NothingToDebug, ShippingError,
                              SlurmError, WorkerDied, WorkerError, WorkerStalled)
    from nbddp.handle import FitHandle
    from nbddp.history import History
    from nbddp.scaling import scaling_report
    from nbddp.scripts import run_script
    from nbddp.sharding import FSDP
    from nbddp.topologies import Pipeline, TensorParallel
    from nbddp.rank_stacks import stacks


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'nbddp' has no attribute {name!r}")
    imported = importlib.import_module(module)
    value = imported if module == f"{__name__}.{name}" else getattr(imported, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext nbddp``: register ``%ddp``/``%%ddp`` and expose ``dist_fit``."""
    from nbddp.magics import register

    register(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    """``%unload_ext nbddp``: remove the magics (workers keep running)."""
    from nbddp.magics import unregister

    unregister(ipython)
