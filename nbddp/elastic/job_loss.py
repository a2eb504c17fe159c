"""An elastic fit whose Slurm job was lost: retried or not, a new job, and the fit going on from what survived.

A job lost with its nodes takes every rank at once, so nothing is healed in
place: ``Recovery`` hands such a ``SlurmError`` here. When the job's end is
one that a new job may not meet again (``RETRIED``: a node failed, a
preemption, a requeue, the time limit) and ``max_restarts`` allows, the lost
job is put aside (``SlurmJobs.retired``), the supervisor's heal submits a
new job of the same shape, as ``%ddp restart`` would, but keeping the
session's controller, and waits for it as long as ``queue_timeout`` allows,
the pending line shown in the fit's live view. Then every host of the new
job says what it holds (``worker/tasks/held_snapshots.py``) and the fit
resumes from the newest step that every rank can read: a snapshot whose
files survived in the ``/dev/shm`` of the nodes the new job landed on (on
any of them: the relaunch copies them to the others, as after a lost host),
or a checkpoint in ``checkpoint_dir`` written since this fit began. If
neither survived, the error says so, and what would have.
"""

from __future__ import annotations

import time
from typing import Any

from nbddp.cluster.slurm.queue import GONE, WAITING_STATES, cancel
from nbddp.cluster.slurm.queue import JobState
from nbddp.cluster.slurm.watch import fmt_clock
from nbddp.elastic.contracts import Relaunchable, RestartLedger
from nbddp.execution.contracts import SessionLike
from nbddp.execution.send import silent_engines, to_engine
from nbddp.protocol.errors import ClusterError, SlurmError
from nbddp.protocol.notices import notify
from nbddp.protocol.snapshot_pieces import newest_covered, path_of

# A job's end that a new job may well not meet again: retried with max_restarts
RETRIED = {
    "NODE_FAIL": "a node failed; a new job gets healthy nodes",
    "PREEMPTED": "a job of higher priority took the nodes; a new job waits for its turn",
    "BOOT_FAIL": "the nodes did not boot; a new job gets others",
    "TIMEOUT": "a new job gets a new time limit (how a fit longer than the partition's MaxTime goes on)",
    "REQUEUED": "Slurm put the job back in the queue; nbddp cancels it and submits a new one",
}
# ... and those a new job would meet again, or that were somebody's decision: not retried
NOT_RETRIED = {
    "CANCELLED": "scancel is a decision (yours or an administrator's; Slurm does not say whose), not a fault",
    "FAILED": "the batch script exited with an error, and a new job runs the same script",
    "OUT_OF_MEMORY": "a new job would ask for the same memory; ask for more with --sbatch '--mem=...'",
    "DEADLINE": "the job's deadline has passed for a new job too",
    "COMPLETED": "the engines exited on their own",
    GONE: "Slurm no longer says how the job ended",
}
SNAPSHOT = "snapshot in /dev/shm"  # History.restarts' resumed_from for a snapshot that survived
CLOCK_SLACK_S = 5.0  # a checkpoint written since the fit began, on a node's clock a little behind the kernel's
FORGET_S = 30.0  # bound on the controller's unregistering a lost job's engines (told at once: cluster/unregister.py)


def cause(state: str) -> str:
    """The restart's cause in ``History.restarts``: Slurm's state, ``REQUEUED`` for a job back in the queue."""
    return "REQUEUED" if state in WAITING_STATES else state


def retried(state: str) -> bool:
    """Whether an elastic fit goes on in a new job after its job ended in ``state`` (``squeue``'s word)."""
    return cause(state) in RETRIED


def advise(session: SessionLike, checkpoint_dir: str | None) -> str | None:
    """At an elastic fit's launch on a Slurm job over several nodes without ``checkpoint_dir``: say, once, that a
    lost job may not be resumable (the snapshots are only in the lost job's nodes' ``/dev/shm``).

    Returns the notice given, or None.
    """
    workers = session.workers
    if workers is None or workers.jobs is None or checkpoint_dir:
        return None
    hosts = sorted({p.host for p in session.placements})
    if len(hosts) < 2:
        return None
    text = (f"nbddp: this elastic fit runs in a Slurm job over {len(hosts)} nodes without checkpoint_dir: its snapshots "
            "are only in the nodes' memory (/dev/shm: each file on the node that wrote it and a copy on one other), so "
            "if the job is lost (NODE_FAIL, a preemption, the time limit) and the new job's nodes together do not hold "
            "a whole one (nodes rebooted, or the job placed elsewhere), the fit ends. Pass checkpoint_dir= on a file system the nodes share (with "
            "checkpoint_every=N to lose at most N steps).")
    notify(text, stacklevel=5)  # notify, advise, FitRun.launch, dist_fit, the cell
    return text


def not_retried(exc: SlurmError, max_restarts: int) -> str | None:
    """Why a new job would not recover from ``exc`` (None: it would; ``Recovery`` then checks ``max_restarts``)."""
    if retried(exc.state):
        return None
    word = cause(exc.state)
    why = NOT_RETRIED.get(word, "it is not a loss a new job recovers from")
    return (f"nbddp: not retried (max_restarts={max_restarts}): {word}: {why}. A new job is retried after "
            f"{', '.join(RETRIED)}")


def relaunch(recovery: RestartLedger, run: Relaunchable, exc: SlurmError, steps: list[int]) -> dict[str, Any]:
    """Submit a new job, wait for it (shown live), and launch the same fit again from what survived.

    Returns the restart's event (``History.restarts``); ``recovery.fit_resumed`` completes it.
    """
    noticed = time.monotonic()
    s = run.session
    workers = s.workers
    jobs = workers.jobs if workers is not None else None
    assert workers is not None and jobs is not None, "a SlurmError's fit ran on a Slurm job's workers"
    event = recovery.lost(None, cause(exc.state), max(steps), job=exc.job_id, new_job=None, resumed_from=None)
    head = f"Slurm job {exc.job_id} lost at step {event['step_lost_at']} ({event['cause']})"
    run.show_restart(f"{head}; submitting a new job", status="recovering")
    jobs.retired.add(exc.job_id)
    if exc.state in WAITING_STATES:  # requeued: its engines must not start again beside the new job's
        cancel([exc.job_id])
    _forget_lost_engines(s)
    new_job_ready(run, head, exc)
    event["new_job"] = jobs.ids[-1] if jobs.ids else None
    recovery.relaunched(event, noticed)
    resume, event["resumed_from"] = resume_point(run, event)
    # a snapshot: the relaunch takes it as after a lost rank (the same rule picks the same step), copying its files
    # to the new job's nodes that lack them; a checkpoint: from checkpoint_dir, which every node reads
    run.relaunch(resume=None if event["resumed_from"] == SNAPSHOT else resume)
    return event


def new_job_ready(run: Relaunchable, head: str, exc: SlurmError) -> None:
    """The supervisor's heal submits the new job and forms the group on it; wait, the job's line in the live view.

    Raises:
        SlurmError: the fit was stopped while the new job waited (the job is cancelled).
        ClusterError: the new job could not start (Slurm refused it, or ``queue_timeout`` passed).
    """
    s = run.session
    request = s.options.slurm if s.options is not None else None
    wait = {"queue_timeout": request.queue_timeout if request is not None else None, "show": LiveJobLine(run, head)}
    s.supervisor.recover([], job_wait=wait)
    try:
        s.wait_healed(raise_error=True)
    except ClusterError as failed:
        if run.stopping:
            raise SlurmError(f"{head}; the fit was stopped while its new job waited in Slurm's queue, so nbddp "
                             "cancelled that job. The model keeps the weights it had before the call; run "
                             "nbddp.restart() to submit a new job.", exc.job_id, exc.state) from failed
        raise


def resumed_line(event: dict[str, Any], start_step: int) -> str:
    """The live view's line once the relaunched fit restored its state."""
    return (f"Slurm job {event['job']} lost at step {event['step_lost_at']} ({event['cause']}); new job "
            f"{event['new_job']} ready in {event['replace_s']:.1f} s; resumed from step {start_step} "
            f"({event['resumed_from']})")


class LiveJobLine:
    """``SlurmJobs.wait_started``'s line, in the fit's live view: the new job pending, then starting.

    A stop asked meanwhile (Kernel > Interrupt, ``handle.stop()``) cancels the new job.
    """

    def __init__(self, run: Relaunchable, head: str):
        self.run, self.head = run, head

    def show(self, job: JobState, waited: float, have: int, n: int, final: str = "") -> None:
        run = self.run
        workers = run.session.workers
        if run.stopping:
            if workers is not None and workers.jobs is not None:
                workers.jobs.cancel()
            raise ClusterError(f"stopped while Slurm job {job.job_id} was {job.state}")
        words = job.headline() + (f", {have} of {n} engines registered" if job.running or final else "")
        run.show_restart(f"{self.head}; new {words}, {fmt_clock(waited)}", replace_last=True)


def resume_point(run: Relaunchable, event: dict[str, Any]) -> tuple[bool | str, str]:
    """(``resume=`` for the relaunch, where that is in words): the newest state every rank of the new job reads."""
    from nbddp.worker.tasks.held_snapshots import held

    s, cfg = run.session, run.config
    one_per_host = {p.host: p.engine_id for p in s.placements}
    asked = {host: to_engine(s.client, eid, held, cfg.snapshot_dir, cfg.checkpoint_dir)
             for host, eid in one_per_host.items()}
    holdings = {host: ar.get(timeout=FORGET_S) for host, ar in asked.items()}
    began = time.time() - (time.perf_counter() - run.started_at)
    found = choose(holdings, began - CLOCK_SLACK_S)
    if found is not None:
        return found
    if event["step_lost_at"] == 0:  # lost before a first step: nothing is lost by starting as the first launch did
        return cfg.resume, "the start: no step had been taken"
    raise SlurmError(nothing_survived(event, holdings, cfg.checkpoint_dir, run.policy.max_restarts),
                     event["job"], event["cause"])


def choose(holdings: dict[str, dict[str, Any]], since: float) -> tuple[str, str] | None:
    """The newest step every rank can read: ``(path, SNAPSHOT | "checkpoint_dir")``, or None.

    ``holdings``: host -> ``held_snapshots.held()``. A snapshot counts when every file of it is on some host of
    the new job (``protocol.snapshot_pieces``: the relaunch copies them to the hosts that lack them); a
    checkpoint when every host reads it, and only if written after ``since``: ``checkpoint_dir`` may hold an
    earlier fit's. On a tie the snapshot is taken (memory reads faster).
    """
    if not holdings:
        return None
    pieces = [{int(k): v for k, v in h.get("pieces", {}).items()} for h in holdings.values()]
    ckpts = [{int(k): v[0] for k, v in h["checkpoints"].items() if v[1] >= since} for h in holdings.values()]
    found = [(step, 0, ckpts[0][step], "checkpoint_dir") for step in set.intersection(*(set(h) for h in ckpts))]
    step = newest_covered(pieces)
    if step is not None:
        found.append((step, 1, path_of(pieces, step), SNAPSHOT))
    best = max(found, default=None)
    return None if best is None else (best[2], best[3])


def nothing_survived(event: dict[str, Any], holdings: dict[str, dict[str, Any]], checkpoint_dir: str | None,
                     max_restarts: int) -> str:
    """The error when no state of the fit survived for every rank: what each host held, and what would have."""
    snaps = "; ".join(f"{host}: {_held(h.get('pieces', {}))}" for host, h in sorted(holdings.items()))
    if checkpoint_dir:
        ckpts = "; ".join(f"{host}: {_steps(h['checkpoints'])}" for host, h in sorted(holdings.items()))
        where = f"checkpoint_dir={checkpoint_dir!r} holds no checkpoint of this fit that every node reads ({ckpts})"
    else:
        where = "the fit has no checkpoint_dir"
    return (f"Slurm job {event['job']} was lost at step {event['step_lost_at']} ({event['cause']}) and nbddp "
            f"submitted job {event['new_job']} to go on (max_restarts={max_restarts}), but none of the fit's state "
            f"survived where every rank of the new job can read it. Snapshots in /dev/shm, by host: {snaps} (a "
            "step is taken when each of its files is on some node; a node's memory is its own, and goes with a "
            f"node that fails or reboots); {where}. What would "
            "have survived: dist_fit(checkpoint_dir=...) on a file system every node mounts (your home or project "
            "folder, not /tmp), with checkpoint_every=N to lose at most N steps. The new job's workers are ready.")


def _steps(found: dict[Any, Any]) -> str:
    return ", ".join(f"step {k}" for k in sorted(int(k) for k in found)) or "none"


def _held(pieces: dict[Any, dict[str, Any]]) -> str:
    """What a host holds of each snapshot: ``step 8`` when it holds every file, ``step 8 (in part)`` else."""
    def whole(entry: dict[str, Any]) -> bool:
        return entry.get("needs") is not None and set(entry["needs"]) <= set(entry["have"])

    return ", ".join(f"step {k}" + ("" if whole(pieces[k]) else " (in part)")
                     for k in sorted(pieces, key=int)) or "none"


def _forget_lost_engines(session: SessionLike) -> None:
    """Unregister the lost job's engines, and wait until the client no longer lists them.

    When every job of the session is lost, so is every engine, and none is asked; otherwise those that
    do not answer a ping within 5 s are the lost ones.
    """
    workers = session.workers
    jobs = workers.jobs if workers is not None else None
    assert workers is not None and jobs is not None, "a lost job's engines are a Slurm job's"
    if not set(jobs.ids) - jobs.retired:
        workers.forget_dead(list(workers.ids), timeout=FORGET_S)
        return
    # an engine unregistered meanwhile counts as lost too: forgetting it again does nothing
    workers.forget_dead(silent_engines(workers.client, list(workers.ids), 5.0), timeout=FORGET_S)


def add_note(exc: SlurmError, text: str) -> None:
    """``text`` on a new line of ``exc``'s message (a ``SlurmError`` has no ``with_note``)."""
    exc.args = (f"{exc}\n{text}",)
