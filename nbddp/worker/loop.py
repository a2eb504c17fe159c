"""The DDP training loop that runs on every rank.

Shape of one fit:

1. *setup* (local, may fail): build the model, data, optimizer; load a
   checkpoint. Then every rank says whether its setup worked in one
   ``all_reduce``; if any failed, all raise together (the failing rank with
   its real error), so nobody is left waiting in DDP's first broadcast.
2. *train*: micro-batches with ``no_sync`` until the accumulation window
   ends, then the optimizer step. Metrics accumulate on the device; every
   few steps a single collective reduces them (``report.Reporter``) and
   carries the stop flag, so a stop lands on the same step on every rank.
3. *epoch end*: an epoch record, validation on the unwrapped module (no
   collectives inside, one reduction after), a checkpoint when due.
4. *return*: rank 0 packs the trained weights for the kernel.
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from nbddp.options import FitConfig
from nbddp.shipping import unpack
from nbddp.worker import checkpoint as ckpt
from nbddp.worker.batches import move, run_batch
from nbddp.worker.data import SkipSampler, keep_only, materialise, train_loader, val_loader
from nbddp.worker.report import Reporter, rss_bytes
from nbddp.worker.state import STATE


class PeerFailed(RuntimeError):
    """Raised on a rank whose own work was fine because another rank failed."""


def agree(error: BaseException | None, device: torch.device, what: str) -> None:
    """All ranks learn whether any rank failed ``what``; all raise together."""
    flag = torch.tensor([0.0 if error is None else 1.0], device=device)
    dist.all_reduce(flag)
    if error is not None:
        raise error
    if flag.item() > 0:
        raise PeerFailed(f"another rank failed during {what}")


def build_model(spec: Any) -> nn.Module:
    model = spec() if not isinstance(spec, nn.Module) and callable(spec) else spec
    if not isinstance(model, nn.Module):
        raise TypeError(f"the model factory returned {type(model).__name__}, not a torch.nn.Module")
    return model


def make_optimizer(spec: Any, params: Any, lr: float) -> torch.optim.Optimizer:
    if spec is None:
        return torch.optim.AdamW(params, lr=lr)
    if isinstance(spec, type) and issubclass(spec, torch.optim.Optimizer):
        return spec(params, lr=lr)
    opt = spec(params)
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(f"optimizer=... must be an Optimizer class or a factory of params returning one; it returned {type(opt).__name__}")
    return opt


def precision_tools(precision: str, device: torch.device) -> tuple[Any, Any]:
    """(autocast context factory, GradScaler or None)."""
    if precision == "bf16":
        return (lambda: torch.autocast(device.type, dtype=torch.bfloat16)), None
    if precision == "16-mixed":
        if device.type != "cuda":
            raise RuntimeError("precision='16-mixed' needs CUDA GPUs; on CPU use precision='bf16'")
        return (lambda: torch.autocast("cuda", dtype=torch.float16)), torch.amp.GradScaler("cuda")
    return contextlib.nullcontext, None


def sync_batchnorm(model: nn.Module, device: torch.device) -> nn.Module:
    """Convert BatchNorm layers to SyncBatchNorm (GPU only: it has no CPU kernel)."""
    if device.type != "cuda":
        raise RuntimeError(
            f"sync_batchnorm=True needs CUDA GPUs (SyncBatchNorm has no CPU kernel), but this rank runs on {device}; "
            "leave sync_batchnorm off on CPU workers"
        )
    return nn.SyncBatchNorm.convert_sync_batchnorm(model)


def seed_everything(seed: int) -> None:
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def check_resumable(restored: dict[str, Any], cfg: FitConfig, world: int, path: str) -> None:
    """A mid-epoch checkpoint can only continue with the same sharding of the epoch."""
    if not restored.get("batches_done"):
        return
    saved = (restored.get("world_size"), restored.get("batch_size"))
    if saved != (world, cfg.batch_size):
        raise ValueError(
            f"resume={path!r}: that checkpoint was saved mid-epoch with world_size={saved[0]}, batch_size={saved[1]}, "
            f"but this fit runs world_size={world}, batch_size={cfg.batch_size}; the rest of that epoch cannot be "
            "found again. Resume with the same workers and batch_size, or from a checkpoint saved at an epoch end."
        )


def peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return rss_bytes()


def fit(parcel: Any, cfg: FitConfig, meta: dict[str, Any]) -> dict[str, Any]:
    """Train on this rank; rank 0's result carries records and the trained module."""
    p = STATE.placement
    rank, world = p.rank, p.world_size
    device = torch.device(p.device)
    t_setup = time.perf_counter()

    # ---- 1. setup, agreed by all ranks --------------------------------
    error: BaseException | None = None
    try:
        parts = unpack(parcel)
        seed_everything(cfg.seed)  # the same on every rank: a factory builds identical initial weights
        model = build_model(parts["model"]).to(device)
        # from here on each rank draws its own random numbers (dropout masks, augmentation): with one
        # stream on every rank, all ranks would drop the same units, which DDP users do not expect
        seed_everything(cfg.seed + 1_000_003 * rank)
        if cfg.sync_batchnorm:
            model = sync_batchnorm(model, device)
        data_spec, val_spec = parts["data"], parts.get("val_data")
        keep_only(STATE.dataset_cache, parts.get("resident", []))
        train_ds = materialise(data_spec, STATE.dataset_cache)
        loader, sampler, make_loader = train_loader(train_ds, data_spec, cfg, rank, world, device)
        vloader = None
        if val_spec is not None:
            vloader = val_loader(materialise(val_spec, STATE.dataset_cache), val_spec, cfg, rank, world, device)
        if len(loader) == 0:
            raise ValueError(
                f"rank {rank} has no full batch to train on: its shard holds {len(sampler)} samples and "
                f"drop_last=True with batch_size={cfg.batch_size}"
            )
        optimizer = make_optimizer(parts.get("optimizer"), model.parameters(), cfg.lr)
        scheduler = parts["scheduler"](optimizer) if parts.get("scheduler") else None
        autocast, scaler = precision_tools(cfg.precision, device)
        start_step, start_epoch, skip = 0, 0, 0
        resume_path = ckpt.resolve(cfg.resume, cfg.checkpoint_dir)
        restored = None
        if resume_path:
            restored = ckpt.load(resume_path)
            check_resumable(restored, cfg, world, resume_path)
            model.load_state_dict(restored["model"])
            optimizer.load_state_dict(restored["optimizer"])
            if scheduler is not None and restored.get("scheduler") is not None:
                scheduler.load_state_dict(restored["scheduler"])
            if scaler is not None and restored.get("scaler") is not None:
                scaler.load_state_dict(restored["scaler"])
            start_step, start_epoch, skip = restored["step"], restored["epoch"], restored["batches_done"]
    except BaseException as exc:  # noqa: BLE001 - shared with peers, then re-raised
        error = exc
    agree(error, device, "setup")

    # Every rank loaded the same shipped weights (or the same checkpoint): DDP's initial broadcast of
    # the whole model from rank 0 would only copy them again. A factory's model is broadcast, since
    # its construction may draw on randomness nbddp does not control.
    identical = isinstance(parts["model"], nn.Module) or restored is not None
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, init_sync=not identical)
    module = ddp.module
    loss_fn, step_fn, metrics = parts.get("loss_fn"), parts.get("step_fn"), parts.get("metrics") or {}
    accum = cfg.grad_accum
    batches_per_epoch = len(loader)
    steps_per_epoch = math.ceil(batches_per_epoch / accum)
    total_steps = steps_per_epoch * cfg.epochs
    if cfg.max_steps is not None:
        total_steps = min(total_steps, cfg.max_steps)
    meta = dict(meta, total_steps=total_steps, steps_per_epoch=steps_per_epoch, start_step=start_step)
    rep = Reporter(rank, world, device, cfg, total_steps, meta)
    rng = None  # this rank's RNG state at the checkpoint, restored where the straight run stood
    if restored is not None:
        rep.epoch_loss, rep.epoch_n = restored.get("epoch_sums", (0.0, 0.0))
        states = restored.get("rng_per_rank")
        rng = states[rank] if states and rank < len(states) else None
    # with checkpoint_dir alone, a checkpoint is written at every epoch end
    ckpt_every = cfg.checkpoint_every
    ckpt_at_epoch_end = bool(cfg.checkpoint_dir)
    setup_s = time.perf_counter() - t_setup

    # ---- 2. train ------------------------------------------------------
    step, status, non_blocking = start_step, "completed", device.type == "cuda"
    # An engine holds ~300k long-lived Python objects (IPython, zmq, ipyparallel) that a torchrun
    # process does not; every full collection during training would scan them all. Freezing them
    # keeps the collector to what training allocates (entry.fit_task unfreezes, whatever happens).
    gc.freeze()
    t_train = time.perf_counter()
    epoch = start_epoch
    stopped = step >= total_steps
    while epoch < cfg.epochs and not stopped:
        sampler.set_epoch(epoch)
        first = skip if epoch == start_epoch else 0
        epoch_loader = make_loader(SkipSampler(sampler, first * cfg.batch_size)) if first else loader
        ddp.train()
        bi = first - 1
        # a DataLoader iterator draws a seed from the global RNG when it is created: restore the
        # checkpoint's RNG where the uninterrupted run stood (before the epoch's iterator when the
        # checkpoint closed an epoch, after it when it was saved mid-epoch)
        if rng is not None and not first:
            ckpt.set_rng_state(rng)
        batches = iter(epoch_loader)
        if rng is not None and first:
            ckpt.set_rng_state(rng)
        rng = None
        for bi, batch in enumerate(batches, start=first):
            window_start = bi - bi % accum
            window = min(accum, batches_per_epoch - window_start)
            last_micro = bi - window_start == window - 1
            batch = move(batch, device, non_blocking)
            sync_ctx = contextlib.nullcontext() if last_micro else ddp.no_sync()
            with sync_ctx:
                with autocast():
                    loss, n, extras, _, _ = run_batch(ddp, batch, loss_fn, step_fn)
                scaled = loss.float() if window == 1 else loss.float() / window  # no extra autograd node per step
                (scaler.scale(scaled) if scaler is not None else scaled).backward()
            rep.add(loss, n, extras)
            if not last_micro:
                continue
            if cfg.clip_grad_norm is not None:
                if scaler is not None:
                    scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(ddp.parameters(), cfg.clip_grad_norm)
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            lr = optimizer.param_groups[0]["lr"]
            if scheduler is not None:
                scheduler.step()
            step += 1
            rep.steps_since += 1
            end_of_epoch = bi == batches_per_epoch - 1
            ckpt_due = bool(ckpt_every) and step % ckpt_every == 0
            # a checkpoint step is a sync point, so the epoch's loss sums it saves are complete
            if rep.due(step) or end_of_epoch or ckpt_due:
                if rep.sync(step, epoch, lr, STATE.stop_requested, peak_memory(device)):
                    stopped, status = True, "interrupted"
            if cfg.val_every and step % cfg.val_every == 0 and vloader is not None and not end_of_epoch:
                validate(module, vloader, rep, cfg, metrics, loss_fn, step_fn, autocast, device, epoch, step)
            if stopped or step >= total_steps:
                stopped = True
                break
            if ckpt_due and not end_of_epoch:
                save_checkpoint(cfg, module, optimizer, scheduler, scaler, rep, step, epoch, bi + 1)
        epoch_done = bi == batches_per_epoch - 1
        if epoch_done:
            record = rep.end_epoch(epoch, step)
            if vloader is not None and status != "interrupted":
                record.update(validate(module, vloader, rep, cfg, metrics, loss_fn, step_fn, autocast, device, epoch, step))
            rep.record("epoch", record)
            epoch += 1
            if ckpt_at_epoch_end:
                save_checkpoint(cfg, module, optimizer, scheduler, scaler, rep, step, epoch, 0)
        elif stopped and cfg.checkpoint_dir:
            save_checkpoint(cfg, module, optimizer, scheduler, scaler, rep, step, epoch, bi + 1)
    train_s = time.perf_counter() - t_train

    # ---- 4. return ------------------------------------------------------
    rep.status = "interrupted" if status == "interrupted" else "done"
    rep.publish(force=True)
    result: dict[str, Any] = {"rank": rank, "step": step, "status": status,
                              "timings": {"setup_s": setup_s, "train_s": train_s, "publish_s": rep.publish_s}}
    if rank == 0:
        result["records"] = rep.records
        result["ranks"] = rep.ranks
        result["module"] = module
    return result


def validate(module: nn.Module, vloader: Any, rep: Reporter, cfg: FitConfig, metrics: dict[str, Any],
             loss_fn: Any, step_fn: Any, autocast: Any, device: torch.device, epoch: int, step: int) -> dict[str, Any]:
    """One validation pass; every rank calls it at the same step."""
    rep.status = "validating"
    rep.publish(force=True)
    was_training = module.training
    module.eval()
    loss_sum, n_sum = 0.0, 0
    sums: dict[str, float] = {}
    with torch.no_grad():
        for batch in vloader:
            batch = move(batch, device)
            with autocast():
                loss, n, extras, output, target = run_batch(module, batch, loss_fn, step_fn)
            loss_sum += float(loss) * n
            n_sum += n
            for k, v in extras.items():
                sums[k] = sums.get(k, 0.0) + float(v) * n
            for name, fn in metrics.items():
                value = fn(output, target)
                sums[name] = sums.get(name, 0.0) + float(value) * n
    names = sorted(set(metrics) | set(sums))
    reduced = rep.reduce_sums([loss_sum, float(n_sum), *[sums.get(k, 0.0) for k in names]])
    total = reduced[1]
    out = {"val_loss": reduced[0] / total if total else float("nan")}
    out.update({f"val_{k}": s / total if total else float("nan") for k, s in zip(names, reduced[2:])})
    rep.record("val", {"epoch": epoch, "step": step, **out})
    module.train(was_training)
    rep.status = "training"
    return out


def save_checkpoint(cfg: FitConfig, module: nn.Module, optimizer: Any, scheduler: Any, scaler: Any,
                    rep: Reporter, step: int, epoch: int, batches_done: int) -> None:
    """Gather every rank's RNG state, then rank 0 writes the file."""
    states: list[Any] = [None] * rep.world
    dist.all_gather_object(states, ckpt.rng_state())
    if rep.rank != 0:
        return
    ckpt.save(cfg.checkpoint_dir, step, {
        "model": module.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "scaler": scaler.state_dict() if scaler is not None else None,
        "step": step,
        "epoch": epoch,
        "batches_done": batches_done,
        "epoch_sums": (rep.epoch_loss, rep.epoch_n),
        "rng_per_rank": states,
        "world_size": rep.world,
        "batch_size": cfg.batch_size,
    })

