"""The workers' half of ``nbddp.sweep``: process groups per trial group, and one trial as one task.

A sweep splits the ranks into groups of ``workers_per_trial`` and runs
independent trials on them, each group at its own pace. ``open_groups`` runs
once per sweep on every rank (``dist.new_group`` is collective over the
whole world, in the same order everywhere); the groups stay on the workers,
under the sweep's token, until ``close_groups``. The session's own group is
never touched, so the next ``dist_fit`` runs as before.

``trial_task`` is one trial on one rank of a group: ``loop.fit`` in the
group, with the trial's values bound to the shipped factory or ``step_fn``
(``setup.build``'s ``bind``). The model code and the data travel once per
sweep, in the same parcel for every trial; a trial sends only its values.
The kernel prunes a trial with SIGINT to its group's engines, the same
coordinated stop as ``dist_fit``'s (the flag travels in the group's
reduction, so every rank of the group stops at the same step).
"""

from __future__ import annotations

import time
from typing import Any

import torch.distributed as dist

from nbddp.protocol.messages import FitLaunch, FitResult
from nbddp.shipping.pickling import Parcel
from nbddp.worker.engine.rank_state import STATE, check_generation, stop_on_sigint
from nbddp.worker.memory.release import run_task
from nbddp.worker.tasks.entry import fit_task_result
from nbddp.worker.engine.group_lifetime import destroy_subgroup
from nbddp.worker.tasks.user_task import user_task

GROUPS: dict[str, list[Any]] = {}  # sweep token -> this rank's groups (None where it is not a member), in order


def open_groups(token: str, generation: int, members: list[list[int]]) -> int:
    """Make one process group per entry of ``members`` (collective: every rank, same order); return how many."""
    check_generation(generation)
    for stale in list(GROUPS):  # a sweep that could not close its groups (its workers were replaced, or it died)
        try:
            close_groups(stale)
        except Exception:  # noqa: BLE001 - groups of an old generation went with it
            pass
    mine = STATE.placement.rank
    groups = []
    for ranks in members:
        group = dist.new_group(ranks)  # every rank calls it, member or not (torch's rule for new_group)
        groups.append(group if mine in ranks else None)
    GROUPS[token] = groups
    return len(groups)


def close_groups(token: str) -> None:
    """Destroy this sweep's groups on this rank (a rank's own groups only: it is no collective)."""
    for group in GROUPS.pop(token, None) or []:
        if group is not None:
            destroy_subgroup(group)


def trial_task(token: str, index: int, parcel: Parcel, cfg: Any, launch: FitLaunch,
               model_parcel: Parcel | None, bind: dict[str, dict[str, Any]]) -> FitResult:
    """One trial in group ``index`` of the sweep ``token``; the group's first rank carries records and weights.

    ``timings`` gains ``task_start_wall`` and ``returned_wall`` (this task's first and last moments on the worker):
    with the loop's own, they split the gap between trials (``benchmarks/bench_sweep.py``)."""
    start = time.time()
    result = run_task(_trial, token, index, parcel, cfg, launch, model_parcel, bind)
    result.timings.update(task_start_wall=start, returned_wall=time.time())
    return result


def _trial(token: str, index: int, parcel: Parcel, cfg: Any, launch: FitLaunch, model_parcel: Parcel | None,
           bind: dict[str, dict[str, Any]]) -> FitResult:
    from nbddp.worker.training import loop

    groups = GROUPS.get(token)
    group = groups[index] if groups is not None and index < len(groups) else None
    if group is None:
        raise RuntimeError(f"this rank ({STATE.placement.rank}) holds no process group {index} of sweep {token}: "
                           "the workers were replaced since the sweep began; run the sweep again")
    # the stop handler first: a prune or stop signal that lands while the task starts is a flag, never an exception
    with stop_on_sigint(), user_task(launch.generation, "fit"):
        within = (dist.get_rank(group), dist.get_world_size(group), group)
        result, ts = loop.fit(parcel, cfg, launch, model_parcel, within=within, bind=bind)
    del ts
    return fit_task_result(result, launch)
