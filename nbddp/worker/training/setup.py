"""Set-up of one fit on one rank: model, data, optimizer, precision, resume.

Two phases, each agreed by every rank (``loop.fit``) so that a failure on one
rank raises on all instead of leaving peers waiting in a collective:

1. ``build`` (local work only): unpack the arguments, build the model and the
   data loaders, check the precision, find the checkpoint to resume from;
2. ``wrap_and_restore``: the strategy wraps the model (DDP's shape check and
   broadcast, or FSDP's sharding, are collective), the optimizer is built on
   the wrapped parameters, and a checkpoint's state is loaded.
"""

from __future__ import annotations

import functools
import random
from typing import Any, Callable

import numpy as np
import torch
import torch.nn as nn

from nbddp.protocol.data_forms import is_stream
from nbddp.protocol.messages import FitLaunch
from nbddp.protocol.fit_options import DEFAULT_LR, FitConfig, check_device_rules
from nbddp.shipping.pickling import Parcel, unpack
from nbddp.worker.checkpoints import files as ckpt
from nbddp.worker.checkpoints import snapshots, trust
from nbddp.worker.memory import allocator as memory
from nbddp.worker.data import fewer_ranks, streams
from nbddp.partitioning.blocks import apply_activation_checkpointing
from nbddp.worker.data.datasets import keep_only, materialise, train_loader, val_loader
from nbddp.worker.strategies.precision import precision_tools
from nbddp.worker.engine.heartbeat import BEAT
from nbddp.worker.engine.rank_state import STATE
from nbddp.worker.strategies import make_strategy
from nbddp.worker.strategies.compiling import compile_in_place, prepare_inductor
from nbddp.worker.training.compile_watch import COMPILES
from nbddp.worker.training.fit_state import TrainState
from nbddp.worker.training.schedules import Schedule, choose_interval


def seed_everything(seed: int) -> None:
    """``random``, numpy and torch; the accelerators' generators only where there is one.

    ``torch.manual_seed`` also queues a seed for CUDA and XPU, recording the
    caller's stack for each; in an engine's deep stack that is 1-2 ms per
    call, twice per fit, on workers that have no accelerator to seed.
    """
    random.seed(seed)
    np.random.seed(seed % 2**32)
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is None or accelerator.is_available():
        torch.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)


def make_optimizer(spec: Any, params: Any, lr: float | None) -> torch.optim.Optimizer:
    """``None``: AdamW; a class: built with ``lr``; a factory of ``params``: called as it is."""
    lr = DEFAULT_LR if lr is None else lr
    if spec is None:
        return torch.optim.AdamW(params, lr=lr)
    if isinstance(spec, type) and issubclass(spec, torch.optim.Optimizer):
        build: Callable[..., torch.optim.Optimizer] = spec  # torch's optimizers take lr; their base class does not
        return build(params, lr=lr)
    opt = spec(params)
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(f"optimizer=... must be an Optimizer class or a factory of params returning one; it returned {type(opt).__name__}")
    return opt


def check_resumable(restored: dict[str, Any], cfg: FitConfig, world: int, path: str) -> None:
    """A mid-epoch checkpoint can only continue with the same sharding of the epoch."""
    if not restored.get("batches_done"):
        return
    if cfg.data_world and cfg.data_world % (restored.get("world_size") or 0) == 0:
        return  # going on with fewer ranks: the position is counted in the original shards (worker/data/fewer_ranks.py)
    saved = (restored.get("world_size"), restored.get("batch_size"))
    if saved != (world, cfg.batch_size):
        raise ValueError(
            f"resume={path!r}: that checkpoint was saved mid-epoch with world_size={saved[0]}, batch_size={saved[1]}, "
            f"but this fit runs world_size={world}, batch_size={cfg.batch_size}; the rest of that epoch cannot be "
            "found again. Resume with the same workers and batch_size, or from a checkpoint saved at an epoch end."
        )


def build(parcel: Parcel, cfg: FitConfig, launch: FitLaunch, model_parcel: Parcel | None = None,
          within: tuple[int, int, Any] | None = None,
          bind: dict[str, dict[str, Any]] | None = None) -> tuple[TrainState, dict[str, Any]]:
    """Phase 1 (local): the train state without the optimizer; also the unpacked arguments.

    ``model_parcel``: the model shipped on its own (sharded training), read as
    views of the shipped file so that no rank makes a private copy of it.
    ``within``: ``(rank, world, group)`` to train in a subgroup of the workers
    (the scaling report, a sweep's trial) instead of all of them.
    ``bind``: ``{"model": {...}, "step_fn": {...}}``, keyword arguments bound
    to the shipped factory or step function (a sweep's trial parameters), so
    that the code is shipped once per sweep and each trial sends only values.
    """
    p = STATE.placement
    rank, world = (within[0], within[1]) if within else (p.rank, p.world_size)
    device = torch.device(p.device)
    parts = unpack(parcel)
    if model_parcel is not None:
        parts["model"] = unpack(model_parcel, copy=False)["model"]
    for name, kwargs in (bind or {}).items():
        if kwargs:
            parts[name] = functools.partial(parts[name], **kwargs)
    check_device_rules(cfg.precision, cfg.sync_batchnorm, {device.type}, cfg.strategy)
    strategy = make_strategy(cfg.strategy, device, cfg.precision, cfg.mesh)
    strategy.group = within[2] if within else None
    memory.for_setup(sharded=not strategy.heap_steady_state)
    seed_everything(cfg.seed)  # the same on every rank: a factory builds identical initial weights
    model = strategy.build(parts["model"])
    if cfg.activation_checkpointing:
        names = None if cfg.activation_checkpointing is True else cfg.activation_checkpointing
        if not apply_activation_checkpointing(model, names or getattr(cfg.strategy, "shard_modules", None)):
            raise ValueError("dist_fit(activation_checkpointing=True) found no repeated blocks to checkpoint (layers of an "
                             "nn.ModuleList or nn.Sequential that share one class) and no nn.Sequential to checkpoint in "
                             "segments; name the module classes instead: activation_checkpointing={MyBlock}")
    # from here on each rank draws its own random numbers (dropout masks, augmentation): with one
    # stream on every rank, all ranks would drop the same units, which DDP users do not expect
    seed_everything(cfg.seed + 1_000_003 * rank)
    if cfg.sync_batchnorm:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    keep_only(STATE.dataset_cache, list(launch.resident))
    data = build_data(parts["data"], parts.get("val_data"), cfg, strategy, rank, world, device)
    autocast, scaler = precision_tools(cfg.precision, device)
    ts = TrainState(cfg=cfg, rank=rank, world=world, device=device, strategy=strategy, model=model, **data,
                    loss_fn=parts.get("loss_fn"), step_fn=parts.get("step_fn"), metrics=parts.get("metrics") or {},
                    autocast=autocast, scaler=scaler)
    return ts, parts


def build_data(data_spec: Any, val_spec: Any, cfg: FitConfig, strategy: Any, rank: int, world: int,
               device: torch.device) -> dict[str, Any]:
    """The loaders of this rank's shards: a sampler's over map-style data, a ``streams.Stream`` over a stream.

    The ranks that hold one model copy between them (a pipeline's stages, a tensor-parallel group)
    read the same shard: ``strategy.data_shard``.
    """
    train_ds = materialise(data_spec, STATE.dataset_cache)
    strategy.sample_data = (train_ds, data_spec.collate_fn, cfg.batch_size)
    shard, shards = strategy.data_shard(rank, world)
    out: dict[str, Any] = {"vloader": None}
    if cfg.data_world and is_stream(train_ds):
        raise ValueError(f"dist_fit(min_workers=...) needs map-style data: a stream's position cannot be dealt out "
                         f"again to fewer ranks, and this fit's data is a stream ({type(train_ds).__name__}). Leave "
                         "min_workers out (a lost rank is then replaced), or give a map-style Dataset")
    if is_stream(train_ds):
        stream = streams.train_stream(train_ds, data_spec, cfg, shard, shards, device, strategy.group)
        out.update(loader=stream.loader, sampler=None, make_loader=None, stream=stream, agreement=stream.agreement)
    else:
        fewer = cfg.data_world and cfg.data_world != shards  # going on with fewer ranks (min_workers)
        loader, sampler, make_loader = (fewer_ranks.train_loader if fewer else train_loader)(
            train_ds, data_spec, cfg, shard, shards, device, strategy.whole_batches)
        if len(loader) == 0:
            raise ValueError(
                f"rank {rank} has no full batch to train on: its shard holds {len(sampler)} samples and "
                f"drop_last=True with batch_size={cfg.batch_size}"
            )
        out.update(loader=loader, sampler=sampler, make_loader=make_loader)
    if val_spec is not None:
        val_ds = materialise(val_spec, STATE.dataset_cache)
        make_val = streams.val_stream_loader if is_stream(val_ds) else val_loader
        out["vloader"] = make_val(val_ds, val_spec, cfg, shard, shards, device)
    return out


def wrap_and_restore(ts: TrainState, parts: dict[str, Any], path: str | None) -> None:
    """Phase 2 (collective): wrap, build the optimizer and scheduler, load the checkpoint."""
    if ts.cfg.from_snapshot:  # read again now that every rank's last task, and its last snapshot write, has ended
        path = snapshots.relaunch_from(ts.cfg, ts.strategy, ts.rank, ts.world) or resume_path(ts.cfg)
    identical = isinstance(parts["model"], nn.Module) or path is not None
    ts.strategy.wrap(ts.model, identical)
    ts.model = ts.strategy.module  # what this rank holds of it (a pipeline keeps its stages only)
    if ts.cfg.compile is not None:
        # a first compiled fit imports Dynamo and Inductor for seconds: compile work, not a stall. The caches
        # are set before anything compiles (at the first forward)
        BEAT.mark("compiling")
        prepare_inductor(ts.cfg.compile)
        COMPILES.begin()
        ts.compiled = compile_in_place(ts.strategy.compile_targets(ts.cfg.compile), ts.cfg.compile)
        BEAT.mark("setup")
    ts.optimizer = make_optimizer(parts.get("optimizer"), ts.strategy.parameters(), ts.cfg.lr)
    if ts.strategy.heap_steady_state:
        memory.steady_after_first_step(ts.optimizer)
    ts.scheduler = parts["scheduler"](ts.optimizer) if parts.get("scheduler") else None
    if ts.scheduler is not None:
        interval, notice = choose_interval(ts.scheduler, ts.cfg.scheduler_interval)
        ts.schedule = Schedule(ts.scheduler, interval, ts.cfg.scheduler_frequency, ts.cfg.scheduler_monitor)
        ts.notices += [notice] if notice else []
    if path:
        restore(ts, path)


def trusting(cfg: FitConfig) -> Any:
    """The files this fit reads in full (``worker/checkpoints/trust.py``): any, with ``trust_checkpoint=True``;
    else only its own snapshots, in the owner-only folder its kernel made (``cfg.snapshot_dir``)."""
    return trust.trusting(cfg.trust_checkpoint, roots=(cfg.snapshot_dir,))


def restore(ts: TrainState, path: str) -> None:
    snapshots.before_load(ts.cfg, ts.strategy, path, ts.optimizer, ts.world)  # (a sharded relaunch across hosts)
    with trusting(ts.cfg):
        extra = ts.strategy.load_checkpoint(path, ts.optimizer)
    check_resumable(extra, ts.cfg, ts.world, path)
    if ts.scheduler is not None and extra.get("scheduler") is not None:
        ts.scheduler.load_state_dict(extra["scheduler"])
    if ts.scaler is not None and extra.get("scaler") is not None:
        ts.scaler.load_state_dict(extra["scaler"])
    ts.step, ts.epoch, ts.skip = extra["step"], extra["epoch"], extra["batches_done"]
    if ts.cfg.data_world and ts.skip:  # micro-batches of the saving fit, as micro-batches of this one
        per_slot = fewer_ranks.slot_batches(ts.skip, extra["world_size"], ts.cfg.data_world)
        ts.skip = per_slot * (ts.cfg.data_world // ts.world)
    ts.start_step, ts.start_epoch = ts.step, ts.epoch
    states = extra.get("rng_per_rank")
    ts.rng = states[ts.rank] if states and ts.rank < len(states) else None
    ts.restored = extra
    if ts.stream is not None:
        ts.stream.restore(extra, path)


def resume_path(cfg: FitConfig) -> str | None:
    """The checkpoint ``resume=`` points at, or None to start fresh.

    An elastic fit's relaunch (``cfg.from_snapshot``) starts from its newest
    snapshot; before the first one it starts where the first launch did. A
    surviving rank's last snapshot may still have been written in the
    background when this ran, so phase 2 asks again (``wrap_and_restore``).
    """
    with trusting(cfg):
        found = snapshots.latest(cfg) if cfg.from_snapshot else None
        return found or ckpt.resolve(cfg.resume, cfg.checkpoint_dir)
