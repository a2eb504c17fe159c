"""Which worker class trains a strategy's settings: nbddp's own by name, anyone's from what its settings declare.

A settings class (``protocol/strategy_settings.py``) names its worker class
in ``worker``: the class itself (a notebook's or a test module's travels by
value inside the settings' class), a dotted name ``"package.module:Class"``
imported here on the rank, or one of the short names below. nbddp's own use
the short names, so that the kernel never imports the worker side and a
rank imports FSDP's or pipelining's machinery only for a fit that uses it.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from nbddp.protocol.parallel_settings import settings_of
from nbddp.worker.strategies.base import Strategy

BUILT_IN = {
    "ddp": "nbddp.worker.strategies.ddp:DDPStrategy",
    "fsdp": "nbddp.worker.strategies.fsdp:FSDPStrategy",
    "pipeline": "nbddp.worker.strategies.pipeline:PipelineStrategy",
    "tensor": "nbddp.worker.strategies.tensor:TensorParallelStrategy",
}


def worker_class(settings: Any) -> type[Strategy]:
    """The ``Strategy`` subclass that ``settings`` declares (``settings.worker``).

    Raises:
        ValueError: a dotted name that does not import on this rank.
        TypeError: what it names is not a ``Strategy`` subclass.
    """
    declared = settings.worker
    where = f"{type(settings).__name__}.worker"
    found = declared
    if isinstance(declared, str):
        path = BUILT_IN.get(declared, declared)
        module, _, name = path.partition(":") if ":" in path else path.rpartition(".")
        try:
            found = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError) as exc:
            raise ValueError(f"{where} = {declared!r} does not import on this rank ({type(exc).__name__}: {exc}); "
                             f"name a class the workers can import, as 'package.module:Class', or give the class "
                             f"itself") from None
    if not (isinstance(found, type) and issubclass(found, Strategy)):
        raise TypeError(f"{where} = {declared!r} is not a subclass of nbddp.worker.strategies.Strategy; a worker "
                        "class subclasses it (or one of nbddp's, like nbddp.worker.strategies.ddp.DDPStrategy)")
    return found


def make_strategy(spec: Any, device: torch.device, precision: str = "32-true",
                  mesh: dict[str, int] | None = None) -> Strategy:
    """The worker strategy for ``spec`` (``"ddp"`` or a settings object, checked in the kernel already) and its mesh.

    Raises:
        ValueError: an unknown ``spec``, or a worker class that does not import (``worker_class``).
    """
    settings = settings_of(spec)
    strategy = worker_class(settings).create(settings, device, precision, mesh)
    strategy.settings = settings
    return strategy
