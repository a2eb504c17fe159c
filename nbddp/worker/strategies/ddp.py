"""Replicated training: ``DistributedDataParallel``, one full copy per rank.

``dist_fit(compile=...)`` compiles the module DDP wraps, whole (the base
``compile_targets``; ``regional`` does not apply): DDP calls it inside its
forward, where Dynamo sees the DDP module and splits the graph at its bucket
boundaries (``optimize_ddp``), so each bucket's all-reduce still overlaps
the rest of the backward; validation calls the same compiled module.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from nbddp.worker.checkpoints import files as ckpt
from nbddp.worker.strategies.base import Strategy


class DDPStrategy(Strategy):
    name = "ddp"
    snapshot_is_one_file = True  # replicated: rank 0's file is every rank's state

    def __init__(self, device: torch.device, settings: Any) -> None:
        super().__init__(device)
        self.settings = settings  # an nbddp.DDP: torch's own DDP settings, as the person gave them

    @classmethod
    def create(cls, settings: Any, device: torch.device, precision: str, mesh: dict[str, int] | None) -> Strategy:
        return cls(device, settings)

    def wrap(self, model: nn.Module, identical: bool) -> nn.Module:
        # Every rank loaded the same shipped weights (or the same checkpoint): DDP's initial broadcast of
        # the whole model from rank 0 would only copy them again. A factory's model is broadcast, since
        # its construction may draw on randomness nbddp does not control.
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        ddp = DDP(model, device_ids=device_ids, init_sync=not identical, process_group=self.group,
                  **self.settings.torch_kwargs())
        self.wrapped, self.module = ddp, model  # (ddp.module is model)
        return ddp

    def gradient_sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if enabled else self.wrapped_as(DDP).no_sync()

    def full_state_dict(self, rank: int) -> dict[str, Any] | None:
        return self.module.state_dict() if rank == 0 else None

    def save_checkpoint(self, directory: str, step: int, optimizer: Any, extra: dict[str, Any], rank: int) -> None:
        if rank != 0:
            return
        ckpt.save(directory, step, {"model": self.module.state_dict(), "optimizer": optimizer.state_dict(), **extra})

    def save_snapshot(self, directory: str, step: int, optimizer: Any, extra: dict[str, Any], rank: int,
                      writer: Any) -> Callable[[], Any] | None:
        if rank != 0:  # replicated: rank 0's copy is every rank's
            return None
        if writer.inline:
            ckpt.save(directory, step, {"model": self.module.state_dict(), "optimizer": optimizer.state_dict(),
                                        **extra}, private=True)
            return None
        state = writer.stage({"model": self.module.state_dict(), "optimizer": optimizer.state_dict(), **extra})
        return lambda: ckpt.save(directory, step, state, private=True)

    def load_checkpoint(self, path: str, optimizer: Any) -> dict[str, Any]:
        state = ckpt.load(path)
        self.module.load_state_dict(state.pop("model"))
        optimizer.load_state_dict(state.pop("optimizer"))
        return state
