"""The workers' half of ``find_batch_size`` and ``scaling_report``: one trial step, and timed steps in subgroups.

Both build the fit's state exactly as ``dist_fit`` would (``setup.build``,
``setup.wrap_and_restore``: the same strategy, precision, accumulation and
activation checkpointing), run a few steps, and leave nothing behind: the
model is built from the shipped arguments every time, every RNG is put
back, memory is given back (``release.run_task``), no weights are returned.
"""

from __future__ import annotations

import contextlib
import time
from itertools import cycle
from typing import Any, Iterator

import torch
import torch.distributed as dist

from nbddp.protocol.messages import TIMED_PHASES, FitLaunch, ScalingRow, TrialResult, timed_phases
from nbddp.protocol.fit_options import FitConfig
from nbddp.shipping.pickling import Parcel
from nbddp.protocol.parallel_settings import data_parallel_size, describe
from nbddp.protocol.parallel_settings import within
from nbddp.worker.checkpoints import files as ckpt
from nbddp.worker.training import setup
from nbddp.worker.data.batches import move
from nbddp.worker.engine.group_lifetime import destroy_subgroup
from nbddp.worker.training.loop import optimizer_step
from nbddp.worker.memory.release import run_task
from nbddp.worker.engine.heartbeat import BEAT
from nbddp.worker.engine.rank_state import STATE
from nbddp.worker.tasks.user_task import user_task
from nbddp.worker.memory.usage import peak_memory, reset_peak_memory

OOM_PATTERNS = ("out of memory", "can't allocate memory", "cannot allocate memory", "not enough memory")


def is_out_of_memory(exc: BaseException) -> bool:
    """torch's OutOfMemoryError (CUDA's included), or an allocator's "out of memory" RuntimeError."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, (RuntimeError, MemoryError)) and (
        isinstance(exc, MemoryError) or any(p in str(exc).lower() for p in OOM_PATTERNS))


class _Tally:
    """What the loop's step functions report to, when nothing is reported."""

    steps_since = 0

    def add(self, loss: Any, n: int, extras: Any) -> None:
        pass


@contextlib.contextmanager
def _side_effect_free(device: torch.device) -> Iterator[None]:
    """Put every RNG back, whatever happens inside (``release.run_task`` gives the memory back)."""
    saved = ckpt.rng_state()  # this rank's device is the current one: its CUDA stream is the one saved
    try:
        yield
    finally:
        ckpt.set_rng_state(saved)


def _steps(ts: Any, batches: Iterator[Any], n: int, sync: bool) -> None:
    """``n`` optimizer steps of ``grad_accum`` micro-batches; gradients reduced only when ``sync``."""
    accum = ts.cfg.grad_accum
    for _ in range(n):
        for micro in range(accum):
            BEAT.mark("data")  # the phases of the time split, as the fit's loop marks them
            batch = next(batches)
            BEAT.mark("forward")
            batch = move(batch, ts.device, ts.non_blocking)
            with ts.strategy.gradient_sync(sync and micro == accum - 1):
                ts.strategy.train_micro_batch(ts, batch, accum)
        optimizer_step(ts)


def _state(parcel: Parcel, cfg: FitConfig, launch: FitLaunch, model_parcel: Parcel | None,
           within: tuple[int, int, Any] | None = None) -> Any:
    ts, parts = setup.build(parcel, cfg, launch, model_parcel, within)
    if ts.stream is not None:  # before any collective: every rank raises this at once
        raise TypeError("find_batch_size and scaling_report replay the same batches at every trial, which a stream "
                        "(an IterableDataset) cannot: pass a map-style sample of the data, e.g. a list of its first "
                        "few thousand samples, and train on the stream with the batch size found")
    setup.wrap_and_restore(ts, parts, None)
    ts.reporter = _Tally()
    return ts


def trial_task(parcel: Parcel, cfg: FitConfig, launch: FitLaunch, model_parcel: Parcel | None = None) -> TrialResult:
    """One full training step at ``cfg.batch_size``: ``"fits"``, or ``"oom"`` with the allocator's message.

    Under DDP the step reduces no gradients (memory is the same: DDP's
    buckets exist from the start), so a rank that runs out of memory leaves
    no peer waiting in a collective; the kernel agrees on the outcome. Any
    other error is raised.
    """
    return run_task(_trial_task, parcel, cfg, launch, model_parcel)


def _trial_task(parcel: Parcel, cfg: FitConfig, launch: FitLaunch, model_parcel: Parcel | None = None) -> TrialResult:
    device = torch.device(STATE.placement.device)
    outcome, message, shard = "fits", "", 0
    with user_task(launch.generation, trains=True), _side_effect_free(device):
        reset_peak_memory(device)
        ts = None
        try:
            ts = _state(parcel, cfg, launch, model_parcel)
            shard = len(ts.sampler)
            _steps(ts, cycle(ts.loader), 1, sync=ts.strategy.name != "ddp")
        except BaseException as exc:  # noqa: BLE001 - sorted right here
            if not is_out_of_memory(exc):
                raise
            outcome, message = "oom", f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        finally:
            del ts
        peak = peak_memory(device)
    return TrialResult(rank=STATE.placement.rank, batch_size=cfg.batch_size, outcome=outcome, message=message,
                       peak_mem=peak, shard=shard)


def _time_world(parcel: Parcel, cfg: FitConfig, launch: FitLaunch, model_parcel: Parcel | None, k: int, group: Any,
                warmup: int, steps: int) -> ScalingRow:
    device = torch.device(STATE.placement.device)
    reset_peak_memory(device)
    cfg = within(cfg, k)  # a model-parallel strategy on k ranks: k / mp groups (one rank: the model whole)
    ts = _state(parcel, cfg, launch, model_parcel, (dist.get_rank(group), k, group))
    batches = cycle(ts.loader)

    def timed(sync: bool) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        BEAT.time_phases("data")
        _steps(ts, batches, steps, sync)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        phases = timed_phases(BEAT.phase_seconds(stop=True))
        # the slowest rank sets the pace; one slot per rank carries each rank's time split in the same reduction
        vec = torch.zeros(1 + k * len(TIMED_PHASES), dtype=torch.float64)
        vec[0] = time.perf_counter() - t0
        vec[1 + dist.get_rank(group)::k] = torch.tensor([phases[p] for p in TIMED_PHASES], dtype=torch.float64)
        vec = vec.to(device)
        dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=group)
        values = vec.cpu().tolist()
        split.append([{p: values[1 + j * k + r] for j, p in enumerate(TIMED_PHASES)} for r in range(k)])
        return values[0]

    split: list[list[dict[str, float]]] = []
    _steps(ts, batches, warmup, True)
    t_sync, t_local = timed(True), timed(False)
    samples = data_parallel_size(cfg.strategy, cfg.mesh, k) * cfg.batch_size * cfg.grad_accum * steps
    peak = torch.tensor([float(peak_memory(device))], dtype=torch.float64, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    ts = None  # the model and optimizer go before the next world size is built
    return ScalingRow(world_size=k, samples_per_s=samples / t_sync, step_s=t_sync / steps,
                      local_step_s=t_local / steps, peak_mem=int(peak.item()),
                      topology=describe(cfg.strategy, cfg.mesh, k), phase_s=split[0])


def scaling_task(parcel: Parcel, cfg: FitConfig, launch: FitLaunch, model_parcel: Parcel | None, sizes: list[int],
                 warmup: int, steps: int) -> list[ScalingRow] | None:
    """Timed steps at each world size in ``sizes``, in subgroups of ranks ``0..k-1``; rank 0 returns the rows."""
    return run_task(_scaling_task, parcel, cfg, launch, model_parcel, sizes, warmup, steps)


def _scaling_task(parcel: Parcel, cfg: FitConfig, launch: FitLaunch, model_parcel: Parcel | None, sizes: list[int],
                  warmup: int, steps: int) -> list[ScalingRow] | None:
    device = torch.device(STATE.placement.device)
    rank = dist.get_rank()
    rows: list[ScalingRow] = []
    with user_task(launch.generation, trains=True), _side_effect_free(device):
        groups = {k: dist.new_group(list(range(k))) for k in sizes}  # every rank creates every group, in order
        try:
            for k in sizes:
                row = _time_world(parcel, cfg, launch, model_parcel, k, groups[k], warmup, steps) if rank < k else None
                dist.barrier()  # the others wait here (idle, no collective of the subgroup)
                if row is not None:  # (rank 0 times every world size)
                    rows.append(row)
        finally:
            for group in groups.values():
                destroy_subgroup(group)
    return rows if rank == 0 else None
