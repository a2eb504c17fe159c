"""Before a fit: check every argument the kernel can judge, then ship them.

``prepare`` turns the person's arguments into a ``FitPlan``: the validated
``FitConfig``, what each rank is told (``FitLaunch``), and the pickled
arguments (one ``Parcel`` per kind of host). Everything that can be known
before a worker starts is raised here, naming the argument and the fix, so
a typo costs an error message and nothing changes on the workers.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from nbddp.shipping import pickling as shipping
from nbddp.protocol.errors import ShippingError
from nbddp.protocol.messages import FitLaunch
from nbddp.elastic.fewer_ranks import check_min_workers
from nbddp.elastic.policy import check_elastic
from nbddp.execution.policy import FailurePolicy
from nbddp.fit.compile_checks import with_cache_dir
from nbddp.fit.option_checks import make_config, scheduler_settings
from nbddp.protocol.data_forms import data_spec
from nbddp.protocol.fit_options import FitConfig, check_device_rules
from nbddp.protocol.parallel_settings import data_parallel_size, is_replicated, settings_of


@dataclass
class FitPlan:
    cfg: FitConfig
    launch: FitLaunch
    model: Any  # the person's nn.Module (weights come back into it) or None for a factory
    factory: Any = None  # the model factory, when the kernel builds the module the weights go into
    parcels: dict[bool, shipping.Parcel] = field(default_factory=dict)  # local? -> parcel
    model_parcels: dict[bool, shipping.Parcel] = field(default_factory=dict)  # the model alone (sharded training)
    ship_s: float = 0.0
    data_keys: list[str] = field(default_factory=list)  # resident on the workers once this fit succeeds
    policy: FailurePolicy = field(default_factory=FailurePolicy)  # max_restarts, snapshot_every, retry_on, min_workers

    def discard(self) -> None:
        for parcel in [*self.parcels.values(), *self.model_parcels.values()]:
            parcel.discard()


def keep_loader_settings(settings: dict[str, Any] | None, batch_size: Any, options: dict[str, Any]) -> None:
    """A DataLoader's own settings become the fit's; where ``dist_fit``'s arguments say otherwise, it is an error.

    Silently preferring either would surprise someone: the loader's author
    or the caller of ``dist_fit``. ``shuffle`` defaults to True without a loader.
    """
    if settings is None or "shuffle" not in settings:  # no loader, or one over a stream (no order to keep)
        options["shuffle"] = True if options.get("shuffle") is None else options["shuffle"]
    if settings is None:
        return
    if batch_size is not None and settings["batch_size"] is not None and batch_size != settings["batch_size"]:
        raise ValueError(f"dist_fit(batch_size={batch_size!r}) and the DataLoader's batch_size={settings['batch_size']} "
                         "disagree; give one of them: leave batch_size out of dist_fit to use the loader's, or build "
                         "the loader with the batch size you want (it is per rank)")
    for name in ("shuffle", "num_workers", "pin_memory"):
        if name not in settings:
            continue
        given, own = options.get(name), settings[name]
        if given is None:
            options[name] = own
        elif given != own:
            raise ValueError(f"dist_fit({name}={given!r}) and the DataLoader's {name}={own!r} disagree; leave "
                             f"{name} out of dist_fit to keep the loader's, or build the loader with {name}={given!r}")


def check_model(model: Any) -> Any:
    """The module the weights come back into, or None for a factory (built on each worker)."""
    import torch

    if isinstance(model, torch.nn.Module):
        return model
    if isinstance(model, type) and issubclass(model, torch.nn.Module):
        return None  # a Module class is a factory: Net() is built on each worker
    if callable(model) and not isinstance(model, type):
        return None
    what = f"the class {model.__name__}, which is not an nn.Module" if isinstance(model, type) else type(model).__name__
    raise TypeError(f"dist_fit(model=...) must be a torch.nn.Module or a zero-argument function returning one; got {what}")


def _check_callable(name: str, value: Any) -> None:
    if value is not None and not callable(value):
        raise TypeError(f"dist_fit({name}=...) must be callable, got {type(value).__name__} {value!r}")


def check_functions(optimizer: Any, lr: Any, metrics: Any, val_data: Any, step_fn: Any, **callables: Any) -> None:
    """The optimizer, metrics and the other callables, and how they combine."""
    import torch

    for name, value in callables.items():
        _check_callable(name, value)
    _check_callable("step_fn", step_fn)
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
        if val_data is None:
            raise ValueError("dist_fit(metrics=...) are computed on validation data; pass val_data=... too")
        if step_fn is not None:
            raise ValueError("dist_fit(metrics=...) cannot see outputs inside a step_fn; return the values in step_fn's dict instead")


def check_keep(keep: Any, return_weights: Any) -> None:
    import keyword

    if keep is not None and (not isinstance(keep, str) or not keep.isidentifier() or keyword.iskeyword(keep)):
        raise ValueError(f"dist_fit(keep=...) names the variable that holds the trained module in every rank's %%ddp "
                         f"namespace, so it must be a Python identifier like 'model'; got {keep!r}")
    if not isinstance(return_weights, bool):
        raise TypeError(f"dist_fit(return_weights=...) must be True or False, got {return_weights!r}")


def check_units(model: Any, cfg: FitConfig) -> None:
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


def check_topology(model: Any, cfg: FitConfig, world: int, step_fn: Any, stream: bool = False,
                   keep: str | None = None) -> None:
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


def prepare(session: Any, model: Any, data: Any, *, val_data: Any = None, loss_fn: Callable | None = None,
            optimizer: Any = None, scheduler: Callable | None = None, metrics: Mapping[str, Callable] | None = None,
            step_fn: Callable | None = None, batch_size: int | None = None, keep: str | None = None,
            return_weights: bool = True, world: int | None = None, **options: Any) -> FitPlan:
    """Check everything, then pack the arguments for the workers.

    ``world``: the ranks one fit trains on, when not every worker (a sweep's trial group): the mesh and the
    data shards are checked for that many."""
    world = world or session.world_size
    policy = check_elastic(options.pop("max_restarts", 0), options.pop("snapshot_every", None),
                            options.pop("retry_on", None))
    min_workers = options.pop("min_workers", None)
    returned = check_model(model)
    check_keep(keep, return_weights)
    spec, n_train, loader_bs = data_spec(data, "dist_fit(data=...)")
    if n_train == 0:
        raise ValueError("dist_fit(data=...) is empty (len 0); nothing to train on")
    val_spec = None
    if val_data is not None:
        val_spec, n_val, _ = data_spec(val_data, "dist_fit(val_data=...)")
        if n_val == 0:
            raise ValueError("dist_fit(val_data=...) is empty (len 0); pass None to skip validation")
    scheduler, scheduler_options = scheduler_settings(scheduler)
    options.update(scheduler_options)
    check_functions(optimizer, options.get("lr"), metrics, val_data, step_fn, loss_fn=loss_fn, scheduler=scheduler)
    keep_loader_settings(spec.loader, batch_size, options)
    cfg = make_config(batch_size=batch_size if batch_size is not None else (loader_bs or 32),
                      snapshot_every=policy.snapshot_every, **options)
    if min_workers is not None:  # going on with fewer ranks: the shards they began with, read by fewer
        policy = replace(policy, min_workers=check_min_workers(min_workers, policy.max_restarts, session.world_size,
                                                                 cfg.strategy, bool(getattr(spec, "stream", False))))
        cfg.data_world = session.world_size
    check_device_rules(cfg.precision, cfg.sync_batchnorm, {p.device.split(":")[0] for p in session.placements},
                       cfg.strategy)
    cfg.compile = with_cache_dir(cfg.compile, session.file_prefix)
    check_units(model, cfg)
    check_topology(model, cfg, world, step_fn, stream=bool(getattr(spec, "stream", False)), keep=keep)
    if n_train is not None:
        check_shard(cfg, n_train, data_parallel_size(cfg.strategy, cfg.mesh, world))
    # a relaunch runs on replaced workers whose dataset caches are empty: an elastic fit ships its data whole
    keys = session.resident.key_specs([spec, val_spec], by_value=policy.restarts)
    launch = FitLaunch(generation=session.generation, returns=_returns(returned, cfg, return_weights),
                       resident=session.resident.to_keep(keys), keep=keep)
    parts = {"model": model, "data": spec, "val_data": val_spec, "loss_fn": loss_fn, "optimizer": optimizer,
             "scheduler": scheduler, "metrics": dict(metrics) if metrics else None, "step_fn": step_fn}
    plan = FitPlan(cfg=cfg, launch=launch, model=returned if return_weights else None,
                   factory=model if returned is None and launch.returns == "state_dict" else None, data_keys=keys,
                   policy=policy)
    if not is_replicated(cfg.strategy) and returned is not None:
        parts["model"] = None  # travels alone, so that each rank can keep only its shard of it
        ship(session, plan, {"model": model}, plan.model_parcels, pooled=False)
    ship(session, plan, parts, plan.parcels)
    return plan


def _returns(model: Any, cfg: FitConfig, return_weights: bool) -> str:
    """What rank 0 sends back: the weights (into the notebook's model), the trained module, or nothing."""
    if not return_weights:
        return "none"
    if model is not None or not is_replicated(cfg.strategy):  # a sharded module cannot travel whole: the kernel builds one
        return "state_dict"
    return "module"


def ship(session: Any, plan: FitPlan, parts: dict[str, Any], into: dict[bool, shipping.Parcel],
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
