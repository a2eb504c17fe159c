"""Before a fit: check every argument the kernel can judge, then ship them.

``plan_fit`` turns the person's arguments (``FitArguments``) into a ``FitPlan``: the validated
``FitConfig``, what each rank is told (``FitLaunch``), and the pickled
arguments (one ``Parcel`` per kind of host). Everything that can be known
before a worker starts is raised here, naming the argument and the fix, so
a typo costs an error message and nothing changes on the workers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from nbddp.shipping import pickling as shipping
from nbddp.protocol.errors import ShippingError
from nbddp.protocol.messages import FitLaunch
from nbddp.elastic.fewer_ranks import check_min_workers
from nbddp.elastic.policy import check_elastic
from nbddp.execution.policy import FailurePolicy
from nbddp.fit.arguments import DataOptions, FitArguments, ModelLike, ResultOptions, StepOptions, ValidationOptions
from nbddp.fit.compile_checks import with_cache_dir
from nbddp.fit.option_checks import config_of, scheduler_settings
from nbddp.protocol.data_forms import DataLike, DataSpec, data_spec
from nbddp.protocol.fit_options import FitConfig, check_device_rules
from nbddp.protocol.parallel_settings import data_parallel_size, is_replicated, settings_of
from nbddp.session.session import Session

if TYPE_CHECKING:
    from torch.nn import Module


@dataclass
class FitPlan:
    cfg: FitConfig
    launch: FitLaunch
    model: Module | None  # the person's nn.Module (weights come back into it) or None for a factory
    factory: Callable[[], Module] | None = None  # the model factory, when the kernel builds the module weights go into
    parcels: dict[bool, shipping.Parcel] = field(default_factory=dict)  # local? -> parcel
    model_parcels: dict[bool, shipping.Parcel] = field(default_factory=dict)  # the model alone (sharded training)
    ship_s: float = 0.0
    data_keys: list[str] = field(default_factory=list)  # resident on the workers once this fit succeeds
    policy: FailurePolicy = field(default_factory=FailurePolicy)  # max_restarts, snapshot_every, retry_on, min_workers

    def discard(self) -> None:
        for parcel in [*self.parcels.values(), *self.model_parcels.values()]:
            parcel.discard()


def keep_loader_settings(settings: dict[str, Any] | None, data: DataOptions) -> DataOptions:
    """A DataLoader's own settings become the fit's; where ``dist_fit``'s arguments say otherwise, it is an error.

    Silently preferring either would surprise someone: the loader's author
    or the caller of ``dist_fit``. ``shuffle`` defaults to True without a loader.
    """
    if settings is None or "shuffle" not in settings:  # no loader, or one over a stream (no order to keep)
        data = replace(data, shuffle=True if data.shuffle is None else data.shuffle)
    if settings is None:
        return data
    if (data.batch_size is not None and settings["batch_size"] is not None
            and data.batch_size != settings["batch_size"]):
        raise ValueError(f"dist_fit(batch_size={data.batch_size!r}) and the DataLoader's "
                         f"batch_size={settings['batch_size']} disagree; give one of them: leave batch_size out of "
                         "dist_fit to use the loader's, or build the loader with the batch size you want (it is per "
                         "rank)")
    for name in ("shuffle", "num_workers", "pin_memory"):
        if name not in settings:
            continue
        given, own = getattr(data, name), settings[name]
        if given is None:
            data = replace(data, **{name: own})
        elif given != own:
            raise ValueError(f"dist_fit({name}={given!r}) and the DataLoader's {name}={own!r} disagree; leave "
                             f"{name} out of dist_fit to keep the loader's, or build the loader with {name}={given!r}")
    return data


def check_model(model: ModelLike) -> tuple[Module | None, Callable[[], Module] | None]:
    """``(module, None)``: the module the weights come back into; ``(None, factory)``: built on each worker."""
    import torch

    if isinstance(model, torch.nn.Module):
        return model, None
    if isinstance(model, type) and issubclass(model, torch.nn.Module):
        return None, model  # a Module class is a factory: Net() is built on each worker
    if callable(model) and not isinstance(model, type):
        return None, model
    what = f"the class {model.__name__}, which is not an nn.Module" if isinstance(model, type) else type(model).__name__
    raise TypeError(f"dist_fit(model=...) must be a torch.nn.Module or a zero-argument function returning one; got {what}")


def _check_callable(name: str, value: object) -> None:
    if value is not None and not callable(value):
        raise TypeError(f"dist_fit({name}=...) must be callable, got {type(value).__name__} {value!r}")


def check_functions(step: StepOptions, validation: ValidationOptions) -> None:
    """The optimizer, metrics and the other callables, and how they combine (``step.scheduler``: the factory, a
    Lightning dict's taken out of it)."""
    import torch

    for name in ("loss_fn", "scheduler", "step_fn"):
        _check_callable(name, getattr(step, name))
    optimizer, lr, metrics = step.optimizer, step.lr, validation.metrics
    if optimizer is not None:
        if isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                "dist_fit(optimizer=...) got an optimizer already built on the notebook's parameters; each rank needs its own. "
                "Pass the class (optimizer=torch.optim.SGD, with lr=...) or a factory: optimizer=lambda params: torch.optim.SGD(params, lr=0.1)"
            )
        _check_callable("optimizer", optimizer)
        is_class = isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer)
        if lr is not None and not is_class:
            raise ValueError(
                f"dist_fit(lr={lr!r}) is only used for the default optimizer or an optimizer class; a factory sets its "
                "own learning rate. Put it in the factory (optimizer=lambda params: torch.optim.SGD(params, lr=...)) "
                "and drop lr=..., or pass the class (optimizer=torch.optim.SGD, lr=...)"
            )
    if metrics is not None:
        if not isinstance(metrics, Mapping) or not all(isinstance(k, str) and callable(v) for k, v in metrics.items()):
            raise TypeError("dist_fit(metrics=...) must be a dict of name -> fn(output, target), e.g. {'acc': accuracy}")
        if validation.val_data is None:
            raise ValueError("dist_fit(metrics=...) are computed on validation data; pass val_data=... too")
        if step.step_fn is not None:
            raise ValueError("dist_fit(metrics=...) cannot see outputs inside a step_fn; return the values in step_fn's dict instead")


def check_keep(keep: str | None, return_weights: bool) -> None:
    import keyword

    if keep is not None and (not isinstance(keep, str) or not keep.isidentifier() or keyword.iskeyword(keep)):
        raise ValueError(f"dist_fit(keep=...) names the variable that holds the trained module in every rank's %%ddp "
                         f"namespace, so it must be a Python identifier like 'model'; got {keep!r}")
    if not isinstance(return_weights, bool):
        raise TypeError(f"dist_fit(return_weights=...) must be True or False, got {return_weights!r}")


def check_units(model: ModelLike, cfg: FitConfig) -> None:
    """Module classes named for sharding or checkpointing must exist in the model (a factory is built on meta)."""
    import torch

    from nbddp.partitioning.blocks import units

    named = [(where, n) for where, n in (("nbddp.FSDP(shard_modules=...)", getattr(cfg.strategy, "shard_modules", None)),
                                          ("dist_fit(activation_checkpointing=...)", cfg.activation_checkpointing))
             if isinstance(n, frozenset)]
    if not named:
        return
    if not isinstance(model, torch.nn.Module):
        with torch.device("meta"):
            model = model()
    for where, group in named:
        try:
            units(model, group)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None


def check_topology(model: ModelLike, cfg: FitConfig, world: int, step_fn: Callable[..., Any] | None,
                   stream: bool = False, keep: str | None = None) -> None:
    """A model-parallel strategy and its mesh, for these workers, this model and this data (``parallel_checks.py``);
    then what the fit asks of the strategy (a stream, ``keep=``), as it declares it."""
    from nbddp.fit.parallel_checks import check_batch, check_model, resolve

    cfg.strategy, cfg.mesh = resolve(cfg.strategy, cfg.mesh, world)
    check_batch(cfg.strategy, cfg.batch_size, step_fn, cfg.precision)
    check_model(model, cfg.strategy, cfg.mesh)
    if stream:
        settings_of(cfg.strategy).require("streams", "data=...", "Give a map-style Dataset")
    if keep is not None:  # predict(model=keep) runs what the fit leaves bound there
        settings_of(cfg.strategy).require("kept_as", "keep=...", "Leave keep out")


def check_shard(cfg: FitConfig, n: int, world: int) -> None:
    """``world``: the data-parallel ranks (the ranks of one pipeline or TP group share a shard)."""
    shard = n // world if cfg.drop_last else -(-n // world)
    if shard < cfg.batch_size:
        raise ValueError(
            f"dist_fit(batch_size={cfg.batch_size}) is larger than each rank's shard: {n} samples over {world} ranks "
            f"gives {shard} per rank. batch_size is per rank; use batch_size<={max(shard, 1)} or fewer workers."
        )


def prepare(session: Session, model: ModelLike, data: DataLike, *, world: int | None = None,
            **options: Any) -> FitPlan:
    """``plan_fit`` for the calls that take ``dist_fit``'s options flat and watch no fit of their own (``sweep``,
    ``find_batch_size``, ``scaling_report``): ``WatchOptions``' names (``block``, ``live``, ...) are unknown to them."""
    return plan_fit(session, model, data, FitArguments.of(options, watched=False), world)


def plan_fit(session: Session, model: ModelLike, data: DataLike, args: FitArguments,
             world: int | None = None) -> FitPlan:
    """Check everything, then pack the arguments for the workers.

    ``world``: the ranks one fit trains on, when not every worker (a sweep's trial group): the mesh and the
    data shards are checked for that many."""
    world = world or session.world_size
    step, validation = args.step, args.validation
    policy = check_elastic(args.faults.max_restarts, args.faults.snapshot_every, args.faults.retry_on)
    returned, factory = check_model(model)
    check_keep(args.result.keep, args.result.return_weights)
    spec, n_train, loader_bs = data_spec(data, "dist_fit(data=...)")
    if n_train == 0:
        raise ValueError("dist_fit(data=...) is empty (len 0); nothing to train on")
    val_spec = None
    if validation.val_data is not None:
        val_spec, n_val, _ = data_spec(validation.val_data, "dist_fit(val_data=...)")
        if n_val == 0:
            raise ValueError("dist_fit(val_data=...) is empty (len 0); pass None to skip validation")
    scheduler, scheduler_options = scheduler_settings(step.scheduler)
    check_functions(replace(step, scheduler=scheduler), validation)
    loading = keep_loader_settings(spec.loader, args.data)
    batch_size = loading.batch_size if loading.batch_size is not None else (loader_bs or 32)
    cfg = config_of(replace(args, data=loading), batch_size=batch_size, snapshot_every=policy.snapshot_every,
                    **scheduler_options)
    min_workers = args.faults.min_workers
    if min_workers is not None:  # going on with fewer ranks: the shards they began with, read by fewer
        policy = replace(policy, min_workers=check_min_workers(min_workers, policy.max_restarts, session.world_size,
                                                                 cfg.strategy, bool(getattr(spec, "stream", False))))
        cfg.data_world = session.world_size
    check_device_rules(cfg.precision, cfg.sync_batchnorm, {p.device.split(":")[0] for p in session.placements},
                       cfg.strategy)
    cfg.compile = with_cache_dir(cfg.compile, session.file_prefix)
    check_units(model, cfg)
    check_topology(model, cfg, world, step.step_fn, stream=bool(getattr(spec, "stream", False)), keep=args.result.keep)
    if n_train is not None:
        check_shard(cfg, n_train, data_parallel_size(cfg.strategy, cfg.mesh, world))
    plan = _plan(session, returned, factory, cfg, args.result, policy, spec, val_spec)
    parts = {"model": model, "data": spec, "val_data": val_spec, "loss_fn": step.loss_fn, "optimizer": step.optimizer,
             "scheduler": scheduler, "metrics": dict(validation.metrics) if validation.metrics else None,
             "step_fn": step.step_fn}
    if not is_replicated(cfg.strategy) and returned is not None:
        parts["model"] = None  # travels alone, so that each rank can keep only its shard of it
        ship(session, plan, {"model": model}, plan.model_parcels, pooled=False)
    ship(session, plan, parts, plan.parcels)
    return plan


def _plan(session: Session, returned: Module | None, factory: Callable[[], Module] | None, cfg: FitConfig,
          result: ResultOptions, policy: FailurePolicy, spec: DataSpec, val_spec: DataSpec | None) -> FitPlan:
    """The plan before shipping: what rank 0 returns, and which datasets the workers may keep."""
    # a relaunch runs on replaced workers whose dataset caches are empty: an elastic fit ships its data whole
    keys = session.resident.key_specs([spec, val_spec], by_value=policy.restarts)
    launch = FitLaunch(generation=session.generation, returns=_returns(returned, cfg, result.return_weights),
                       resident=session.resident.to_keep(keys), keep=result.keep)
    return FitPlan(cfg=cfg, launch=launch, model=returned if result.return_weights else None,
                   factory=factory if launch.returns == "state_dict" else None, data_keys=keys, policy=policy)


def _returns(model: Module | None, cfg: FitConfig, return_weights: bool) -> str:
    """What rank 0 sends back: the weights (into the notebook's model), the trained module, or nothing."""
    if not return_weights:
        return "none"
    if model is not None or not is_replicated(cfg.strategy):  # a sharded module cannot travel whole: the kernel builds one
        return "state_dict"
    return "module"


def ship(session: Session, plan: FitPlan, parts: dict[str, Any], into: dict[bool, shipping.Parcel],
         pooled: bool = True) -> None:
    """Pack ``parts`` once per kind of host (shared memory on the kernel's, inline elsewhere).

    ``pooled=False``: a file of its own, never rewritten, for what the workers
    keep reading after the fit's start (a sharded model's views).
    """
    t0 = time.perf_counter()
    try:
        for local in sorted({p.local for p in session.placements}, reverse=True):
            into[local] = shipping.pack(parts, what="the dist_fit arguments", local=local,
                                        pool=session.send_pool if local and pooled else None,
                                        prefix=session.file_prefix)
    except ShippingError:
        plan.discard()
        _raise_for_unpicklable_argument(parts)
        raise
    except BaseException:
        plan.discard()
        raise
    plan.ship_s += time.perf_counter() - t0


def _raise_for_unpicklable_argument(parts: dict[str, Any]) -> None:
    """After a failed pack: pickle each argument alone to name the one that fails.

    Only on the failure path: pickling every argument again on each fit would
    double the cost of shipping.
    """
    for name, value in parts.items():
        if name in ("data", "val_data") and value is not None:
            value = value.dataset if value.dataset is not None else value.factory
        shipping.dumps(value, what=f"dist_fit({name}=...)", label=name)
