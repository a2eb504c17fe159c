"""The training loop that runs on every rank, around one ``TrainState``.

Shape of one fit (``fit``):

1. *setup*, in two phases that every rank agrees on (``setup.py``), so a
   failure on one rank raises on all instead of leaving peers waiting;
2. *train* (``run_epoch``, ``train_micro_batch``, ``optimizer_step``):
   micro-batches without gradient sync until the accumulation window ends,
   then the optimizer step. Metrics accumulate on the device; every few
   steps one collective reduces them (``report.Reporter``) and carries the
   stop flag, so a stop lands on the same step on every rank;
3. *epoch end* (``end_epoch``): the epoch record, validation, a checkpoint;
4. *finish*: the result, with the full weights gathered for rank 0.

Which collectives the wrapping does, and how gradients are synchronised and
clipped, is the strategy's (``worker/strategies``); this loop never asks
which strategy it runs.
"""

from __future__ import annotations

import functools
import math
import time
from typing import Any, Callable, Iterator, TypeVar

import torch
import torch.distributed as dist

from nbddp.protocol.messages import FitLaunch, FitPlanInfo, FitResult, timed_phases
from nbddp.protocol.fit_options import FitConfig, Patience
from nbddp.shipping.pickling import Parcel
from nbddp.worker.checkpoints import files as ckpt
from nbddp.worker.checkpoints.snapshots import SnapshotClock
from nbddp.worker.training import early_stop, nan_policy, setup
from nbddp.worker.data import streams
from nbddp.worker.data.batch_agreement import PeerFailed
from nbddp.worker.data.batches import move, refuse_binary_float_targets
from nbddp.worker.training.best_weights import BestWeights
from nbddp.worker.data.datasets import SkipSampler
from nbddp.worker.data.prefetch import prefetch
from nbddp.worker.engine.heartbeat import BEAT
from nbddp.worker.training.report import Reporter
from nbddp.worker.engine.rank_state import STATE
from nbddp.worker.training.fit_state import TrainState
from nbddp.worker.memory.usage import peak_memory, reset_peak_memory
from nbddp.worker.strategies.compiling import uncompile
from nbddp.worker.training.compile_watch import COMPILES
from nbddp.worker.training.validate import validate
from nbddp.worker.training.profiler import StepProfiler
from nbddp.worker.training.asked_profile import AskedProfiles
from nbddp.worker.training.kernel_answers import KernelAnswers
_END = object()  # the end of an epoch's batches
T = TypeVar("T")


def agree(error: BaseException | None, device: torch.device, what: str, group: Any = None) -> None:
    """All ranks (of ``group``) learn whether any rank failed ``what``; all raise together."""
    BEAT.mark("collective")
    flag = torch.tensor([0.0 if error is None else 1.0], device=device)
    dist.all_reduce(flag, group=group)
    if error is not None:
        raise error
    if flag.item() > 0:
        raise PeerFailed(f"another rank failed during {what}")


def agreed(work: Callable[[], T], device: torch.device, what: str, group: Any = None) -> T:
    """``work()``'s result, once every rank (of ``group``) has done its own: any rank's failure raises on all.

    A set-up phase of ``fit`` (the heartbeat says ``"setup"``), agreed outside the ``except`` clause, so that a
    failing collective is not reported as raised while handling this rank's error.
    """
    try:
        BEAT.mark("setup")
        done = work()
    except BaseException as exc:  # noqa: BLE001 - shared with peers, then re-raised
        error = exc
    else:
        agree(None, device, what, group)
        return done
    agree(error, device, what, group)
    raise error  # agree has raised it already: this says so to the reader and the type checker


def described(model: torch.nn.Module) -> tuple[str, int]:
    """The person's model as the loggers' hyperparameters name it: ``module.QualName`` and its parameter count."""
    return f"{type(model).__module__}.{type(model).__qualname__}", sum(p.numel() for p in model.parameters())


def fit(parcel: Parcel, cfg: FitConfig, launch: FitLaunch, model_parcel: Parcel | None = None,
        within: tuple[int, int, Any] | None = None,
        bind: dict[str, dict[str, Any]] | None = None) -> tuple[FitResult, TrainState]:
    """Train on this rank; rank 0's result carries the records and the full weights.

    ``within``: ``(rank, world, group)`` to train in a subgroup of the workers
    (a sweep's trial); ``bind``: arguments bound to the shipped ``model``
    factory or ``step_fn`` (a trial's parameters; see ``setup.build``).
    """
    device = torch.device(STATE.placement.device)
    group = within[2] if within else None
    t_setup = time.perf_counter()
    base_mem = reset_peak_memory(device)
    (ts, parts), path = agreed(lambda: (setup.build(parcel, cfg, launch, model_parcel, within, bind),
                                        setup.resume_path(cfg)), device, "setup", group)
    model_class, params = described(ts.model)  # the whole model, before a strategy keeps its part of it
    agreed(functools.partial(setup.wrap_and_restore, ts, parts, path), device,
           "wrapping the model and loading the checkpoint", group)
    agreed_us = time.time_ns() / 1000  # every rank leaves the agreement together: the profile's clock reference
    del parts  # the shipped weights: given back now, not at the end of the fit
    plan = FitPlanInfo(total_steps=int(ts.total_steps) if math.isfinite(ts.total_steps) else None,
                       steps_per_epoch=ts.steps_per_epoch, start_step=ts.start_step, batch_size=cfg.batch_size,
                       model_class=model_class, params=params, notices=tuple(ts.notices))
    attach_watchers(ts, launch, plan, base_mem, group, agreed_us)
    setup_s = time.perf_counter() - t_setup
    t_train, train_start_wall = time.perf_counter(), time.time()
    BEAT.time_phases("data")  # the time split covers train_s: building the epoch's loader is data work
    try:
        train(ts)
    finally:
        streams.release(ts)  # loader worker processes end with the fit
        COMPILES.end()
        uncompile(ts.compiled)
        trace = ts.profiler.close() if ts.profiler is not None else None  # never left running on the engine
        ts.asked.end()
        if ts.snapshots is not None:  # the last snapshot's write finished, failed fit or not
            ts.snapshots.close()
    phase_s = timed_phases(BEAT.phase_seconds(stop=True))
    timings = {"setup_s": setup_s, "train_s": time.perf_counter() - t_train, "train_start_wall": train_start_wall}
    timings.update(ts.snapshots.timings() if ts.snapshots is not None else {})  # of train_s: elastic snapshots
    if ts.answers.waited:  # of train_s: waiting for the kernel's synchronous callbacks
        timings.update(answer_wait_s=ts.answers.wait_s, answer_points=ts.answers.waited)
    if ts.answers.skipped:  # the kernel that answers them died (a detached session): skipped, not waited for
        timings.update(callback_points_skipped=ts.answers.skipped)
    result = finish(ts, launch, timings)
    result.phase_s, result.profile = phase_s, trace
    return result, ts


def attach_watchers(ts: TrainState, launch: FitLaunch, plan: FitPlanInfo, base_mem: int, group: Any,
                    agreed_us: float) -> None:
    """What watches the training of ``ts``: the best weights, the early stops, the reporter, the profilers, the
    elastic fit's snapshots."""
    cfg, device = ts.cfg, ts.device
    ts.best = BestWeights(launch.best) if launch.best is not None else None
    ts.stoppers = [Patience(spec) for spec in launch.stoppers]
    ts.reporter = Reporter(ts.rank, ts.world, device, cfg, plan, param_bytes=ts.strategy.param_bytes(),
                           counted=ts.strategy.reports_metrics, roles=ts.strategy.roles(ts.world), base_mem=base_mem,
                           group=group)
    if ts.restored is not None:
        ts.reporter.epoch_loss, ts.reporter.epoch_n = ts.restored.get("epoch_sums", (0.0, 0.0))
    ts.profiler = StepProfiler(cfg.profile, device, agreed_us) if cfg.profile is not None else None
    ts.asked = AskedProfiles(ts.rank, device, agreed_us, STATE.file_prefix, launch.channel)
    ts.answers = KernelAnswers(ts.rank, launch.answers, STATE.file_prefix, group,  # synchronous callbacks
                               channel=launch.channel, generation=launch.generation,
                               kernel_pid=launch.answers_pid)
    ts.snapshots = SnapshotClock(cfg, device, ts.strategy.group, ts.strategy) if cfg.snapshot_dir else None


def train(ts: TrainState) -> None:
    """Every epoch from where ``ts`` stands, until the last epoch, ``max_steps`` or a stop."""
    # the engine's ~300k long-lived objects (IPython, zmq, torch) are frozen out of the collector
    # while any task runs (worker/memory/release.py): collections during training walk what the fit allocated
    stopped = ts.step >= ts.total_steps
    while ts.epoch < ts.cfg.epochs and not stopped:
        stopped = run_epoch(ts) or ts.stop_reason is not None  # an EarlyStopping ran out at the epoch's checks


def epoch_batches(ts: TrainState) -> tuple[int, Iterator[Any]]:
    """(index of the first batch, an iterator over the rest of this epoch's batches)."""
    first = ts.skip if ts.epoch == ts.start_epoch else 0
    if ts.stream is not None:
        loader = ts.stream.epoch_loader(ts.epoch, first)
    else:
        ts.sampler.set_epoch(ts.epoch)
        loader = ts.make_loader(SkipSampler(ts.sampler, first * ts.cfg.batch_size)) if first else ts.loader
    ts.strategy.wrapped.train()
    # a DataLoader iterator draws a seed from the global RNG when it is created: restore the
    # checkpoint's RNG where the uninterrupted run stood (before the epoch's iterator when the
    # checkpoint closed an epoch, after it when it was saved mid-epoch)
    if ts.rng is not None and not first:
        ckpt.set_rng_state(ts.rng)
    batches = iter(loader)
    if ts.rng is not None and first:
        ckpt.set_rng_state(ts.rng)
    ts.rng = None
    if ts.stream is not None:  # handed out only as far as every rank has them
        batches = ts.stream.epoch_feed(batches, ts.epoch, first)
    return first, prefetch(batches, ts.device, ts.cfg.prefetch)


def run_epoch(ts: TrainState) -> bool:
    """One epoch (or what is left of it); return whether training stops."""
    cfg, rep = ts.cfg, ts.reporter
    first, batches = epoch_batches(ts)
    bi, stopped, snap_due = first - 1, False, False
    while True:
        BEAT.micro_batch()  # "data": a rank stuck in its data pipeline shows it
        batch = next(batches, _END)
        if batch is _END:
            break
        bi += 1
        if not train_micro_batch(ts, bi, batch):
            continue  # inside an accumulation window
        if optimizer_step(ts):  # a NaN loss under on_nan="stop": the good steps since the last record, recorded
            if rep.steps_since:
                rep.sync(ts.step, ts.epoch, ts.lr, False, peak_memory(ts.device))
            stopped = True
            break
        profile_step(ts)
        end_of_epoch = bi == ts.batches_per_epoch - 1
        ckpt_due = cfg.checkpoint_every is not None and ts.step % cfg.checkpoint_every == 0  # (>= 1 when given)
        sync = rep.due(ts.step) or end_of_epoch or ckpt_due  # the same on every rank
        snap_due = ts.snapshots is not None and ts.snapshots.due(ts.step, sync)
        # a checkpoint (or snapshot) step is a sync point, so the epoch's loss sums it saves are complete
        if sync or snap_due:
            BEAT.mark("collective")
            if rep.sync(ts.step, ts.epoch, ts.lr, STATE.stop_requested, peak_memory(ts.device), ts.asked.pending()):
                stopped, ts.status = True, "interrupted"
            if rep.request is not None:  # handle.profile: every rank starts on the same step
                ts.asked.start(*rep.request)
        if cfg.val_every and ts.step % cfg.val_every == 0 and ts.vloader is not None and not end_of_epoch:
            validate(ts)
            asked_checkpoint(ts, bi + 1)
        if stopped or ts.step >= ts.total_steps or ts.stop_reason is not None:  # (a val_every check's EarlyStopping)
            stopped = True
            break
        if ckpt_due and not end_of_epoch:
            save_checkpoint(ts, bi + 1)
        if snap_due and not end_of_epoch:
            write_snapshot(ts, bi + 1)
    if bi == ts.batches_per_epoch - 1:
        end_epoch(ts)
        if ts.snapshots is not None and (ts.snapshots.at_epoch_end or snap_due) and not stopped:
            write_snapshot(ts, 0)
    elif stopped and cfg.checkpoint_dir:
        save_checkpoint(ts, bi + 1)
    return stopped


def profile_step(ts: TrainState) -> None:
    """The profilers' step after an optimizer step: ``dist_fit(profile=...)``'s and ``handle.profile``'s."""
    if ts.profiler is None and ts.asked.current is None:
        return
    BEAT.mark("profiler")  # tracing and writing the trace out: "other" in the time split
    if ts.profiler is not None:
        ts.profiler.step()
    ts.asked.step()


def train_micro_batch(ts: TrainState, bi: int, batch: Any) -> bool:
    """Forward and backward one micro-batch; return whether it closed an accumulation window."""
    accum = ts.cfg.grad_accum
    window_start = bi - bi % accum
    window = min(accum, ts.batches_per_epoch - window_start)
    last_micro = bi - window_start == window - 1
    BEAT.mark("forward")
    if not ts.targets_checked:  # once per fit: the default loss must not be MSE on binary labels
        ts.targets_checked = True
        if ts.loss_fn is None and ts.step_fn is None:
            refuse_binary_float_targets(batch)
    batch = move(batch, ts.device, ts.non_blocking)
    with ts.strategy.gradient_sync(last_micro):
        loss, n, extras = ts.strategy.train_micro_batch(ts, batch, window)
    if not nan_policy.loss_is_bad(ts, loss):  # under on_nan="stop"/"skip" a NaN loss stays out of the records
        ts.reporter.add(loss, n, extras)
    return last_micro


def optimizer_step(ts: TrainState) -> bool:
    """Clip, step (through the scaler under 16-mixed), zero the gradients, step a per-step scheduler.

    Returns whether training stops here (a NaN loss under ``on_nan="stop"``: the update is not applied).
    """
    BEAT.mark("optimizer")
    opt, scaler = ts.built_optimizer, ts.scaler
    verdict = nan_policy.agree_on_step(ts)
    if verdict != "ok":  # every rank drops the same NaN update
        opt.zero_grad(set_to_none=True)
        if verdict == "stop":
            return True
        ts.step += 1
        ts.reporter.steps_since += 1
        BEAT.step_done(ts.step)
        return False
    if ts.cfg.clip_grad_norm is not None:
        if scaler is not None:
            scaler.unscale_(opt)
        ts.strategy.clip_grad_norm(ts.cfg.clip_grad_norm)
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    opt.zero_grad(set_to_none=True)
    ts.lr = opt.param_groups[0]["lr"]
    ts.step += 1
    if ts.schedule is not None:
        ts.schedule.after_optimizer_step(ts.step)
    ts.reporter.steps_since += 1
    BEAT.step_done(ts.step)
    return False


def end_epoch(ts: TrainState) -> None:
    """The epoch record (with validation unless stopped), a per-epoch scheduler step, a checkpoint."""
    rep = ts.reporter
    record = rep.end_epoch(ts.epoch, ts.step)
    record.update(streams.epoch_record(ts))
    if ts.vloader is not None and ts.status != "interrupted":
        record.update(validate(ts))
    rep.record("epoch", record)
    if ts.best is not None:
        ts.best.consider(ts, "epoch", record)
    early_stop.after_check(ts, "epoch", record)
    ts.epoch += 1
    if ts.schedule is not None:
        ts.schedule.after_epoch(ts.epoch, record)
    ts.answers.exchange(ts, "epoch")  # the kernel's on_epoch_end: a stop, an LR, a checkpoint, before epoch + 1
    asked_checkpoint(ts, 0)
    if ts.cfg.checkpoint_dir:  # with checkpoint_dir alone, a checkpoint is written at every epoch end
        save_checkpoint(ts, 0)


def asked_checkpoint(ts: TrainState, batches_done: int) -> None:
    """A checkpoint a synchronous callback asked for (``handle.save_checkpoint``), where the loop can resume."""
    path = ts.answers.take_checkpoint()
    if path is not None:
        save_checkpoint(ts, batches_done, path)


def write_snapshot(ts: TrainState, batches_done: int) -> None:
    """An elastic fit's snapshot: copied now, written in the background to the fit's ``/dev/shm`` folder."""
    ts.snapshots.write(ts.strategy, ts.step, ts.optimizer, checkpoint_extra(ts, batches_done), ts.rank)
    ts.reporter.publish(force=True)  # the records up to it reach the kernel, which keeps them if a rank dies now


def save_checkpoint(ts: TrainState, batches_done: int, directory: str | None = None) -> None:
    """The strategy writes model, optimizer and loop state (``checkpoint_extra``) to ``directory``.

    ``directory``: where (default ``checkpoint_dir``; an asked checkpoint goes where it was asked to).
    """
    target = directory or ts.cfg.checkpoint_dir
    if not target:
        raise ValueError(f"a checkpoint was due at step {ts.step}, but neither checkpoint_dir nor the request says "
                         "where it goes; give dist_fit(checkpoint_dir=...) or handle.save_checkpoint(folder)")
    extra = checkpoint_extra(ts, batches_done)
    ts.strategy.save_checkpoint(target, ts.step, ts.optimizer, extra, ts.rank)


def checkpoint_extra(ts: TrainState, batches_done: int) -> dict[str, Any]:
    """The loop's state beside the model and optimizer, every rank's RNG gathered (collective)."""
    BEAT.mark("checkpoint")
    states: list[Any] = [None] * ts.world
    dist.all_gather_object(states, ckpt.rng_state(), group=ts.strategy.group)
    rep = ts.reporter
    return {
        "scheduler": ts.scheduler.state_dict() if ts.scheduler is not None else None,
        "scaler": ts.scaler.state_dict() if ts.scaler is not None else None,
        "step": ts.step,
        "epoch": ts.epoch,
        "batches_done": batches_done,
        "epoch_sums": (rep.epoch_loss, rep.epoch_n),
        "rng_per_rank": states,
        "stream_per_rank": streams.gather_positions(ts, batches_done),
        "world_size": ts.world,
        "batch_size": ts.cfg.batch_size,
        "strategy": ts.strategy.name,
    }


def finish(ts: TrainState, launch: FitLaunch, timings: dict[str, float]) -> FitResult:
    """The last report, then the full weights for rank 0 (a collective under FSDP)."""
    BEAT.mark("finish")
    rep = ts.reporter
    rep.status = ts.status
    rep.publish(force=True)
    timings["publish_s"] = rep.publish_s
    result = FitResult(rank=ts.rank, step=ts.step, status=ts.status, timings=timings, stop_reason=ts.stop_reason,
                       notices=nan_policy.notices(ts) + ts.answers.notices + ts.answers.gone_notice(),
                       compile=COMPILES.report() if ts.cfg.compile is not None else None)
    if ts.best is not None:  # every rank: putting the best weights back may be collective
        result.restored = ts.best.restore(ts)
    if launch.returns != "none":
        state = ts.strategy.full_state_dict(ts.rank)
        if ts.rank == 0:
            result.weights = ts.strategy.module if launch.returns == "module" else state
    if ts.rank == 0:
        result.records = rep.records
        result.ranks = rep.ranks
        result.plan = rep.plan
    return result
