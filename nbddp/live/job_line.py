"""The Slurm job's line while it waits and starts: "Slurm job 42: PENDING (Resources), 0:12".

``SlurmJobs.wait_started`` (``cluster/slurm/watch.py``) says what the job is
doing; this draws it, in the cell (a display updated in place), on a
terminal (``\\r``), or in a log (a new line only when the words change). The
session hands one to ``cluster/`` (``Workers.start``), which never imports
``live/`` itself.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, TextIO

from nbddp.cluster.slurm.queue import JobState
from nbddp.cluster.slurm.watch import fmt_clock
from nbddp.live import in_notebook_kernel

if TYPE_CHECKING:
    from IPython.display import DisplayHandle


class JobLine:
    """One line about the job, kept current: a display updated in place in Jupyter, ``\\r`` on a terminal.

    Elsewhere (a log, a pipe) a new line is written only when what it says changes, not every second.
    """

    def __init__(self, every: float = 1.0, stream: TextIO | None = None):
        self.every = every
        self.stream = stream or sys.stdout
        self._kernel = stream is None and in_notebook_kernel()
        self._tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._handle: DisplayHandle | None = None
        self._said = ""
        self._shown_at = float("-inf")

    def show(self, job: JobState, waited: float, have: int, n: int, final: str = "") -> None:
        words = job.headline() + (f", {have} of {n} engines registered" if job.running or final == "started" else "")
        if final and final != "started":
            words = f"Slurm job {job.job_id}: {final}"
        now = time.monotonic()
        if not final and words == self._said and now - self._shown_at < self.every:
            return
        changed, self._said, self._shown_at = words != self._said, words, now
        self._write(f"{words}, {fmt_clock(waited)}", changed, bool(final))

    def _write(self, text: str, changed: bool, final: bool) -> None:
        if self._kernel:
            from IPython.display import display

            data = {"text/plain": text}
            if self._handle is None:
                self._handle = display(data, raw=True, display_id=True)
            else:
                self._handle.update(data, raw=True)
        elif self._tty:
            self.stream.write("\r" + text + "\x1b[K" + ("\n" if final else ""))
        elif changed or final:
            self.stream.write(text + "\n")
        self.stream.flush()
