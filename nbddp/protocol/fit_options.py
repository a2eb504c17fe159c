"""The plain (non-callable) options of ``dist_fit`` as the workers read them, and which check is the best.

``FitConfig`` is plain data: it travels to the workers with ordinary pickle.
The kernel builds it from ``dist_fit``'s arguments and checks every value
first (``fit/option_checks.py``), so a typo costs an error message, not a
broken process group.

``BestSpec``: ``EarlyStopping`` and ``restore_best`` must agree on which
check was the best one, so both apply this one rule to the same reduced
values (rank 0's records are the kernel's records, bit for bit). It is the
only part of a callback that travels to the workers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from nbddp.protocol.strategy_settings import StrategyChoice


PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")
PRECISION_ALIASES = {"32": "32-true", "bf16": "bf16-mixed"}  # the names nbddp used first, kept working
SCHEDULER_INTERVALS = ("step", "epoch")
ON_NAN = ("raise", "stop", "skip")
DEFAULT_LR = 1e-3


@dataclass
class FitConfig:
    """Validated options, as the worker loop reads them."""

    epochs: int = 1
    max_steps: int | None = None
    batch_size: int = 32
    lr: float | None = None  # None: DEFAULT_LR for the default optimizer or an optimizer class
    shuffle: bool = True
    seed: int = 0
    precision: str = "32-true"
    grad_accum: int = 1
    clip_grad_norm: float | None = None
    sync_batchnorm: bool = False
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None
    resume: bool | str = False
    trust_checkpoint: bool = False  # load resume=... in full (it may run code); else weights_only (worker/checkpoints/trust.py)
    log_every: int = 20
    val_every: int | None = None
    scheduler_interval: str | None = None  # None: the scheduler's kind decides (worker/training/schedules.py)
    scheduler_frequency: int = 1  # step the scheduler every k-th interval (a Lightning dict's "frequency")
    scheduler_monitor: str | None = None  # ReduceLROnPlateau's value (default: val_loss, else loss)
    strategy: Any = "ddp"  # "ddp", an nbddp.FSDP, nbddp.Pipeline or nbddp.TensorParallel settings object
    mesh: dict[str, int] | None = None  # {"dp": 2, "pp": 2}: completed for the world size by preflight (topologies)
    activation_checkpointing: Any = False  # False, True (every unit) or a frozenset of module class names
    drop_last: bool = False
    num_workers: int | None = None
    pin_memory: bool | None = None
    prefetch: int = 1  # batches copied to the GPU ahead of the step (0: off; ignored on CPU)
    on_nan: str = "raise"  # a NaN/inf loss: "raise", "stop" (last good weights) or "skip" (drop that update)
    record_interval_s: float = 1.0
    publish_interval_s: float = 0.25
    compile: Any = None  # None, or a protocol.compile_settings.CompileSpec (checked by fit/compile_checks.py)
    profile: Any = None  # a profile_spec.ProfileSpec once checked: torch.profiler over the same steps on every rank
    # elastic fits (``max_restarts``): where each rank writes its snapshots (the kernel's /dev/shm folder), how
    # often (steps: int, "epoch", seconds: float, or "auto": AUTO_SNAPSHOT_S stretched to keep the cost small),
    # and whether this launch is a relaunch that starts from the newest snapshot there
    snapshot_dir: str | None = None
    snapshot_every: Any = None
    from_snapshot: bool = False
    # ``min_workers``: the data-parallel ranks the fit began with (0: not set). A relaunch on fewer ranks reads their
    # shards and accumulates grad_accum x (data_world // world) micro-batches (worker/data/fewer_ranks.py)
    data_world: int = 0

    def global_batch_size(self, world_size: int) -> int:
        """Samples in one optimizer step over every data-parallel rank: ``batch_size`` x those ranks x ``grad_accum``.

        The data-parallel ranks are the mesh's ``dp`` (1 for a pipeline or
        tensor-parallel fit without one), else every rank; a fit going on with
        fewer ranks (``min_workers``) keeps the batch of the ranks it began with.
        """
        dp = self.data_world or ((self.mesh or {}).get("dp", 1) if self.mesh else world_size)
        return self.batch_size * dp * self.grad_accum


AUTO_SNAPSHOT_S = 30.0  # snapshot_every="auto": at least this many seconds apart ...
AUTO_SNAPSHOT_COST = 0.02  # ... and far enough apart that writing one costs at most this share of the time


def check_device_rules(precision: str, sync_batchnorm: bool, device_types: set[str],
                       strategy: StrategyChoice = "ddp") -> None:
    """What needs CUDA, said once: checked in the kernel before a fit, and again on each rank.

    Raises:
        ValueError: ``16-mixed`` or ``sync_batchnorm`` on workers that are not all on CUDA.
    """
    if precision == "16-mixed" and device_types != {"cuda"}:
        raise ValueError("dist_fit(precision='16-mixed') needs CUDA GPUs (fp16 with a gradient scaler), but the workers "
                         f"run on {sorted(device_types)}; on CPU workers use precision='bf16-mixed'")
    if sync_batchnorm and device_types != {"cuda"}:
        raise ValueError(
            f"dist_fit(sync_batchnorm=True) needs CUDA GPUs: SyncBatchNorm has no CPU kernel, and the workers run on "
            f"{sorted(device_types)}. On CPU workers leave it off (each rank then normalises over its own batch)"
        )
    if getattr(strategy, "cpu_offload", False) and device_types != {"cuda"}:
        raise ValueError(f"nbddp.FSDP(cpu_offload=True) moves shards between CPU and GPU memory, but the workers run on "
                         f"{sorted(device_types)}: their parameters already live in CPU memory. Leave cpu_offload off.")


MODES = ("min", "max")


@dataclass(frozen=True)
class BestSpec:
    """What is monitored, and which way is better."""

    monitor: str = "val_loss"
    mode: str = "min"
    min_delta: float = 0.0
    patience: int = 0  # EarlyStopping's: checks without improvement before the workers stop (0: never)
    baseline: float | None = None  # Keras's: the value to beat from the first check on
    check_finite: bool = False  # Lightning's: a NaN or inf value stops at once

    @property
    def kind(self) -> str:
        """The records the value is read from: every validation pass for ``val_*``, else every epoch's record."""
        return "val" if self.monitor.startswith("val_") else "epoch"

    def improved(self, value: float, best: float | None) -> bool:
        """Whether ``value`` beats ``best`` by more than ``min_delta`` (the first finite value always does)."""
        if not math.isfinite(value):
            return False
        if best is None:
            return True
        if self.mode == "min":
            return value < best - self.min_delta
        return value > best + self.min_delta


class Patience:
    """One ``EarlyStopping``'s count of checks without improvement, the same rule in the kernel and on the workers.

    The workers decide the stop with it (``worker/training/early_stop.py``);
    the kernel's callback keeps the same count from the records it receives
    (``History.best``), so both name the same best check and the same stop.
    """

    def __init__(self, spec: BestSpec):
        self.spec = spec
        self.best: float | None = None
        self.best_step: int | None = None
        self.wait = 0

    def after_check(self, value: float, step: int) -> str | None:
        """The stop reason when this check ends the patience (or is not finite, with ``check_finite``), else None."""
        if self.spec.check_finite and not math.isfinite(value):
            return f"EarlyStopping: {self.spec.monitor} is {value} at step {step} (check_finite=True)"
        if self.spec.improved(value, self.best if self.best is not None else self.spec.baseline):
            self.best, self.best_step, self.wait = value, step, 0
            return None
        self.wait += 1
        if self.wait < self.spec.patience:
            return None
        best = f"{self.best:.6g} at step {self.best_step}" if self.best is not None else f"baseline {self.spec.baseline}"
        return f"EarlyStopping: {self.spec.monitor} did not improve for {self.wait} checks (best {best})"

