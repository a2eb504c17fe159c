"""The functions the kernel calls on engines (by reference: ``nbddp`` is importable there).

Each wraps one piece of worker machinery and returns plain data or a
``shipping.Parcel``, never a user-defined object through ipyparallel's own
canning (which breaks notebook classes; ``docs/ipyparallel-notes.md``,
"Shipping objects").
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from typing import Any, Iterator

from nbddp.shipping import pickling as shipping
from nbddp.protocol.messages import FitLaunch, FitResult
from nbddp.partitioning.blocks import remove_activation_checkpointing
from nbddp.worker.memory.release import run_task
from nbddp.worker.engine.rank_state import STATE, stop_on_sigint
from nbddp.worker.tasks.user_task import user_task
def ping() -> int:
    return os.getpid()


def fit_task(parcel: shipping.Parcel, cfg: Any, launch: FitLaunch, model_parcel: shipping.Parcel | None = None) -> FitResult:
    """Run ``loop.fit`` as this engine's task; rank 0 packs the trained weights; then the memory goes back."""
    return run_task(_fit, parcel, cfg, launch, model_parcel)


def _fit(parcel: shipping.Parcel, cfg: Any, launch: FitLaunch, model_parcel: shipping.Parcel | None) -> FitResult:
    from nbddp.worker.inference import kept
    from nbddp.worker.training import loop

    from nbddp.worker.training import journal

    STATE.fit_id = launch.fit_id
    try:
        with user_task(launch.generation, "fit"), stop_on_sigint():
            result, ts = loop.fit(parcel, cfg, launch, model_parcel)
        if launch.keep:
            STATE.namespace[launch.keep] = ts.strategy.module
            STATE.kept_by[launch.keep] = kept.record(ts.strategy, cfg.precision)  # predict(model=name) runs it
        del ts
        packed = fit_task_result(result, launch)
    except BaseException as exc:
        journal.ended(launch.fit_id, None, exc)  # a later kernel learns how it ended
        raise
    journal.ended(launch.fit_id, packed, None)
    return packed


def fit_task_result(result: FitResult, launch: FitLaunch) -> FitResult:
    """A fit's result as it travels back: the trained weights (rank 0's) packed into a ``Parcel``."""
    result.timings["end_wall"] = time.time()
    weights, result.weights = result.weights, None
    if weights is not None:
        t0 = time.perf_counter()
        obj = remove_activation_checkpointing(weights).cpu() if launch.returns == "module" else weights
        # a file of its own, not a pooled one: rank 0 unmaps it once written and the kernel removes it once loaded,
        # so no copy of the weights stays with rank 0 after the fit (a pooled file kept the model's size resident
        # on rank 0 between fits: 476 MiB for a 100M-parameter model); the cost is faulting fresh pages each fit
        with _host_cores():
            result.weights = shipping.pack(obj, what="the trained model", local=STATE.placement.local,
                                           prefix=f"{STATE.file_prefix}-r" if STATE.file_prefix else None)
        result.timings["pack_s"] = time.perf_counter() - t0
    return result


@contextmanager
def _host_cores() -> Iterator[None]:
    """Let torch copy with every core this process may use, then go back to the training setting.

    Packing the weights happens after every rank has left the training loop,
    so the cores the other ranks trained on are idle; a 400 MB copy runs
    ~1.7x faster on two threads than on one here.
    """
    import torch

    before = torch.get_num_threads()
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or before
    torch.set_num_threads(max(before, cores))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def call_task(parcel: shipping.Parcel, generation: int) -> shipping.Parcel:
    """``nbddp.run``: call the shipped function with the process group ready."""
    return run_task(_call, parcel, generation)


def _call(parcel: shipping.Parcel, generation: int) -> shipping.Parcel:
    with user_task(generation, "call"):
        fn, args, kwargs = shipping.unpack(parcel)
        result = fn(*args, **kwargs)
    return shipping.pack(result, what=f"the result of {getattr(fn, '__name__', 'the function')}",
                         local=STATE.placement.local, prefix=STATE.file_prefix or None)
