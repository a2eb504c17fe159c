"""Everything one fit on one rank works with, in one object.

``setup.build`` fills it, the loop (``loop.py``) advances it, validation and
checkpoints read it. Keeping it in one place is what lets each of those be
a small function with one argument instead of eleven.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn

from nbddp.protocol.fit_options import FitConfig
from nbddp.worker.strategies import Strategy


@dataclass
class TrainState:
    cfg: FitConfig
    rank: int
    world: int
    device: torch.device
    strategy: Strategy
    model: nn.Module  # the person's module (unwrapped); the strategy holds the wrapped one
    loader: Any  # this epoch's DataLoader over the rank's shard
    sampler: Any  # its DistributedSampler
    make_loader: Callable[[Any], Any]  # a loader over another sampler (resume mid-epoch)
    vloader: Any = None
    loss_fn: Callable | None = None
    step_fn: Callable | None = None
    metrics: dict[str, Callable] = field(default_factory=dict)
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Any = None  # the person's LR scheduler (its state goes into checkpoints)
    schedule: Any = None  # schedules.Schedule: when that scheduler steps
    notices: list[str] = field(default_factory=list)  # one-line notices for the person (rank 0's reach the kernel)
    scaler: Any = None
    autocast: Callable[[], Any] = contextlib.nullcontext
    # where training stands
    step: int = 0
    epoch: int = 0
    start_step: int = 0
    start_epoch: int = 0
    skip: int = 0  # batches of the first epoch already trained before a mid-epoch checkpoint
    rng: dict[str, Any] | None = None  # this rank's RNG state at the checkpoint, restored where the straight run stood
    restored: dict[str, Any] | None = None  # the checkpoint's loop state (step, epoch, sums, RNG)
    status: str = "completed"  # or "interrupted"
    reporter: Any = None
    best: Any = None  # best_weights.BestWeights when the kernel asked to end with the best check's weights
    lr: float = 0.0  # the learning rate of the last optimizer step
    stream: Any = None  # streams.Stream when the training data is an IterableDataset (``loader`` is its loader)
    targets_checked: bool = False  # the first batch's targets were looked at (batches.refuse_binary_float_targets)
    nan_seen: bool = False  # this rank saw a NaN/inf loss in the current optimizer step (on_nan="stop"/"skip")
    nan_skipped: int = 0  # optimizer steps dropped for a NaN loss (on_nan="skip")
    nan_first: int = 0  # the first of them
    stoppers: list[Any] = field(default_factory=list)  # nbddp.protocol.fit_options.Patience, one per EarlyStopping
    stop_reason: str | None = None  # why training stopped early, when the workers decided it (History.stop_reason)
    profiler: Any = None  # profiler.StepProfiler under dist_fit(profile=...)
    asked: Any = None  # asked_profile.AskedProfiles: handle.profile's requests, during a fit
    answers: Any = None  # kernel_answers.KernelAnswers: the synchronous callbacks' answers (on_epoch_end)
    agreement: Any = None  # streams.Agreement: which ranks still have a batch (streams, lazily)
    compiled: list[nn.Module] = field(default_factory=list)  # modules whose forward is compiled for this fit
    snapshots: Any = None  # checkpoints.snapshots.SnapshotClock in an elastic fit (dist_fit(max_restarts=...))

    @property
    def batches_per_epoch(self) -> int:
        """A stream's is known only once every rank agreed where it ends (until then: larger than any index)."""
        return self.stream.batches_per_epoch if self.stream is not None else len(self.loader)

    @property
    def steps_per_epoch(self) -> int | None:
        if self.stream is not None:
            return None
        return math.ceil(self.batches_per_epoch / self.cfg.grad_accum)

    @property
    def total_steps(self) -> int | float:
        """``math.inf`` for a stream without ``max_steps``: how long its epochs are is seen only at their ends."""
        per_epoch = self.steps_per_epoch
        if per_epoch is None:  # a stream
            return self.cfg.max_steps if self.cfg.max_steps is not None else math.inf
        total = per_epoch * self.cfg.epochs
        return min(total, self.cfg.max_steps) if self.cfg.max_steps is not None else total

    @property
    def built_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer, which phase 2 of the set-up builds (``setup.wrap_and_restore``) once the model is wrapped."""
        if self.optimizer is None:
            raise RuntimeError("an optimizer step came before setup.wrap_and_restore built this fit's optimizer; "
                               "the loop runs only after both set-up phases (loop.fit)")
        return self.optimizer

    @property
    def non_blocking(self) -> bool:
        return self.device.type == "cuda"
