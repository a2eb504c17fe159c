"""A trial whose worker died, resumed from its newest snapshot: ``nbddp.sweep(max_restarts=N, snapshot_every=...)``.

With ``snapshot_every`` each trial gets a folder of its own in ``/dev/shm``
(owner-only, ``elastic/snapshot_folder.py``) and its group snapshots into it
as an elastic ``dist_fit`` does (``worker/checkpoints/snapshots.py``). When a
worker of the trial dies, the trial is not told to Optuna: it is held,
RUNNING, until the other running trials have ended and the lost engines are
replaced (``SweepRun._heal``), then it runs again on its own group, healed,
from the newest snapshot (``FitConfig.from_snapshot``), before any new trial
takes that group. Its History keeps the records the kernel saw up to the
step it resumed from, then the relaunch's, and ``History.restarts`` says what
happened, as a ``dist_fit``'s does. Once ``max_restarts`` are used, the next
death fails the trial. Without ``snapshot_every`` a dead worker's trial runs
again from its start, as a new trial (``SweepRun.lost``).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from nbddp.elastic import snapshot_folder
from nbddp.protocol.messages import published


def with_snapshots(sweep: Any, cfg: Any) -> Any:
    """A new trial's config: with a snapshot folder of its own when the sweep snapshots, else unchanged."""
    if sweep.snapshot_every is None:
        return cfg
    return replace(cfg, snapshot_every=sweep.snapshot_every,
                   snapshot_dir=snapshot_folder.make(sweep.session.file_prefix))


def hold(sweep: Any, run: Any, died: list[int], failure: Any) -> bool:
    """``run``'s worker died: hold it to resume (True), or say why it is not (False: the trial fails)."""
    if sweep.snapshot_every is None or sweep.stopping:
        return False
    used = len(run.restarts)
    if used >= sweep.max_restarts:
        run.row.error += (f"\n(its worker died, and max_restarts={sweep.max_restarts} is spent: this trial resumed "
                          f"{used} time(s) from its snapshots and is not resumed again; pass "
                          f"nbddp.sweep(..., max_restarts={sweep.max_restarts + 1}) or more to resume further)")
        return False
    if run.restarts:  # this attempt was itself a resume: the attempt before it counts up to where this one began
        plan = published(run.ars[sweep.groups[run.row.group][0]], "plan")
        if plan is not None:
            cut(run, plan.start_step)
    run.pending += run.records
    steps = [r.get("step", 0) for _, r in run.pending + run.kept]
    run.restarts.append({"rank": failure.rank, "cause": f"{failure.exc_type}: {failure.message}",
                         "step_lost_at": max(steps, default=0), "step_resumed_from": None, "replace_s": None,
                         "seconds": None, "time": time.time()})
    sweep.lost(run, died, retry=False)  # its engines are replaced once no trial runs
    run.row.state = "resuming"
    sweep.resuming.append(run)
    return True


def cut(run: Any, start_step: int) -> None:
    """The attempt after a death resumed at ``start_step``: the lost attempt's records up to it are kept."""
    run.kept += [(kind, r) for kind, r in run.pending if r.get("step", 0) <= start_step]
    run.pending = []
    run.restarts[-1]["step_resumed_from"] = start_step


def held_for(sweep: Any, g: int) -> Any:
    """The held trial that resumes on group ``g`` (its own), or None."""
    return next((run for run in sweep.resuming if run.row.group == g), None)


def relaunch(sweep: Any, g: int, run: Any) -> None:
    """Run the held trial ``run`` again on its healed group ``g``, from its newest snapshot."""
    sweep.resuming.remove(run)
    event = run.restarts[-1]
    event["replace_s"] = round(time.time() - event["time"], 3)
    cfg = replace(run.cfg, from_snapshot=True)
    ars, engines = sweep.send(g, cfg, run.bind)
    run.row.state, run.row.error = "running", ""
    # the same trial, row, values and records so far; a new attempt's tasks (``scheduler.Running``)
    sweep.running[g] = replace(run, ars=ars, engines=engines, cfg=cfg, seen=0, records=[], signalled=False,
                               signal_sent=None, failed_at=None, stalled="", walls={"sent_wall": time.time()})
    sweep.changed += 1


def records_of(run: Any, head: Any) -> list[tuple[str, dict[str, Any]]]:
    """A finished trial's records, as ``(kind, record)``: those kept across its resumes, then its last attempt's."""
    if run.restarts:
        start = head.plan.start_step if head.plan is not None else 0
        cut(run, start)
        event = run.restarts[-1]
        if "train_start_wall" in head.timings:
            event["seconds"] = round(head.timings["train_start_wall"] - event["time"], 3)
    return run.kept + [(kind, record) for _, kind, record in head.records]


def release(run: Any) -> None:
    """The trial's snapshots go (it ended, or will not resume)."""
    snapshot_folder.remove(getattr(run.cfg, "snapshot_dir", None))
