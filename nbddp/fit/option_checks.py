"""``dist_fit``'s keyword arguments checked in the kernel and turned into a ``FitConfig``.

Every bad value fails here, before any worker starts work, with a message
that names the argument, the value and the fix. The record itself
(``protocol/fit_options.py``) is what travels to the workers.
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Callable
from dataclasses import fields
from typing import TYPE_CHECKING, Any, Literal, overload

from nbddp.fit.arguments import FitArguments, ModuleClasses, SchedulerLike
from nbddp.fit.compile_checks import resolve_compile
from nbddp.protocol.fit_options import ON_NAN, PRECISION_ALIASES, PRECISIONS, SCHEDULER_INTERVALS, FitConfig
from nbddp.protocol.mesh_layout import check_mesh_shape
from nbddp.protocol.parallel_settings import is_replicated, module_classes, resolve_strategy
from nbddp.protocol.profile_spec import profile_spec

if TYPE_CHECKING:
    from torch.optim import Optimizer


@overload
def _int(name: str, value: object, minimum: int, allow_none: Literal[False] = False) -> int: ...


@overload
def _int(name: str, value: object, minimum: int, allow_none: bool) -> int | None: ...


def _int(name: str, value: object, minimum: int, allow_none: bool = False) -> int | None:
    """``value`` (as the person gave it) as an int ``>= minimum``, or None when that is allowed."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"dist_fit({name}=...) must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"dist_fit({name}=...) must be >= {minimum}, got {value}")
    return int(value)


@overload
def _float(name: str, value: object, minimum: float, allow_none: Literal[False] = False,
           strict: bool = False) -> float: ...


@overload
def _float(name: str, value: object, minimum: float, allow_none: bool, strict: bool = False) -> float | None: ...


def _float(name: str, value: object, minimum: float, allow_none: bool = False, strict: bool = False) -> float | None:
    """``value`` as a float ``>= minimum`` (``> minimum`` when ``strict``; never NaN), or None when that is allowed."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"dist_fit({name}=...) must be a number, got {type(value).__name__} {value!r}")
    if value < minimum or (strict and value == minimum) or value != value:
        bound = f"> {minimum}" if strict else f">= {minimum}"
        raise ValueError(f"dist_fit({name}=...) must be {bound}, got {value}")
    return float(value)


def _bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"dist_fit({name}=...) must be True or False, got {type(value).__name__} {value!r}")
    return value


KERNEL_SET = {"snapshot_dir", "from_snapshot", "data_world"}  # set by the kernel for an elastic fit, never by a person


def config_of(args: FitArguments, **decided: Any) -> FitConfig:
    """The checked ``FitConfig`` of a fit's options: each field from the option of its name, or from what the kernel
    ``decided`` instead (the batch size a loader gave, the checked snapshot interval, a scheduler dict's settings)."""
    names = {f.name for f in fields(FitConfig)}
    return make_config(**{**{k: v for k, v in args.by_name().items() if k in names}, **decided})


def make_config(**options: Any) -> FitConfig:
    """Check every plain option and build a ``FitConfig``.

    Raises:
        TypeError / ValueError: naming the option, the bad value and what it
            should be.
    """
    known = {f.name for f in fields(FitConfig)} - KERNEL_SET
    unknown = set(options) - known
    if unknown:
        raise TypeError(f"dist_fit() got unknown option(s) {sorted(unknown)}; see help(nbddp.dist_fit) for the options")
    cfg = FitConfig(**options)
    cfg.epochs = _int("epochs", cfg.epochs, 1)
    cfg.max_steps = _int("max_steps", cfg.max_steps, 1, allow_none=True)
    cfg.batch_size = _int("batch_size", cfg.batch_size, 1)
    cfg.lr = _float("lr", cfg.lr, 0.0, allow_none=True)
    cfg.shuffle = _bool("shuffle", cfg.shuffle)
    cfg.seed = _int("seed", cfg.seed, 0)
    cfg.precision = canonical_precision(cfg.precision)
    cfg.grad_accum = _int("grad_accum", cfg.grad_accum, 1)
    cfg.clip_grad_norm = _float("clip_grad_norm", cfg.clip_grad_norm, 0.0, allow_none=True, strict=True)
    cfg.sync_batchnorm = _bool("sync_batchnorm", cfg.sync_batchnorm)
    cfg.profile = profile_spec(cfg.profile)
    _check_checkpoints(cfg)
    cfg.log_every = _int("log_every", cfg.log_every, 1)
    if cfg.val_every == "epoch":
        cfg.val_every = None
    cfg.val_every = _int("val_every", cfg.val_every, 1, allow_none=True)
    cfg.strategy = resolve_strategy(cfg.strategy)
    cfg.mesh = check_mesh_shape(cfg.mesh)
    cfg.activation_checkpointing = _checkpointing(cfg.activation_checkpointing)
    cfg.compile = resolve_compile(cfg.compile)
    if not is_replicated(cfg.strategy) and cfg.sync_batchnorm:
        raise ValueError("dist_fit(sync_batchnorm=True) is not supported with strategy='fsdp': FSDP does not synchronise "
                         "buffers, so BatchNorm statistics would differ across ranks. Use strategy='ddp' for SyncBatchNorm.")
    if cfg.scheduler_interval is not None and cfg.scheduler_interval not in SCHEDULER_INTERVALS:
        raise ValueError(f"dist_fit(scheduler_interval=...) must be 'step' (after every optimizer step) or 'epoch' "
                         f"(after every epoch), or None to let the scheduler's kind decide; got "
                         f"{cfg.scheduler_interval!r}")
    _check_loading(cfg)
    if cfg.on_nan not in ON_NAN:
        raise ValueError(f"dist_fit(on_nan=...) says what a NaN or inf loss does: 'raise' (the default: the fit fails), "
                         f"'stop' (end cleanly with the last good weights) or 'skip' (drop that step's update); got "
                         f"{cfg.on_nan!r}")
    cfg.record_interval_s = _float("record_interval_s", cfg.record_interval_s, 0.0, strict=True)
    cfg.publish_interval_s = _float("publish_interval_s", cfg.publish_interval_s, 0.0)
    return cfg


def _check_checkpoints(cfg: FitConfig) -> None:
    if cfg.checkpoint_dir is not None:
        if not isinstance(cfg.checkpoint_dir, (str, os.PathLike)):
            raise TypeError(f"dist_fit(checkpoint_dir=...) must be a path, got {type(cfg.checkpoint_dir).__name__}")
        cfg.checkpoint_dir = os.path.abspath(os.fspath(cfg.checkpoint_dir))
    cfg.checkpoint_every = _int("checkpoint_every", cfg.checkpoint_every, 1, allow_none=True)
    if cfg.checkpoint_every and not cfg.checkpoint_dir:
        raise ValueError("dist_fit(checkpoint_every=...) needs checkpoint_dir=... to say where checkpoints go")
    if isinstance(cfg.resume, os.PathLike):
        cfg.resume = os.fspath(cfg.resume)
    if not isinstance(cfg.resume, (bool, str)):
        raise TypeError(f"dist_fit(resume=...) must be True/False or a checkpoint path, got {type(cfg.resume).__name__}")
    if cfg.resume is True and not cfg.checkpoint_dir:
        raise ValueError("dist_fit(resume=True) resumes from checkpoint_dir; pass checkpoint_dir=... or resume='path/to/ckpt'")
    if isinstance(cfg.resume, str):
        cfg.resume = os.path.abspath(cfg.resume)
    cfg.trust_checkpoint = _bool("trust_checkpoint", cfg.trust_checkpoint)
    from nbddp.worker.tasks.checkpoint_check import check_resume

    check_resume(cfg.resume, cfg.checkpoint_dir, cfg.trust_checkpoint)  # a file someone else wrote: refused here


def _check_loading(cfg: FitConfig) -> None:
    cfg.drop_last = _bool("drop_last", cfg.drop_last)
    cfg.num_workers = _int("num_workers", cfg.num_workers, 0, allow_none=True)
    cfg.prefetch = _int("prefetch", cfg.prefetch, 0)
    if cfg.prefetch > 2:
        raise ValueError(f"dist_fit(prefetch=...) is how many batches are copied to the GPU ahead of the step: 0, 1 or "
                         f"2 (more only holds more batches in GPU memory), got {cfg.prefetch}")
    if cfg.pin_memory is not None:
        cfg.pin_memory = _bool("pin_memory", cfg.pin_memory)


def _checkpointing(value: ModuleClasses | None) -> bool | frozenset[str] | None:
    """``activation_checkpointing``: False, True (every unit), or module classes / class names."""
    if isinstance(value, bool):
        return value
    if value is None:
        return False
    return module_classes(value, "dist_fit(activation_checkpointing=...)", " (or True for every unit)")


def canonical_precision(value: object) -> str:
    """``"32-true"``, ``"bf16-mixed"`` or ``"16-mixed"``; ``"32"`` and ``"bf16"`` are accepted as aliases."""
    if isinstance(value, str) and value in PRECISIONS:
        return value
    if isinstance(value, str) and value in PRECISION_ALIASES:
        return PRECISION_ALIASES[value]
    guesses = {32: "32-true", "fp32": "32-true", "16": "16-mixed", 16: "16-mixed", "fp16": "16-mixed",
               "bf16-true": "bf16-mixed", "bfloat16": "bf16-mixed"}
    hint = f" (did you mean {guesses[value]!r}?)" if isinstance(value, (str, int)) and value in guesses else ""
    raise ValueError(f"dist_fit(precision=...) must be one of {PRECISIONS} (or the aliases '32', 'bf16'), "
                     f"got {value!r}{hint}")


SCHEDULER_KEYS = ("scheduler", "interval", "frequency", "monitor")


def scheduler_settings(scheduler: SchedulerLike | None) -> tuple[Callable[[Optimizer], Any] | None, dict[str, Any]]:
    """``(factory, options)``: a Lightning-style dict ``{"scheduler": f, "interval": ..., "frequency": k, "monitor": ...}``.

    The dict's settings become ``scheduler_interval``, ``scheduler_frequency``
    and ``scheduler_monitor`` (they decide over ``dist_fit``'s own
    ``scheduler_interval``, as the dict is the more specific of the two). A
    plain factory gives no options.
    """
    if not isinstance(scheduler, dict):
        return scheduler, {}
    unknown = sorted(set(scheduler) - set(SCHEDULER_KEYS))
    if unknown or "scheduler" not in scheduler:
        raise ValueError(f"dist_fit(scheduler={{...}}) takes Lightning's keys {SCHEDULER_KEYS}, with 'scheduler' a "
                         f"factory optimizer -> LR scheduler; got the keys {sorted(scheduler)}")
    frequency, monitor = scheduler.get("frequency", 1), scheduler.get("monitor")
    if isinstance(frequency, bool) or not isinstance(frequency, int) or frequency < 1:
        raise ValueError(f"dist_fit(scheduler={{'frequency': ...}}) steps the scheduler every k-th interval: an int "
                         f">= 1; got {frequency!r}")
    if monitor is not None and not isinstance(monitor, str):
        raise TypeError(f"dist_fit(scheduler={{'monitor': ...}}) names a recorded value such as 'val_loss'; got "
                        f"{type(monitor).__name__} {monitor!r}")
    options = {"scheduler_frequency": frequency, "scheduler_monitor": monitor}
    if "interval" in scheduler:
        options["scheduler_interval"] = scheduler["interval"]
    return scheduler["scheduler"], options
