"""The ways of training a rank knows: one small class each, chosen by ``dist_fit(strategy=...)``."""

from __future__ import annotations

from typing import Any

import torch

from nbddp.worker.strategies.base import Strategy
from nbddp.worker.strategies.ddp import DDPStrategy


def make_strategy(spec: Any, device: torch.device, precision: str = "32-true", mesh: dict[str, int] | None = None) -> Strategy:
    """``"ddp"`` or an ``nbddp.DDP``, an ``nbddp.FSDP``, or a model-parallel setting with its mesh (checked in the kernel already)."""
    from nbddp.protocol.parallel_settings import DDP, FSDP, Pipeline, TensorParallel

    if spec == "ddp" or isinstance(spec, DDP):
        return DDPStrategy(device, spec if isinstance(spec, DDP) else DDP())
    if isinstance(spec, str) or spec is None:
        raise ValueError(f"unknown strategy {spec!r}")

    if isinstance(spec, FSDP):
        from nbddp.worker.strategies.fsdp import FSDPStrategy

        return FSDPStrategy(device, spec, precision)
    if isinstance(spec, Pipeline):
        from nbddp.worker.strategies.pipeline import PipelineStrategy

        return PipelineStrategy(device, spec, precision, mesh)
    if isinstance(spec, TensorParallel):
        from nbddp.worker.strategies.tensor import TensorParallelStrategy

        return TensorParallelStrategy(device, spec, precision, mesh)
    raise ValueError(f"unknown strategy {spec!r}")


__all__ = ["Strategy", "make_strategy"]
