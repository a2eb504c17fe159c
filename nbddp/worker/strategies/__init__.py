"""The ways of training a rank knows: one small class each, found for ``dist_fit(strategy=...)`` by the registry.

Imports only ``worker/`` and the shared layer; a strategy from outside
nbddp subclasses ``Strategy`` (or one of nbddp's) and is named by its
settings class (``registry.py``).
"""

from __future__ import annotations

from nbddp.worker.strategies.base import Strategy
from nbddp.worker.strategies.registry import make_strategy, worker_class

__all__ = ["Strategy", "make_strategy", "worker_class"]
