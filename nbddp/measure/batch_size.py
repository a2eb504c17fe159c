"""``nbddp.find_batch_size``: the largest per-rank batch for which one full training step fits on every rank.

A trial is one step (forward, backward, optimizer step; under the fit's
strategy, precision, accumulation and activation checkpointing) on every
rank at once, from the shipped arguments (``nbddp.worker.tasks.trials.trial_task``).
Every rank reports ``"fits"`` or ``"oom"``; the kernel agrees for all: a
size fits only when it fits on every rank. The search doubles from
``start`` until a size fails (or the bound: the shard size and
``max_batch_size``), then bisects between the last size that fit and the
first that did not. Under ``nbddp.Pipeline`` every size is a multiple of
its microbatches, and a rank's shard is that of its data-parallel rank.

Under DDP a trial reduces no gradients, so no rank waits for one that ran
out of memory. Under FSDP the forward itself is collective: a rank out of
memory can leave its peers waiting in an all-gather; after the failure
policy's grace those are killed and replaced (the supervisor's usual path,
~10 s) and the size counts as not fitting.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Literal, overload

from nbddp.protocol.errors import RankFailure, WorkerError
from nbddp.execution.calls import RankCall
from nbddp.protocol.messages import TrialResult
from nbddp.session.session import Session, get_session
from nbddp.protocol.parallel_settings import data_parallel_size
from nbddp.fit.arguments import FitArguments, ModelLike, ResultOptions
from nbddp.fit.preflight import FitPlan, plan_fit
from nbddp.fit.parallel_checks import batch_unit
from nbddp.protocol.data_forms import DataLike


@overload
def _positive(name: str, value: object, allow_none: Literal[False] = False) -> int: ...


@overload
def _positive(name: str, value: object, allow_none: bool) -> int | None: ...


def _positive(name: str, value: object, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"find_batch_size({name}=...) must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"find_batch_size({name}=...) must be >= 1 (samples per rank), got {value}")
    return value


class Trials:
    """Runs trials on the workers for one shipped plan, and says what it found."""

    def __init__(self, session: Session, plan: FitPlan, say: Callable[[str], object] = print):
        self.session, self.plan, self.say = session, plan, say
        self.results: dict[int, list[TrialResult]] = {}
        self.shard: int | None = None

    def fits(self, b: int) -> bool:
        from nbddp.worker.tasks.trials import trial_task

        s, plan = self.session, self.plan
        cfg = dataclasses.replace(plan.cfg, batch_size=b, drop_last=True)
        # a rank out of memory under FSDP can leave its peers in a collective: killed after the grace
        call = RankCall(s, f"find_batch_size (trying {b})", failed_result=lambda r: r.outcome == "oom")
        with s.lock:
            s.ensure_ready()
            call.launch(trial_task, lambda p: (s.sources.attach(plan.parcels[p.local], p), cfg, plan.launch,
                                               s.sources.attach(plan.model_parcels.get(p.local), p)))
        try:
            results = list(call.wait().values())
        except WorkerError:
            results = list(call.tasks.results.values())
            if not any(r.outcome == "oom" for r in results):
                raise  # not memory: the model or the data is broken, and searching would not help
            s.wait_healed()
        self.results[b] = results
        shards = [r.shard for r in results if r.shard]
        if shards:  # the smallest shard bounds the search
            self.shard = min(shards)
        return self._report(b, results)

    def _report(self, b: int, results: list[TrialResult]) -> bool:
        from nbddp.live.text import fmt_bytes

        oom = sorted((r for r in results if r.outcome == "oom"), key=lambda r: r.rank)
        if oom or len(results) < self.session.world_size:
            ranks = ", ".join(str(r.rank) for r in oom) or "a peer's"
            self.say(f"nbddp: batch size {b} per rank ... out of memory on rank {ranks}"
                     + (f" ({oom[0].message})" if oom else ""))
            return False
        peak = max(results, key=lambda r: r.peak_mem)
        self.say(f"nbddp: batch size {b} per rank ... fits (peak {fmt_bytes(peak.peak_mem)} on rank {peak.rank})")
        return True


def search(fits: Callable[[int], bool], start: int, bound: int | None, first_bound: Callable[[], int | None]) -> int:
    """Double from ``start`` to the first failure (or ``bound``), then bisect; 0 when even 1 fails.

    ``first_bound()`` gives the bound known only after the first trial (a
    dataset built on the workers).
    """
    good, bad, b = 0, None, start
    while True:
        if bound is not None and b > bound:
            b = bound
        if fits(b):
            good = b
            bound = bound if bound is not None else first_bound()
            if bound is not None and b >= bound:
                return b
            b *= 2
        else:
            bad = b
            break
    if good == 0:  # start itself failed: walk down
        while bad > 1:
            b = bad // 2
            if fits(b):
                good = b
                break
            bad = b
        if good == 0:
            return 0
    while bad - good > 1:
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good


def find_batch_size(model: ModelLike, data: DataLike, *, start: int = 1, max_batch_size: int | None = None,
                    **fit_options: Any) -> int:
    """The largest per-rank batch size for which one full training step fits on every rank.

    Args:
        model, data: as ``dist_fit`` takes them (the notebook's model is not changed).
        start: the first size tried; the search doubles from there.
        max_batch_size: never try more than this (default: the shard size,
            the samples each rank has).
        **fit_options: what the step should look like: ``strategy``,
            ``precision``, ``grad_accum``, ``activation_checkpointing``,
            ``optimizer``, ``loss_fn``, ``step_fn``...

    Each trial is printed as it ends ("batch size 64 per rank ... fits",
    "128 ... out of memory on rank 1").

    Raises:
        ValueError: bad bounds, or data smaller than one sample per rank.
        WorkerError: a trial failed for a reason other than memory (raised
            as it is: a bigger or smaller batch would not help), or even a
            batch of one does not fit.
    """
    start = _positive("start", start)
    max_batch_size = _positive("max_batch_size", max_batch_size, allow_none=True)
    for name in ("batch_size", "block", "live", "keep", "return_weights"):
        if name in fit_options:
            raise TypeError(f"find_batch_size() got {name}=...: it finds the batch size and trains nothing")
    return search_batch_size(model, data, FitArguments.of(fit_options, watched=False), start, max_batch_size)


def trial_arguments(args: FitArguments) -> FitArguments:
    """What of a fit shapes one training step, for its ``batch_size="auto"``: its step, layout and loaders.

    Not its NaN rule (``on_nan``'s agreement is a collective, and a trial's ranks must never wait in one for a
    rank that ran out of memory), nor ``compile`` (a trial would compile for minutes), nor its validation, loop,
    checkpoints, faults or view, which do not change the step.
    """
    return FitArguments(step=replace(args.step, on_nan="raise"), layout=replace(args.layout, compile=False),
                        data=replace(args.data, batch_size=None))


def search_batch_size(model: ModelLike, data: DataLike, args: FitArguments, start: int = 1,
                      max_batch_size: int | None = None) -> int:
    """``find_batch_size`` with the options as records: ``dist_fit(batch_size="auto")`` passes its own."""
    s = get_session()
    s.ensure_started()
    unit = batch_unit(args.layout.strategy, args.layout.mesh, s.world_size)  # a pipeline's microbatches
    with s.lock:
        s.ensure_ready()
        plan = plan_fit(s, model, data, replace(args, data=replace(args.data, batch_size=unit),
                                                result=ResultOptions(return_weights=False)))
    try:
        n, ranks = _length(data), data_parallel_size(plan.cfg.strategy, plan.cfg.mesh, s.world_size)
        if n is not None and n < ranks:
            raise ValueError(f"find_batch_size: the data has {n} sample(s) for {ranks} ranks: each rank needs "
                             "at least one. Use more data or fewer workers.")
        limits = [x for x in (max_batch_size, None if n is None else n // ranks) if x is not None]
        bound = min(limits) // unit if limits else None
        trials = Trials(s, plan)
        found = unit * search(lambda k: trials.fits(k * unit), max(1, min(start, bound * unit if bound else start) // unit),
                              bound, lambda: trials.shard // unit if trials.shard else None)
    finally:
        plan.discard()
    if found == 0:
        oom = next((r for r in trials.results.get(unit, []) if r.outcome == "oom"), None)
        raise WorkerError(_failure(oom), note="even a batch of 1 sample per rank does not fit: shard the model "
                                              "(strategy='fsdp'), use precision='bf16-mixed' or activation_checkpointing=True")
    return found


def _length(data: DataLike) -> int | None:
    from nbddp.protocol.data_forms import data_spec

    return data_spec(data, "find_batch_size(data=...)")[1]


def _failure(result: TrialResult | None) -> RankFailure:
    if result is None:
        return RankFailure(rank=0, exc_type="OutOfMemoryError", message="out of memory")
    exc_type, _, message = result.message.partition(": ")
    return RankFailure(rank=result.rank, exc_type=exc_type or "OutOfMemoryError", message=message or result.message)
