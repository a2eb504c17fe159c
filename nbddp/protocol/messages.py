"""The messages between the kernel and the workers, as typed records.

Both sides import this module (it imports nothing heavy), so a message is
pickled by reference and has the same fields on each side. What travels:

==============  ===================  =============================================
message         direction            when
==============  ===================  =============================================
``FitLaunch``   kernel -> each rank  once per fit, with the shipped arguments
``FitPlanInfo`` rank 0 -> kernel     once, when every rank agreed on set-up
``Progress``    rank 0 -> kernel     streamed: sequence number + recent records
``Beat``        each rank -> kernel  streamed about once a second (heartbeat)
``FitResult``   each rank -> kernel  the task's return value
``JoinReply``   each rank -> kernel  after joining a process-group generation
``Health``      each rank -> kernel  ``%ddp status``
``StackDump``   each rank -> kernel  ``nbddp.stacks()``
``PostMortemFailure`` each rank -> kernel  ``%ddp debug``: the failure it keeps
``ScriptResult`` each rank -> kernel ``nbddp.run_script``'s return value
``TrialResult``  each rank -> kernel ``find_batch_size``: one trial step's outcome
``ScalingRow``   rank 0 -> kernel     ``scaling_report``: one world size, timed
``PredictLaunch`` kernel -> each rank ``predict``/``evaluate``: what to run, with the shipped arguments
``PredictResult`` each rank -> kernel ``predict``: its outputs (a Parcel); ``evaluate``: rank 0's values
==============  ===================  =============================================

Streamed messages go through ``ipyparallel.datapub.publish_data``, which
keeps only the latest value per key; ``PUBLISH_KEYS`` names the keys.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ipyparallel import AsyncResult

PUBLISH_KEYS = {"plan": "nbddp-plan", "progress": "nbddp", "beat": "nbddp-beat", "stacks": "nbddp-stacks",
                "profile": "nbddp-profile", "raised": "nbddp-raised", "report": "nbddp-report"}


def published(ar: AsyncResult, kind: str) -> Any:
    """The latest value a rank published under ``PUBLISH_KEYS[kind]`` on the task ``ar``, or None."""
    data = getattr(ar, "data", None)
    return data.get(PUBLISH_KEYS[kind]) if isinstance(data, dict) else None

# the phases a rank reports in its heartbeat, in the order one micro-batch goes through them
PHASES = ("setup", "data", "forward", "backward", "optimizer", "collective", "validation", "checkpoint",
          "finish", "cell", "script", "call", "push", "paused")


@dataclass(frozen=True)
class RankInfo:
    """Where a rank runs, as the dashboard shows it."""

    rank: int
    host: str
    device: str
    pid: int


@dataclass(frozen=True)
class FitLaunch:
    """What every rank is told besides the shipped arguments."""

    generation: int
    returns: str  # "state_dict": weights into the notebook's model; "module": the trained module; "none"
    resident: tuple[str, ...] = ()  # dataset keys the kernel believes the workers hold
    keep: str | None = None  # bind the trained module to this name in every rank's %%ddp namespace
    best: Any = None  # fit_options.BestSpec: keep the best check's weights and end with them (restore_best)
    stoppers: tuple[Any, ...] = ()  # every EarlyStopping's BestSpec (with patience): the workers decide the stop
    answers: tuple[str, ...] = ()  # record kinds after which the ranks wait for the kernel's callbacks (epoch_answer)
    channel: str = ""  # a group across hosts: the fit's token in the store keys of answers/requests (store_channel)
    fit_id: str = ""  # names the fit in rank 0's journal and the ranks' kept results (a kernel that attaches later)
    answers_pid: int = 0  # the kernel that answers ``answers``: once it died, the ranks skip them (epoch_answer)


@dataclass(frozen=True)
class FitPlanInfo:
    """What only the workers know once the data is built (``None``: a stream's, seen only at its end)."""

    total_steps: int | None
    steps_per_epoch: int | None
    start_step: int
    batch_size: int
    model_class: str = ""  # the person's module, as ``module.QualName``
    params: int = 0  # its parameter count (whole model, also when sharded)
    notices: tuple[str, ...] = ()  # one-line notices for the person, raised as NbddpWarning in the kernel


@dataclass
class Progress:
    """Rank 0's stream: ``seq`` records so far, the last ``WINDOW`` of them, status, per-rank figures."""

    seq: int
    window: list[tuple[int, str, dict[str, Any]]]
    status: str
    ranks: list[dict[str, Any]]


@dataclass
class Beat:
    """One rank's heartbeat: where it is, and whether that changed.

    ``progress`` counts every phase change of the rank's main thread; the
    kernel marks a rank stalled when it stops changing. ``stack`` is the main
    thread's stack, sent only while the rank is not advancing.
    """

    rank: int
    seq: int
    progress: int
    phase: str
    step: int
    micro: int
    step_time_s: float
    idle_s: float  # seconds since ``progress`` last changed, on the rank's clock
    stack: str = ""
    paused_at: str = ""  # file:line where the rank waits at a debugger prompt (phase "paused")


# the phases a fit's time split reports from each rank (worker/engine/heartbeat.py marks them); any other
# marked phase (a debugger pause) is counted as "other". The kernel splits "collective" into communication
# and waiting (nbddp/profiling/time_split.py).
TIMED_PHASES = ("data", "forward", "backward", "optimizer", "collective", "validation", "checkpoint", "other")


def timed_phases(spent: dict[str, float]) -> dict[str, float]:
    """``spent`` over ``TIMED_PHASES``: every phase present, the unnamed ones summed into ``other``."""
    out = dict.fromkeys(TIMED_PHASES, 0.0)
    for phase, seconds in spent.items():
        out[phase if phase in out else "other"] += seconds
    return out


@dataclass
class FitResult:
    """A rank's return value from a fit (rank 0 carries the records and weights)."""

    rank: int
    step: int
    status: str  # "completed" or "interrupted"
    timings: dict[str, float]
    records: list[tuple[int, str, dict[str, Any]]] = field(default_factory=list)
    ranks: list[dict[str, Any]] = field(default_factory=list)
    weights: Any = None  # a shipping/pickling.py Parcel, or None
    restored: dict[str, Any] | None = None  # restore_best: the step and value whose weights these are
    plan: FitPlanInfo | None = None  # rank 0: the plan it published (which may arrive after the result does)
    stop_reason: str | None = None  # the workers stopped training early, and why (on_nan="stop")
    notices: list[str] = field(default_factory=list)  # one-line notices for the person, raised in the kernel
    compile: dict[str, Any] | None = None  # dist_fit(compile=...): this rank's compiles, recompiles and their reasons
    phase_s: dict[str, float] = field(default_factory=dict)  # this rank's seconds per TIMED_PHASES in training
    profile: dict[str, Any] | None = None  # dist_fit(profile=...): this rank's trace events, clock, top operators


@dataclass(frozen=True)
class JoinReply:
    rank: int
    seconds: float
    threads: int
    allocator: str


@dataclass(frozen=True)
class Health:
    pid: int
    rss: int
    generation: int
    busy: bool
    names: int
    cuda_allocated: int | None = None
    cuda_reserved: int | None = None
    # (name, bytes) of what stays on the worker between tasks (worker/memory/resident_sizes.py)
    resident: tuple[tuple[str, int], ...] = ()


# How a rank's stack reaches the kernel when its main thread cannot answer (blocked in C): the kernel sends
# STACK_SIGNAL, faulthandler writes every thread to the rank's stack file, the kernel reads it back.
STACK_SIGNAL = signal.SIGUSR1
MAIN_THREAD_HEADER = "nbddp-main-thread"  # first line of a stack file: "nbddp-main-thread 0x<ident> <pid>"
ENGINE_FRAME = os.path.join("ipyparallel", "engine", "kernel.py")  # where the engine calls a task: outside is boilerplate


@dataclass(frozen=True)
class StackDump:
    rank: int
    busy: bool
    text: str  # the main thread's Python stack, innermost frame last
    source: str  # "traceback" (sampled by the monitor thread), "faulthandler" or "idle"


def innermost_frames(stack: str, frames: int = 3) -> str:
    """The last ``frames`` frames of a formatted stack (``Beat.stack``, ``StackDump.text``), as text."""
    lines = stack.rstrip("\n").splitlines()
    starts = [i for i, line in enumerate(lines) if line.lstrip().startswith("File ")]
    if not starts:
        return ""
    return "\n".join(lines[starts[-frames:][0]:])


@dataclass(frozen=True)
class PostMortemFailure:
    """A failure a rank keeps for ``%ddp debug``: as which rank it failed, and where."""

    rank: int  # the rank it had when it failed (the one the WorkerError named)
    current_rank: int
    generation: int
    exc_type: str
    message: str
    where: str  # file:line of the innermost frame, by the kernel's file names
    function: str


@dataclass(frozen=True)
class ScriptResult:
    """One rank's end of ``run_script``: its exit status (0: success) and how long it ran."""

    rank: int
    exit_code: int
    seconds: float


@dataclass(frozen=True)
class TrialResult:
    """One rank's outcome of one ``find_batch_size`` trial: ``"fits"`` or ``"oom"``."""

    rank: int
    batch_size: int
    outcome: str
    message: str  # the allocator's message when it ran out of memory
    peak_mem: int  # bytes: CUDA peak allocated, or peak RSS on CPU
    shard: int  # samples in this rank's shard (the upper bound of the search)


@dataclass(frozen=True)
class ScalingRow:
    """Timed training at one world size (rank 0's, the slowest rank's times)."""

    world_size: int
    samples_per_s: float
    step_s: float  # one optimizer step, gradients reduced
    local_step_s: float  # the same step without reducing gradients (no_sync)
    peak_mem: int  # the largest peak of the ranks taking part
    topology: str = ""  # how the ranks trained: "ddp", "pp=2", "dp=2 x tp=2 (ddp over dp)" (parallel_settings.describe)
    phase_s: list[dict[str, float]] = field(default_factory=list)  # each rank's seconds per TIMED_PHASES, synced


@dataclass(frozen=True)
class PredictLaunch:
    """What every rank is told for ``nbddp.predict`` / ``nbddp.evaluate``, besides the shipped arguments."""

    generation: int
    task: str  # "predict" or "evaluate"
    batch_size: int
    precision: str = "32-true"
    output: str = "tensor"  # "tensor": concatenated where the batches allow; "list": one entry per batch
    to: str | None = None  # each rank writes its part to this file (predict(to=...)) instead of sending it
    out_file: str = ""  # the kernel's host: ranks write outputs into this shared file (shipping/output_file.py)


@dataclass
class PredictResult:
    """One rank's end of ``predict``/``evaluate``.

    ``outputs``: a ``nbddp.shipping.pickling.Parcel`` of ``{"kind", "value", "rows"}`` (``worker/inference/outputs.py``);
    ``values``: ``evaluate``'s exact values (a Parcel, rank 0 only); ``first``: the dataset index of this
    rank's first sample (its block is ``first .. first + samples - 1``; of a stream, every ``stride``-th sample).
    """

    rank: int
    status: str  # "completed" or "interrupted"
    first: int = 0
    samples: int = 0
    stride: int = 1  # a stream's samples of this rank are first, first + stride, ... (map-style: a block)
    stream: bool = False  # the data was a stream: the outputs come back with their ids
    path: str = ""  # predict(to=...): the file this rank wrote its part to
    outputs: Any = None
    values: Any = None
    timings: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class KeptModel:
    """``predict(model="name")``: the module an earlier fit bound to ``name`` on every rank (``keep=``)."""

    name: str
