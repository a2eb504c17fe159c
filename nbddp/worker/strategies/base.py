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
from typing import Any, Callable, Iterator, TypeVar

import torch
import torch.nn as nn

from nbddp.worker.data.batches import run_batch
from nbddp.worker.engine.heartbeat import BEAT

W = TypeVar("W")


class Strategy(ABC):
    name: str = ""
    #: validation forwards run collectives, so every rank must run the same number of them
    lockstep_validation: bool = False
    #: every batch must have the full batch size (a pipeline's stages exchange tensors of one shape)
    whole_batches: bool = False
    #: after the first step the loop's freed buffers stay in the C heap for the next step (worker/memory/allocator.py)
    heap_steady_state: bool = True

    def __init__(self, device: torch.device):
        self.device = device
        self.settings: Any = None  # what strategy= said, as a settings object (set by the registry)
        self._module: nn.Module | None = None  # ``module``, once ``wrap`` has set it
        self._wrapped: nn.Module | None = None  # ``wrapped``, once ``wrap`` has set it
        self.group: Any = None  # train in this subgroup of the workers (None: all of them)
        # (dataset, collate_fn, batch_size) of the training data: for a strategy that must see a batch before training
        self.sample_data: Any = None

    @classmethod
    def create(cls, settings: Any, device: torch.device, precision: str, mesh: dict[str, int] | None) -> Strategy:
        """How the registry builds this strategy from its settings; a class whose ``__init__`` takes more
        (the fit's precision, its mesh) says so here."""
        return cls(device)

    # ---- who reads which data, who reports -----------------------------------
    def data_shard(self, rank: int, world: int) -> tuple[int, int]:
        """``(shard, shards)`` of the training data this rank reads; ranks that share a model copy share a shard."""
        return rank, world

    @property
    def reports_metrics(self) -> bool:
        """Whether this rank's loss and sample count enter the reduced metrics (one rank per model copy)."""
        return True

    def roles(self, world: int) -> list[dict[str, Any]]:
        """What each rank of the fit holds (``History.ranks``): its stage, its shard; nothing for replicas."""
        return [{} for _ in range(world)]

    # ---- building ----------------------------------------------------------
    def build(self, factory: Any) -> nn.Module:
        """The person's module on this rank (a shipped module, or a factory's), before wrapping."""
        model = factory() if not isinstance(factory, nn.Module) and callable(factory) else factory
        if not isinstance(model, nn.Module):
            raise TypeError(f"the model factory returned {type(model).__name__}, not a torch.nn.Module")
        return model.to(self.device)

    @abstractmethod
    def wrap(self, model: nn.Module, identical: bool) -> nn.Module:
        """Wrap for training (may be collective); ``identical``: every rank already holds the same weights.

        Sets ``module`` and ``wrapped``.
        """

    @property
    def module(self) -> nn.Module:
        """The person's module, inside any wrapper (what this rank holds of it: a pipeline keeps its stages)."""
        return self._after_wrap(self._module, "module")

    @module.setter
    def module(self, module: nn.Module) -> None:
        self._module = module

    @property
    def wrapped(self) -> nn.Module:
        """What the training step calls: the wrapper (DDP), or the module itself (FSDP2, a pipeline's stages)."""
        return self._after_wrap(self._wrapped, "wrapped")

    @wrapped.setter
    def wrapped(self, wrapped: nn.Module) -> None:
        self._wrapped = wrapped

    def _after_wrap(self, value: nn.Module | None, name: str) -> nn.Module:
        if value is None:
            raise RuntimeError(f"{type(self).__name__}.{name} was read before {type(self).__name__}.wrap(model) set "
                               f"it; a strategy's wrap must set both self.module and self.wrapped")
        return value

    def wrapped_as(self, kind: type[W]) -> W:
        """``wrapped`` as the class this strategy's ``wrap`` makes it (``DDP``, ``FSDPModule``), for its own methods."""
        wrapped = self.wrapped
        if not isinstance(wrapped, kind):
            raise TypeError(f"{type(self).__name__} trains a {kind.__name__}, but its wrap() left a "
                            f"{type(wrapped).__name__} in self.wrapped; a subclass that wraps otherwise must also "
                            "override the methods that use it (gradient_sync, end_evaluation)")
        return wrapped

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.wrapped.parameters()

    def compile_targets(self, spec: Any) -> list[nn.Module]:
        """The modules ``dist_fit(compile=...)`` compiles in place, after ``wrap`` (``strategies/compiling.py``).

        By default the person's module inside the wrapper: the wrapper calls
        it in training, and validation calls it directly, so both run compiled.
        """
        return [self.module]

    # ---- the step ------------------------------------------------------------
    def train_micro_batch(self, ts: Any, batch: Any, window: int) -> tuple[torch.Tensor, int, dict[str, Any]]:
        """Forward and backward one micro-batch (already on the device), the loss divided by ``window``.

        Returns ``(loss, samples, extras)`` for the reporter. The loop calls it
        inside ``gradient_sync``; a strategy whose step is not "forward, then
        backward" (a pipeline schedule) overrides it.
        """
        with ts.autocast():
            loss, n, extras, _, _ = run_batch(self.wrapped, batch, ts.loss_fn, ts.step_fn)
        BEAT.mark("backward")
        scaled = loss.float() if window == 1 else loss.float() / window  # no extra autograd node per step
        (ts.scaler.scale(scaled) if ts.scaler is not None else scaled).backward()
        return loss, n, extras

    def eval_batch(self, ts: Any, batch: Any) -> tuple[Any, ...] | None:
        """``(loss, n, extras, output, target)`` of one validation batch, or None where this rank holds no loss."""
        with ts.autocast():
            return run_batch(self.eval_module, batch, ts.loss_fn, ts.step_fn)

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
    def snapshot_weights(self, rank: int) -> dict[str, torch.Tensor] | None:
        """A CPU copy of the weights (parameters and buffers), to come back to later (``restore_weights``).

        Replicated: every rank holds the same weights, so rank 0 alone keeps a
        copy (one model's worth of host memory); the others keep nothing.
        """
        if rank != 0:
            return None
        return {name: t.detach().to("cpu", copy=True) for name, t in self.module.state_dict().items()}

    def restore_weights(self, saved: dict[str, torch.Tensor] | None, rank: int) -> None:
        """Put ``snapshot_weights``'s copy back on every rank: rank 0 loads it, then broadcasts (collective)."""
        import torch.distributed as dist

        if rank == 0 and saved is None:
            raise ValueError(f"{type(self).__name__}.restore_weights: rank 0 holds the copy that every rank gets, "
                             "but it was given None; pass what snapshot_weights(0) returned")
        with torch.no_grad():
            for name, t in self.module.state_dict().items():
                if rank == 0 and saved is not None:  # (checked above)
                    t.copy_(saved[name])
                dist.broadcast(t, src=0, group=self.group)

    @abstractmethod
    def full_state_dict(self, rank: int) -> dict[str, Any] | None:
        """The full, unsharded state dict on rank 0 (collective); ``None`` elsewhere.

        A state dict as torch types it: tensors, and whatever a module's ``get_extra_state`` returns.
        """

    @abstractmethod
    def save_checkpoint(self, directory: str, step: int, optimizer: Any, extra: dict[str, Any], rank: int) -> None:
        """Save model and optimizer state with ``extra`` (loop state, every rank's RNG); collective."""

    snapshot_is_one_file = False  # an elastic fit's snapshot is one file (rank 0's), which can be copied to a peer

    @abstractmethod
    def save_snapshot(self, directory: str, step: int, optimizer: Any, extra: dict[str, Any], rank: int,
                      writer: Any) -> Callable[[], Any] | None:
        """An elastic fit's snapshot, off the training thread (``checkpoints/background.py``); collective.

        Copies what this rank writes into ``writer``'s host buffers and returns the write itself, which
        the writer's thread runs (``None``: this rank writes nothing). Under ``writer.inline`` it writes
        here, as ``save_checkpoint`` does, and returns ``None``.
        """

    def snapshot_reads(self, path: str, optimizer: Any) -> set[str] | None:
        """The files in a sharded snapshot ``path`` that ``load_checkpoint`` reads on this rank (None: one file)."""
        return None

    @abstractmethod
    def load_checkpoint(self, path: str, optimizer: Any) -> dict[str, Any]:
        """Restore model and optimizer state from ``path``; return the ``extra`` it was saved with."""
