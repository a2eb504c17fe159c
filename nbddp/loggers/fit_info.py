"""What a fit is, told once to its loggers and callbacks when training begins.

Built in the kernel from what it knows (the options, the workers) and from
what only the workers know once the model is built (``FitPlanInfo``: steps,
the model's class and parameter count). ``hparams`` is the flat dict the
loggers record as the run's hyperparameters.
"""

from __future__ import annotations

import dataclasses
import secrets
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from nbddp.protocol.fit_options import FitConfig
from nbddp.protocol.messages import FitPlanInfo


@dataclass
class FitInfo:
    """One fit, as ``on_fit_start(info)`` and ``Logger.start(info, ...)`` see it.

    Attributes:
        run_name: the run's name in every logger (kept by a resumed fit).
        resumed: the fit continues from a checkpoint (``start_step > 0``).
        hparams: every option of the fit plus ``model_class``, ``params``,
            ``world_size``, ``backend``, ``strategy`` and ``precision``, as
            ``str``/``int``/``float``/``bool``/``None`` values.
        handle: the fit's ``nbddp.fit.handle.FitHandle`` (a callback's way to act:
            ``handle.set_lr``, ``handle.save_checkpoint``, ``handle.stop``).
    """

    run_name: str
    world_size: int
    backend: str
    strategy: str
    precision: str
    batch_size: int
    epochs: int
    total_steps: int | None  # None: a stream without max_steps (its length shows at its end)
    steps_per_epoch: int | None
    start_step: int
    resumed: bool
    model_class: str
    params: int
    checkpoint_dir: str | None = None
    hparams: dict[str, Any] = field(default_factory=dict)
    #: the kernel-side ``FitHandle`` of this fit: ``set_lr``, ``save_checkpoint``, ``stop`` from a callback
    handle: Any = field(default=None, repr=False, compare=False)


class TrainingGroup(Protocol):
    """What ``FitInfo`` says of the workers: the session (``nbddp.session.session.Session``)."""

    @property
    def world_size(self) -> int: ...

    @property
    def backend(self) -> str: ...


def plain(value: object) -> str | int | float | bool | None:
    """A value every tracker stores: numbers, strings, booleans and None as they are, the rest as text."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (set, frozenset)):
        return ",".join(sorted(map(str, value)))
    return getattr(value, "name", None) if hasattr(value, "shard_modules") else str(value)


def callable_name(fn: object) -> str | None:
    """How an optimizer, loss or scheduler is named in the hyperparameters (None when not given)."""
    if fn is None:
        return None
    return getattr(fn, "__qualname__", None) or type(fn).__qualname__


def new_run_name(model_class: str) -> str:
    short = model_class.rsplit(".", 1)[-1] or "model"
    return f"{short}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def fit_info(cfg: FitConfig, session: TrainingGroup, plan: FitPlanInfo, described: dict[str, str | None],
             run_name: str | None) -> FitInfo:
    """The ``FitInfo`` of a fit whose workers published ``plan`` (a ``messages.FitPlanInfo``)."""
    strategy = cfg.strategy if isinstance(cfg.strategy, str) else cfg.strategy.name
    info = FitInfo(run_name=run_name or new_run_name(plan.model_class), world_size=session.world_size,
                   backend=session.backend, strategy=strategy, precision=cfg.precision, batch_size=plan.batch_size,
                   epochs=cfg.epochs, total_steps=plan.total_steps, steps_per_epoch=plan.steps_per_epoch,
                   start_step=plan.start_step, resumed=bool(cfg.resume) and plan.start_step > 0,
                   model_class=plan.model_class, params=plan.params, checkpoint_dir=cfg.checkpoint_dir)
    options = {f.name: plain(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if not isinstance(cfg.strategy, str):
        options["strategy_settings"] = str(cfg.strategy)
    info.hparams = {**options, **{k: plain(v) for k, v in described.items()},
                    "model_class": info.model_class, "params": info.params, "world_size": info.world_size,
                    "backend": info.backend, "strategy": strategy, "precision": info.precision,
                    "batch_size": info.batch_size, "total_steps": info.total_steps, "nbddp_version": sys.modules["nbddp"].__version__}
    return info
