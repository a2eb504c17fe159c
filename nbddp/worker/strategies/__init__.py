"""The ways of training a rank knows: one small class each, chosen by ``dist_fit(strategy=...)``."""

from __future__ import annotations

from typing import Any

import torch

from nbddp.worker.strategies.base import Strategy
from nbddp.worker.strategies.ddp import DDPStrategy


def make_strategy(spec: Any, device: torch.device, precision: str = "32-true") -> Strategy:
    """``"ddp"``, or an ``nbddp.FSDP`` settings object (checked in the kernel already)."""
    if spec == "ddp":
        return DDPStrategy(device)
    if isinstance(spec, str) or spec is None:
        raise ValueError(f"unknown strategy {spec!r}")
    from nbddp.sharding import FSDP

    if isinstance(spec, FSDP):
        from nbddp.worker.strategies.fsdp import FSDPStrategy

        return FSDPStrategy(device, spec, precision)
    raise ValueError(f"unknown strategy {spec!r}")


__all__ = ["Strategy", "make_strategy"]
