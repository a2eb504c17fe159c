"""What an elastic fit (``dist_fit(max_restarts=...)``) sets up when it starts and takes down when it ends.

At the start: the fit's snapshot folder, a warm spare engine, on Slurm the
advice about what would survive a lost job, and on a cluster nbddp cannot
start engines on, the heal's wait for a replacement. At the end, whatever
happened: the folder on every host and that wait; after a fit that went on
with fewer ranks, the heal back to the size it began with is asked for (it
runs before the session's next call). One place, so that the
``FitRun`` cannot set one up and forget to take it down.
"""

from __future__ import annotations

from nbddp.elastic import job_loss, replacements, snapshot_folder
from nbddp.elastic.spare import keep_spare
from nbddp.execution.contracts import SessionLike
from nbddp.protocol.fit_options import FitConfig


def begin(session: SessionLike, cfg: FitConfig) -> None:
    """Before the ranks start: ``cfg.snapshot_dir`` made (0700, in ``/dev/shm``) and the heal prepared."""
    cfg.snapshot_dir = snapshot_folder.make(session.file_prefix)
    keep_spare(session)  # a warm engine to replace a lost rank with, started in the background
    job_loss.advise(session, cfg.checkpoint_dir)  # on Slurm: what survives a lost job
    session.supervisor.await_engines_s = replacements.WAIT_S  # (where nbddp cannot start an engine)


def end(session: SessionLike, cfg: FitConfig) -> None:
    """After the fit, whatever its outcome: every host's snapshot folder removed, the heal's wait back to none."""
    snapshot_folder.remove(cfg.snapshot_dir, session)
    session.supervisor.await_engines_s = 0.0
    if cfg.data_world and 0 < session.world_size < cfg.data_world:  # it went on with fewer ranks (min_workers)
        session.supervisor.regrow_to = cfg.data_world  # the next call heals back first
