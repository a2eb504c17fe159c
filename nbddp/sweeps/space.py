"""What a sweep varies, and every check that can be made before a trial starts.

``space`` maps a name to Optuna distributions, or to a simple form:
``(low, high)`` or ``(low, high, "log")`` for a range (ints give an integer
range), a list for a choice. A name is one of the ``dist_fit`` options a
trial may change (``SWEEPABLE``), or an argument of the model factory or of
``step_fn`` (bound on the workers, so the code travels once per sweep).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable, TypeAlias

from nbddp.protocol.data_forms import DataLike

if TYPE_CHECKING:
    from optuna.distributions import BaseDistribution
    from torch import nn

from nbddp.fit.arguments import sweepable

# the dist_fit options that change one trial's FitConfig and nothing else (no topology, no files)
SWEEPABLE = sweepable()
MODES = {"min": "minimize", "max": "maximize"}
# nbddp.sweep(model=...): a module (only the fit options vary), or a factory whose arguments a trial may vary
SweepModel: TypeAlias = "nn.Module | Callable[..., nn.Module]"
# nbddp.sweep(space=...): name -> an Optuna distribution, (low, high), (low, high, "log") or a list of choices
SpaceSpec: TypeAlias = "Mapping[str, BaseDistribution | tuple[float, float] | tuple[float, float, str] | list[Any]]"


@dataclass
class Space:
    """The distributions, and where each name goes: ``"fit"``, ``"model"`` or ``"step_fn"``."""

    distributions: dict[str, BaseDistribution]
    where: dict[str, str] = field(default_factory=dict)

    def split(self, params: dict[str, Any]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
        """A trial's values as (``FitConfig`` fields, ``{"model": {...}, "step_fn": {...}}`` to bind on the workers)."""
        fit = {k: v for k, v in params.items() if self.where[k] == "fit"}
        bind = {part: {k: v for k, v in params.items() if self.where[k] == part} for part in ("model", "step_fn")}
        return fit, bind


def distribution(name: str, value: object) -> BaseDistribution:
    """``value`` as an Optuna distribution (its own checks name the bad bound)."""
    from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution

    if isinstance(value, BaseDistribution):
        return value
    try:
        if isinstance(value, list) and value:
            return CategoricalDistribution(value)
        if isinstance(value, tuple) and len(value) in (2, 3) and all(_number(v) for v in value[:2]):
            scale = value[2] if len(value) == 3 else "linear"
            if scale not in ("log", "linear"):
                raise ValueError(f"the third entry is the scale, 'log' or 'linear', not {scale!r}")
            if all(isinstance(v, int) for v in value[:2]):
                return IntDistribution(value[0], value[1], log=scale == "log")
            return FloatDistribution(float(value[0]), float(value[1]), log=scale == "log")
    except ValueError as exc:
        raise ValueError(f"nbddp.sweep(space={{{name!r}: {value!r}}}): {exc}") from None
    raise TypeError(f"nbddp.sweep(space={{{name!r}: {value!r}}}) must be an Optuna distribution, (low, high), "
                    "(low, high, 'log') or a non-empty list of choices, e.g. {'lr': (1e-4, 1e-1, 'log'), "
                    "'width': [64, 128]}")


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def arguments(fn: Callable[..., Any], skip: int = 0) -> tuple[set[str], bool]:
    """The keyword-bindable argument names of ``fn`` (its first ``skip`` left out), and whether it takes ``**kwargs``."""
    try:
        params = list(inspect.signature(fn).parameters.values())[skip:]
    except (TypeError, ValueError):  # a builtin without a signature
        return set(), False
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name for p in params if p.kind in kinds}, any(p.kind is p.VAR_KEYWORD for p in params)


def build_space(space: SpaceSpec, model: SweepModel, step_fn: Callable[..., Any] | None,
                given: dict[str, Any]) -> Space:
    """Check ``space`` against what a trial can vary; ``given``: the fit options passed to the sweep."""
    import torch

    if not isinstance(space, dict) or not space:
        raise ValueError(f"nbddp.sweep(space=...) must be a non-empty dict of name -> range, got {space!r}; "
                         "e.g. space={'lr': (1e-4, 1e-1, 'log'), 'width': [64, 128]}")
    factory = None if isinstance(model, torch.nn.Module) else model
    model_args, model_any = arguments(factory) if factory is not None else (set(), False)
    step_args, step_any = arguments(step_fn, skip=2) if step_fn is not None else (set(), False)
    out = Space({})
    for name, value in space.items():
        if name in given:
            raise ValueError(f"nbddp.sweep: {name!r} is both in space and given as {name}={given[name]!r}; "
                             "keep one of them")
        if name in SWEEPABLE:
            out.where[name] = "fit"
        elif name in model_args or (model_any and factory is not None):
            out.where[name] = "model"
        elif name in step_args or step_any:
            out.where[name] = "step_fn"
        else:
            raise ValueError(_unknown(name, factory, model_args, step_fn, step_args))
        out.distributions[name] = distribution(name, value)
    return out


def _unknown(name: str, factory: Callable[..., Any] | None, model_args: set[str], step_fn: Callable[..., Any] | None,
             step_args: set[str]) -> str:
    where = [f"the dist_fit options a trial may change ({', '.join(SWEEPABLE)})"]
    if factory is not None:
        where.append(f"the model factory's arguments ({', '.join(sorted(model_args)) or 'none'})")
    else:
        where.append("no model argument (model is an nn.Module object: pass a factory, e.g. "
                     "model=lambda width=64: Net(width), to sweep its arguments)")
    if step_fn is not None:
        where.append(f"step_fn's arguments after (model, batch) ({', '.join(sorted(step_args)) or 'none'})")
    return f"nbddp.sweep(space=...) names {name!r}, which is none of: {'; '.join(where)}. Fix the name or drop it"


def check_run(n_trials: int, mode: str, workers_per_trial: int, world: int) -> None:
    """The sweep's own arguments, against the running workers."""
    for arg, value in (("n_trials", n_trials), ("workers_per_trial", workers_per_trial)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"nbddp.sweep({arg}={value!r}) must be an int >= 1")
    if mode not in MODES:
        raise ValueError(f"nbddp.sweep(mode={mode!r}) must be 'min' or 'max' (is a lower or a higher metric better?)")
    if world % workers_per_trial:
        raise ValueError(f"nbddp.sweep(workers_per_trial={workers_per_trial}) must divide the {world} running "
                         f"workers into whole groups; use one of {[k for k in range(1, world + 1) if world % k == 0]}")


def check_metric(metric: str, val_data: DataLike | None, metrics: dict[str, Any] | None,
                 step_fn: Callable[..., Any] | None) -> None:
    """``metric`` must be a value every trial's records carry (epoch and validation records)."""
    reported = {"loss"}
    if val_data is not None:
        reported |= {"val_loss", *(f"val_{m}" for m in (metrics or {}))}
        if step_fn is not None and isinstance(metric, str) and metric.startswith("val_"):
            return  # a step_fn's own values are validated as val_<name>: only the fit knows them
    if metric not in reported:
        hint = " (validation values need val_data=...)" if val_data is None and str(metric).startswith("val_") else ""
        raise ValueError(f"nbddp.sweep(metric={metric!r}) is not reported by these fits{hint}: they report "
                         f"{sorted(reported)}; pick one of them")


def check_strategy(options: dict[str, Any], workers_per_trial: int) -> None:
    """A trial trains over its own group of ``workers_per_trial`` ranks, with any of ``dist_fit``'s strategies.

    DDP and FSDP are data-parallel over the group; a model-parallel setting
    (``mesh``, ``nbddp.Pipeline``, ``nbddp.TensorParallel``) lays one model over
    the group's ranks, its mesh built from them (``DeviceMesh.from_group`` on
    the workers, as the scaling report's subgroups do). The fit's own checks
    then run for a world of ``workers_per_trial`` (``preflight.prepare``); a
    mesh given here must span exactly one group, which is checked first so that
    the error names the sweep's setting rather than the running workers.
    """
    mesh = options.get("mesh")
    if isinstance(mesh, dict) and all(isinstance(v, int) and not isinstance(v, bool) for v in mesh.values()):
        size = 1
        for value in mesh.values():
            size *= value
        if size != workers_per_trial:
            raise ValueError(f"nbddp.sweep(mesh={mesh}) spans {size} ranks, but each trial trains on its own group of "
                             f"workers_per_trial={workers_per_trial}: the product of the mesh's sizes must be "
                             f"workers_per_trial. Pass workers_per_trial={size} (it must divide the running workers), "
                             f"or a mesh of {workers_per_trial} ranks")


def pop_restarts(options: dict[str, Any]) -> tuple[int, int | str | float | None]:
    """``max_restarts`` and ``snapshot_every`` taken out of the fit options.

    ``max_restarts`` (default 1): how many times a trial whose worker died
    goes on. Without ``snapshot_every`` it runs again from its start, as a new
    trial with the same parameters; with it, each trial snapshots its state as
    an elastic ``dist_fit`` does and the same trial resumes from its newest
    snapshot on the healed group (``sweeps/resume.py``). ``retry_on`` is
    refused: a trial's own error fails that trial, and the sweep goes on; so
    is ``min_workers``: a trial is not shrunk onto fewer workers.
    """
    from nbddp.elastic.policy import snapshot_interval

    if "retry_on" in options:
        raise ValueError("nbddp.sweep(retry_on=...) is not supported: a trial that raises is recorded as failed and the "
                         "sweep goes on; only a trial whose worker died is run again or resumed (max_restarts, "
                         "snapshot_every). Leave retry_on out")
    if "min_workers" in options:
        raise ValueError("nbddp.sweep(min_workers=...) is not supported: a trial keeps the workers_per_trial workers it "
                         "began on; a trial whose worker died is run again or resumed on healed workers (max_restarts, "
                         "snapshot_every). Leave min_workers out")
    restarts = options.pop("max_restarts", 1)
    if isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < 0:
        raise ValueError(f"nbddp.sweep(max_restarts={restarts!r}) must be an int >= 0: how many times a trial whose "
                         "worker died is run again (default 1; 0: never)")
    every = options.pop("snapshot_every", None)
    if every is None:
        return restarts, None
    if restarts == 0:
        raise ValueError(f"nbddp.sweep(snapshot_every={every!r}) takes effect only when a trial whose worker died "
                         "goes on; pass max_restarts=N (N >= 1) too, or leave snapshot_every out")
    try:
        return restarts, snapshot_interval(every)
    except ValueError as exc:  # the same forms as dist_fit's, named for the sweep
        raise ValueError(str(exc).replace("dist_fit(", "nbddp.sweep(", 1)) from None
