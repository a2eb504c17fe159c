"""A fit in a detached session, as its record names it: what a later kernel needs to take its result.

While the kernel that launched it lives, a fit is watched as ever
(``fit/fit_run.py``). Its record entry (``running``) says which fit it is
(``FitLaunch.fit_id``), what comes back (weights or a kept name) and how to
draw it; rank 0 keeps the journal of its records meanwhile
(``worker/training/journal.py``), so a kernel that attaches after this one
died can show the whole curve and take the result.
"""

from __future__ import annotations

import time
from typing import Any

from nbddp.detached import care_spec, fit_loggers, records
from nbddp.session.session import Session


def sketch(run: Any) -> dict[str, Any] | None:
    """The record entry of a running fit (``None``: the running work is no fit)."""
    plan: Any = getattr(run, "plan", None)
    launch = getattr(plan, "launch", None)
    if plan is None or launch is None or not getattr(launch, "fit_id", ""):
        return None
    cfg = plan.cfg
    world = run.session.world_size
    return {"fit_id": launch.fit_id, "returns": launch.returns, "keep": launch.keep, "epochs": cfg.epochs,
            "batch_size": cfg.batch_size, "global_batch": cfg.global_batch_size(world), "world": world,
            "model_class": type(plan.model).__name__ if plan.model is not None else "", "started": time.time()}


def note_launch(run: Any) -> None:
    """``Session.on_launch``: a fit launched in a detached session is named in its record."""
    entry = sketch(run)
    if entry is not None:
        # max_restarts: a lost rank is replaced and the fit relaunched also while no kernel is attached
        entry["care"] = care_spec.save(run.session, run, entry)
        records.refresh(run.session, running=entry)
        fit_loggers.save(run.session, run, entry)  # (before the watcher starts: no logger has opened its run yet)
        # this kernel took the result itself: a kernel attaching later has nothing to take up
        run.on_ending(lambda: fit_ended(run.session, entry, run.error is None))


def fit_ended(session: Session, entry: dict[str, Any], succeeded: bool) -> None:
    """The record no longer names the fit as running; the name it kept on the ranks is listed."""
    record = records.refresh(session, running=None)
    fit_loggers.forget(session.record_path, entry)
    care_spec.forget(session.record_path, session.file_prefix, str(entry["fit_id"]))
    keep = entry.get("keep")
    if record is not None and succeeded and keep and keep not in record.kept:
        records.refresh(session, kept=[*record.kept, keep])


def note_running(session: Session) -> None:
    """At detach (or attach): name the fit running now, and be told of every later one."""
    if note_launch not in session.on_launch:
        session.on_launch.append(note_launch)
    run = session.running
    if run is not None and not run.finished:
        note_launch(run)
