"""What every way of training answers; the loop asks these and nothing else.

The training loop, the reporter and the checkpoint bookkeeping are shared.
A strategy holds only what differs between replicating the model (DDP) and
sharding it (FSDP): how the module is wrapped, where the optimizer's
parameters come from, when gradients are synchronised, how gradients are
clipped, which module evaluates, how the full weights are gathered, and how
model and optimizer state are saved and restored.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import Any, Iterator

import torch
import torch.nn as nn


class Strategy(ABC):
    name: str = ""
    #: validation forwards run collectives, so every rank must run the same number of them
    lockstep_validation: bool = False
    #: after the first step the loop's freed buffers stay in the C heap for the next step (worker/memory.py)
    heap_steady_state: bool = True

    def __init__(self, device: torch.device):
        self.device = device
        self.module: nn.Module | None = None  # the person's module, inside any wrapper
        self.wrapped: nn.Module | None = None  # what the training step calls
        self.group: Any = None  # train in this subgroup of the workers (None: all of them)

    # ---- building ----------------------------------------------------------
    def build(self, factory: Any) -> nn.Module:
        """The person's module on this rank (a shipped module, or a factory's), before wrapping."""
        model = factory() if not isinstance(factory, nn.Module) and callable(factory) else factory
        if not isinstance(model, nn.Module):
            raise TypeError(f"the model factory returned {type(model).__name__}, not a torch.nn.Module")
        return model.to(self.device)

    @abstractmethod
    def wrap(self, model: nn.Module, identical: bool) -> nn.Module:
        """Wrap for training (may be collective); ``identical``: every rank already holds the same weights."""

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.wrapped.parameters()

    # ---- the step ------------------------------------------------------------
    @abstractmethod
    def gradient_sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        """A context for one micro-batch's backward: ``enabled=False`` inside an accumulation window."""

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip the global gradient norm; return the norm before clipping."""
        return float(torch.nn.utils.clip_grad_norm_(list(self.parameters()), max_norm))

    @property
    def eval_module(self) -> nn.Module:
        """The module validation calls (no gradient sync, no wrapper hooks when avoidable)."""
        return self.module

    def end_evaluation(self) -> None:
        """After a validation pass (FSDP frees the gathered parameters its root kept)."""

    # ---- what a rank holds ---------------------------------------------------
    def param_bytes(self) -> int:
        """Parameter bytes this rank holds."""
        return sum(p.numel() * p.element_size() for p in self.module.parameters())

    # ---- weights and checkpoints -----------------------------------------------
    @abstractmethod
    def full_state_dict(self, rank: int) -> dict[str, torch.Tensor] | None:
        """The full, unsharded state dict on rank 0 (collective); ``None`` elsewhere."""

    @abstractmethod
    def save_checkpoint(self, directory: str, step: int, optimizer: Any, extra: dict[str, Any], rank: int) -> None:
        """Save model and optimizer state with ``extra`` (loop state, every rank's RNG); collective."""

    @abstractmethod
    def load_checkpoint(self, path: str, optimizer: Any) -> dict[str, Any]:
        """Restore model and optimizer state from ``path``; return the ``extra`` it was saved with."""
