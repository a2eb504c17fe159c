"""Errors raised in the notebook, rendered the way IPython renders tracebacks.

A failure on a worker is only useful if it names the rank and shows the
remote traceback, so ``WorkerError`` carries both and implements
``_render_traceback_`` (IPython calls it instead of printing the local,
uninteresting kernel-side traceback).

``WorkerError`` is also an ipyparallel ``RemoteError`` (a subclass: an
``except`` clause tests classes, not registrations), so code written for
``%px`` catches it and reads it by ipyparallel's names: ``ename``,
``evalue``, ``traceback``, ``engine_info``, and ``elist`` as on a
``CompositeError`` when several ranks failed. The workers are ipyparallel
engines, so ipyparallel is there on both sides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from ipyparallel.error import RemoteError

from nbddp.protocol.messages import innermost_frames


class NbddpError(RuntimeError):
    """Base class of errors raised by nbddp itself (not by bad arguments)."""


class NotStartedError(NbddpError):
    """An operation needs workers, and none are running."""


class NothingToDebug(NbddpError):
    """``nbddp.debug()`` found no rank paused at ``breakpoint()`` and none keeping a failure."""


class FitRunningError(NbddpError):
    """A second fit (or cell) was started while one runs on the same workers."""


class ClusterError(NbddpError):
    """Engines or their controller could not be started, reached or replaced."""


class SessionError(NbddpError):
    """A detached session could not be detached, found or attached (``nbddp.attach``, ``nbddp.sessions``)."""


class SlurmError(ClusterError):
    """Slurm refused, held, cancelled or ended the job holding the workers, or cannot be used from here.

    Attributes:
        job_id: the Slurm job's id ("" when no job was submitted).
        state: Slurm's state of the job when the error was raised (``"CANCELLED"``, ``"TIMEOUT"``,
            ``"NODE_FAIL"``, ``"PENDING"``...; "" when no job was submitted).
    """

    def __init__(self, message: str, job_id: str = "", state: str = ""):
        super().__init__(message)
        self.job_id = job_id
        self.state = state


class Recorded(Protocol):
    """What ``FitInterrupted`` reads of a fit's ``History`` (``nbddp/fit/history.py``, above this layer)."""

    steps: list[dict[str, Any]]


class FitInterrupted(KeyboardInterrupt):
    """Kernel > Interrupt stopped a blocking ``dist_fit``; raised after the clean stop, so that Run All stops.

    Every rank stopped at the same step and the model holds that step's
    weights, as before; the cell does not go on as if the fit had finished
    (Keras and HF re-raise too). ``history`` is the fit's ``History``, also
    ``nbddp.last_history()``.
    """

    def __init__(self, history: Recorded):
        step = history.steps[-1]["step"] if history.steps else 0
        super().__init__(f"dist_fit was interrupted (Kernel > Interrupt): every rank stopped at step {step} and the "
                         "model holds that step's weights; the History is e.history (and nbddp.last_history())")
        self.history = history


class ShippingError(NbddpError, TypeError):
    """An object could not be pickled for the workers (a ``TypeError`` too, as pickle's own errors are)."""


class UntrustedCheckpointError(NbddpError, ValueError):
    """A checkpoint holds more than tensors and plain data, and loading it in full could run code from the file.

    Raised before anything of it is built (``worker/checkpoints/trust.py``); the message names the file and the
    option that trusts it (``trust_checkpoint=True``). A ``ValueError`` too, as a bad ``resume=`` path is.

    Attributes:
        path: the file (or sharded checkpoint folder) refused.
    """

    def __init__(self, message: str, path: str = ""):
        super().__init__(message)
        self.path = path


class TopologyError(NbddpError, ValueError):
    """The engines cannot form the requested process group (a ``ValueError`` too)."""


@dataclass
class RankFailure:
    """One rank's failure, as the kernel learnt it."""

    rank: int
    exc_type: str
    message: str
    remote_traceback: str = ""
    pid: int | None = None
    host: str = ""
    engine_id: int | None = None  # the ipyparallel engine that held the rank

    @property
    def engine_info(self) -> dict[str, Any]:
        """As ipyparallel's ``RemoteError.engine_info``, plus the rank: ``engine_id``, ``pid``, ``host``, ``rank``,
        ``method`` (always ``"apply"``: every task is a function applied)."""
        return {"engine_id": self.engine_id, "pid": self.pid, "host": self.host, "rank": self.rank, "method": "apply"}

    def as_ipyparallel(self) -> tuple[str, str, str, dict[str, Any]]:
        """``(ename, evalue, traceback, engine_info)``: one entry of a ``CompositeError.elist``."""
        return self.exc_type, self.message, self.remote_traceback, self.engine_info

    def headline(self) -> str:
        where = f"rank {self.rank}" + (f" (pid {self.pid}" + (f" on {self.host})" if self.host else ")") if self.pid else "")
        return f"{where}: {self.exc_type}: {self.message}"


class WorkerError(NbddpError, RemoteError):
    """A rank failed. ``str()`` names the rank, the exception type and message.

    Also an ipyparallel ``RemoteError``: ``except ipyparallel.error.RemoteError``
    catches it, as it catches a failing ``%px`` cell.

    Attributes:
        rank: the rank that failed first.
        exc_type: the name of the original exception's type (``ename``).
        message: the original exception's message (``evalue``).
        remote_traceback: the traceback as the worker printed it (``traceback``).
        pid: the failed rank's worker process.
        others: further ranks that failed in the same call (listed, not raised).
        ename, evalue, traceback: ipyparallel's names for the first rank's
            failure (its type's name, its message, its traceback).
        engine_info: ``{"engine_id", "pid", "host", "rank", "method"}`` of that rank.
        elist: every failed rank, the first one first, as ``CompositeError.elist``:
            ``(ename, evalue, traceback, engine_info)`` each.
    """

    def __init__(self, failure: RankFailure, others: list[RankFailure] | None = None, note: str = ""):
        self.failure = failure
        self.rank = failure.rank
        self.exc_type = failure.exc_type
        self.message = failure.message
        self.remote_traceback = failure.remote_traceback
        self.pid = failure.pid
        self.others = list(others or [])
        self.note = note
        self.ename, self.evalue, self.traceback, self.engine_info = failure.as_ipyparallel()
        Exception.__init__(self, self._summary())

    @property
    def elist(self) -> list[tuple[str, str, str, dict[str, Any]]]:
        return [f.as_ipyparallel() for f in (self.failure, *self.others)]

    def __str__(self) -> str:  # nbddp's summary, not RemoteError's "[engine:method] ename: evalue"
        return BaseException.__str__(self)

    def __repr__(self) -> str:
        return BaseException.__repr__(self)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled with what ``__init__`` takes: a detached fit's caretaker hands the error to the next kernel."""
        return type(self), (self.failure, self.others, self.note)

    def render_traceback(self, excid: int | None = None) -> list[str]:
        """ipyparallel's name for the lines ``_render_traceback_`` gives IPython."""
        return self._render_traceback_()

    def with_note(self, text: str) -> WorkerError:
        """Add a line to the message (an elastic fit says what it retried); returns the same error."""
        self.note = "\n".join(x for x in (self.note, text) if x)
        self.args = (self._summary(),)
        return self

    def _summary(self) -> str:
        lines = [f"{self.failure.headline()}"]
        for other in self.others:
            lines.append(f"  also failed: {other.headline()}")
        if self.note:
            lines.append(self.note)
        return "\n".join(lines)

    def _render_traceback_(self) -> list[str]:
        """IPython shows this instead of the kernel-side traceback."""
        red, reset = "\x1b[0;31m", "\x1b[0m"
        out = [f"{red}{type(self).__name__}{reset}: {self.failure.headline()}"]
        if self.remote_traceback:
            out.append(f"--- remote traceback (rank {self.rank}) ---")
            out.extend(self.remote_traceback.rstrip("\n").splitlines())
        for other in self.others:
            out.append(f"--- also failed: {other.headline()}")
        if self.note:
            out.append(self.note)
        return out


class WorkerDied(WorkerError):
    """A worker process died (killed, segfault, out of memory).

    Attributes, besides ``WorkerError``'s:
        pid: the dead process's pid.
        how: how it died, e.g. ``"killed by signal 9 (SIGKILL)"``.
        log_tail: the last lines of its engine log, when they could be read.
    """

    def __init__(self, failure: RankFailure, how: str, log_tail: str = "", others: list[RankFailure] | None = None,
                 note: str = ""):
        self.how = how
        self.log_tail = log_tail
        super().__init__(failure, others, note)

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.failure, self.how, self.log_tail, self.others, self.note)

    def _summary(self) -> str:
        text = super()._summary()
        tail = [line for line in self.log_tail.splitlines() if line.strip()][-5:]
        if tail:
            text += f"\nlast lines of rank {self.rank}'s engine log:\n" + "\n".join(f"  {line}" for line in tail)
        return text

    def _render_traceback_(self) -> list[str]:
        out = super()._render_traceback_()
        if self.log_tail:
            out.append(f"--- last lines of rank {self.rank}'s engine log ---")
            out.extend(self.log_tail.rstrip("\n").splitlines())
        return out


class WorkerStalled(WorkerError):
    """A rank made no progress for ``stall_timeout`` seconds (blocked I/O, an endless loop, a skipped collective).

    Attributes, besides ``WorkerError``'s (``rank`` is the first stalled rank):
        ranks: every stalled rank.
        stacks: rank -> that rank's Python stack when the fit was failed (innermost frame last), for the
            stalled ranks and for the ranks that were waiting for them.
    """

    def __init__(self, failure: RankFailure, ranks: list[int], stacks: dict[int, str],
                 others: list[RankFailure] | None = None, note: str = ""):
        self.ranks = list(ranks)
        self.stacks = dict(stacks)
        super().__init__(failure, others, note)

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.failure, self.ranks, self.stacks, self.others, self.note)

    def _summary(self) -> str:
        text = super()._summary()
        inner = innermost_frames(self.stacks.get(self.rank, ""))
        if inner:
            text += f"\nrank {self.rank} is here (innermost frames):\n{inner}"
        return text

    def _render_traceback_(self) -> list[str]:
        red, reset = "\x1b[0;31m", "\x1b[0m"
        out = [f"{red}{type(self).__name__}{reset}: {self.failure.headline()}"]
        for other in self.others:
            out.append(f"  also stalled: {other.headline()}")
        for rank in sorted(self.stacks, key=lambda r: (r not in self.ranks, r)):
            label = "stalled" if rank in self.ranks else "waiting"
            out.append(f"--- stack of rank {rank} ({label}) ---")
            out.extend((self.stacks[rank] or "  (no Python stack came back)").rstrip("\n").splitlines())
        if self.note:
            out.append(self.note)
        return out

