"""What Slurm says about a job: its state, Slurm's reason, its nodes, its elapsed time.

ipyparallel's batch launchers never poll their job (``poll()`` returns
None), so nbddp asks ``squeue`` itself. Accounting is often off on small
clusters (``sacct`` then knows nothing); ``squeue --states=all`` lists a
finished job with its final state for ``MinJobAge`` seconds (300 by
default) and then forgets it: such a job is reported as ``GONE``.

Parsing is kept apart from running the command, so both are tested without
a Slurm.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from typing import Callable, Sequence

SQUEUE_FORMAT = "%i|%T|%r|%N|%M|%l|%P|%D"
FIELDS = ("job_id", "state", "reason", "nodes", "elapsed", "time_limit", "partition", "node_count")
QUERY_TIMEOUT_S = 10.0

# Slurm's job states (squeue --states): these are over for good
FINAL_STATES = frozenset({"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY",
                          "PREEMPTED", "REVOKED", "SPECIAL_EXIT", "TIMEOUT"})
WAITING_STATES = frozenset({"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "SUSPENDED",
                            "STOPPED", "CONFIGURING"})
GONE = "GONE"  # Slurm no longer lists the job (it ended more than MinJobAge ago, or never existed)

# Pending reasons that no amount of waiting clears: the request itself can never be met
HOPELESS_REASONS = frozenset({"PartitionTimeLimit", "BadConstraints", "InvalidAccount", "InvalidQOS",
                              "AccountNotAllowed", "QOSNotAllowed", "DependencyNeverSatisfied", "JobLaunchFailure"})

Runner = Callable[..., "subprocess.CompletedProcess[str]"]


@dataclass(frozen=True)
class JobState:
    """One line of ``squeue`` for one job."""

    job_id: str
    state: str
    reason: str = ""
    nodes: str = ""
    elapsed: str = ""
    time_limit: str = ""
    partition: str = ""
    node_count: str = ""

    @property
    def pending(self) -> bool:
        return self.state in WAITING_STATES

    @property
    def running(self) -> bool:
        return self.state == "RUNNING"

    @property
    def ended(self) -> bool:
        """Over, or on its way out (``COMPLETING``: its processes are being killed)."""
        return self.state in FINAL_STATES or self.state in (GONE, "COMPLETING")

    @property
    def why(self) -> str:
        """Slurm's reason, when it says one (``"None"`` is its word for none)."""
        return "" if self.reason in ("", "None", "(null)") else self.reason

    def headline(self) -> str:
        """``"Slurm job 42: PENDING (Resources)"``, ``"Slurm job 42: RUNNING on n[1-2]"``."""
        if self.state == GONE:
            return f"Slurm job {self.job_id}: no longer listed by Slurm"
        text = f"Slurm job {self.job_id}: {self.state}"
        if self.why:
            text += f" ({self.why})"
        if self.nodes and not self.pending:
            text += f" on {self.nodes}"
        return text


def parse_squeue(text: str) -> dict[str, JobState]:
    """``squeue -h -o SQUEUE_FORMAT`` output -> job id -> state (lines that do not parse are skipped)."""
    jobs = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) != len(FIELDS) or not parts[0]:
            continue
        job = JobState(**dict(zip(FIELDS, (p.strip() for p in parts))))
        jobs[job.job_id] = job
    return jobs


def parse_scontrol_partition(text: str) -> int | None:
    """``TotalNodes`` from ``scontrol show partition -o NAME``, or None."""
    for word in text.split():
        key, _, value = word.partition("=")
        if key == "TotalNodes" and value.isdigit():
            return int(value)
    return None


def run_slurm(argv: Sequence[str], timeout: float = QUERY_TIMEOUT_S) -> "subprocess.CompletedProcess[str]":
    """A Slurm client command, its output as text; a missing command or a hang is reported as a failure."""
    try:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return subprocess.CompletedProcess(list(argv), 127, "", f"{argv[0]}: {exc}")


def query(job_ids: Sequence[str], run: Runner = run_slurm) -> dict[str, JobState]:
    """The state of every job in ``job_ids``; a job Slurm no longer lists is ``GONE``.

    ``squeue`` fails as a whole when one id is unknown ("Invalid job id
    specified"), so on a failure each job is asked alone. A job whose state
    cannot be read (slurmctld does not answer) is left out: the caller
    keeps what it knew.
    """
    ids = [str(j) for j in job_ids if j]
    if not ids:
        return {}
    done = run(["squeue", "-h", "--states=all", "-o", SQUEUE_FORMAT, "-j", ",".join(ids)])
    if done.returncode == 0:
        found = parse_squeue(done.stdout)
        return {j: found.get(j, JobState(j, GONE)) for j in ids}
    if len(ids) > 1:
        out: dict[str, JobState] = {}
        for j in ids:
            out.update(query([j], run))
        return out
    if "Invalid job id" in done.stderr:
        return {ids[0]: JobState(ids[0], GONE)}
    return {}


def partition_nodes(partition: str, run: Runner = run_slurm) -> int | None:
    """How many nodes ``partition`` has in all (``scontrol show partition``), or None when unknown."""
    done = run(["scontrol", "show", "partition", "-o", partition])
    return parse_scontrol_partition(done.stdout) if done.returncode == 0 else None


def never_starts(job: JobState, run: Runner = run_slurm) -> bool:
    """Whether a pending job's reason says it can never start as asked.

    ``PartitionNodeLimit`` also shows while nodes are down, so it only counts
    when the job asks for more nodes than the partition has at all.
    """
    if not job.pending:
        return False
    if job.why in HOPELESS_REASONS:
        return True
    if job.why == "PartitionNodeLimit" and job.node_count.isdigit() and job.partition:
        total = partition_nodes(job.partition, run)
        return total is not None and int(job.node_count) > total
    return False


def cancel(job_ids: Sequence[str], run: Runner = run_slurm) -> str:
    """``scancel`` these jobs; return its complaint ("" when it had none: an ended job is not one)."""
    ids = [str(j) for j in job_ids if j]
    if not ids:
        return ""
    done = run(["scancel", *ids])
    text = done.stderr.strip()
    if done.returncode == 0 or "already completing or completed" in text or "Invalid job id" in text:
        return ""
    return text or f"scancel exited with status {done.returncode}"
