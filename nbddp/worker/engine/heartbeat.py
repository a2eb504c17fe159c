"""A rank's heartbeat, and its stack on request, even while it is stuck.

The training loop marks where it is (``BEAT.mark("forward")``: a few
attribute writes, no collective, no I/O). While a task runs, a ``Monitor``
thread publishes that position to the kernel about once a second
(``messages.Beat``); once the position stops changing it attaches the main
thread's Python stack, read with ``sys._current_frames`` (possible while the
main thread waits in a gloo/NCCL collective, which releases the GIL).

Code that marks nothing (a ``%%ddp`` cell, ``nbddp.run``, a script) is
sampled instead: the monitor counts a change of the main thread's stack as
progress, and reports the phase ``"collective"`` while the innermost frame is
in ``torch.distributed``.

For ``nbddp.stacks()`` the kernel sends SIGUSR1. ``faulthandler`` answers it
in C, even when the main thread holds the GIL in C code: it writes every
thread's stack to this rank's stack file, whose first line names the main
thread. The monitor notices the file grow and publishes the main thread's
stack as well, for ranks on other hosts (whose file the kernel cannot read).

The person's code can take that handler away without meaning to: code that
saves "the previous" handlers with ``signal.getsignal`` and puts them back
(Lightning's ``Trainer`` does it for every signal as it ends) sees SIG_DFL
for SIGUSR1, faulthandler's handler being invisible to Python, and sets
SIG_DFL, whose action is to end the process. So the monitor registers the
handler again as each task starts and within a beat whenever it is gone
(``keep_stack_dumps``: a look at ``/proc``, about 50 us); the kernel does not
signal a rank on its host that does not catch SIGUSR1
(``nbddp/execution/rank_stacks.py``).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
import faulthandler
import os
import sys
import threading
import time
import traceback
from types import FrameType
from typing import Any, Iterator

from nbddp.protocol.host import catches_signal
from nbddp.protocol.messages import ENGINE_FRAME, MAIN_THREAD_HEADER, PUBLISH_KEYS, STACK_SIGNAL, Beat, StackDump

BEAT_S = 1.0
POLL_S = 0.2  # how often the monitor looks at the stack file
MAX_FRAMES = 16
SAMPLED_PHASES = ("cell", "call", "script", "push")  # tasks whose code marks nothing: the stack is sampled


class Heartbeat:
    """Where the main thread is: written by it, read by the monitor thread (plain attributes, no lock)."""

    def __init__(self) -> None:
        self.reset("setup")

    def reset(self, phase: str) -> None:
        self.progress = 0
        self.phase = phase
        self.step = 0
        self.micro = 0
        self.step_time_s = 0.0
        self.changed = time.monotonic()
        self._last_step: float | None = None  # set at the first micro-batch: set-up is not a step
        self.paused_at = ""  # file:line of a debugger prompt holding the rank (worker/debugging/rank_pdb.py)
        self._before_pause = phase
        # inside a step whose communication nbddp does not mark (a pipeline schedule): the monitor shows a
        # rank blocked in torch.distributed as "collective", i.e. waiting for a peer, not stalled itself
        self.watch_waits = False
        self.marked = phase
        # the fit's time split: seconds per marked phase, from ``time_phases`` on (None: not timed)
        self.spent: dict[str, float] = defaultdict(float)
        self._since: float | None = None

    def pause(self, where: str) -> None:
        """A debugger prompt holds the main thread: the phase says ``paused`` until ``resume``."""
        if not self.paused_at:
            self._before_pause = self.phase
        self.paused_at = where
        self.mark("paused")

    def resume(self) -> None:
        if self.paused_at:
            self.paused_at = ""
            self.mark(self._before_pause)

    def mark(self, phase: str) -> None:
        now = time.monotonic()
        if self._since is not None:  # one clock read serves both: the split costs a dict update per mark
            self.spent[self.marked] += now - self._since
            self._since = now
        self.phase = self.marked = phase
        self.progress += 1
        self.changed = now

    def time_phases(self, phase: str) -> None:
        """Start the time split: from now on each mark closes the phase before it (``phase_seconds``)."""
        self.spent = defaultdict(float)
        self._since = None
        self.mark(phase)
        self._since = self.changed

    def phase_seconds(self, stop: bool = False) -> dict[str, float]:
        """Seconds per phase since ``time_phases``, the phase running now included; ``stop`` ends the timing."""
        out = dict(self.spent)
        if self._since is not None:
            now = time.monotonic()
            out[self.marked] = out.get(self.marked, 0.0) + now - self._since
            if stop:
                self.spent, self._since = defaultdict(float, out), None
        return out

    def micro_batch(self) -> None:
        """A micro-batch is about to be fetched."""
        self.micro += 1
        if self._last_step is None:
            self._last_step = time.monotonic()
        self.mark("data")

    def step_done(self, step: int) -> None:
        now = time.monotonic()
        took = now - (self._last_step if self._last_step is not None else now)
        self._last_step = now
        self.step = step
        self.step_time_s = took if not self.step_time_s else 0.8 * self.step_time_s + 0.2 * took
        self.mark("optimizer")


BEAT = Heartbeat()


def user_frames(frame: FrameType | None) -> list[FrameType]:
    """The frames of the running task, innermost first (the engine's own frames left out)."""
    frames: list[FrameType] = []
    while frame is not None:
        if frame.f_code.co_filename.endswith(ENGINE_FRAME):
            if frames and frames[-1].f_code.co_filename == "<string>":
                frames.pop()  # ipyparallel's one-line `<module>` that calls the task
            break
        frames.append(frame)
        frame = frame.f_back
    return frames


def main_frame() -> FrameType | None:
    ident = threading.main_thread().ident  # (None only before a thread starts: never the main thread's)
    return sys._current_frames().get(ident) if ident is not None else None


def main_thread_stack(limit: int = MAX_FRAMES) -> str:
    """The main thread's Python stack (the task's frames), innermost frame last."""
    frames = user_frames(main_frame())[:limit]
    summary = traceback.StackSummary.extract((f, f.f_lineno) for f in reversed(frames))
    return "".join(summary.format())


def stack_signature(frames: list[Any]) -> tuple:
    """What must change for sampled code to count as advancing: every frame, the innermost without its line."""
    if not frames:
        return ()
    inner, outer = frames[0], frames[1:]
    return ((inner.f_code.co_filename, inner.f_code.co_name),
            *((f.f_code.co_filename, f.f_code.co_name, f.f_lineno) for f in outer))


def in_collective(frames: list[Any]) -> bool:
    return bool(frames) and f"torch{os.sep}distributed{os.sep}" in frames[0].f_code.co_filename


def enable_stack_dumps(path: str) -> None:
    """Let SIGUSR1 write every thread's stack to ``path`` (appending), from C, without stopping the rank."""
    from nbddp.worker.engine.rank_state import STATE

    old = STATE.stack_file
    if old is not None and not old.closed and old.name == path and os.path.exists(path):
        return
    # owner-only: the stacks name the person's files and functions. fchmod too, for a file an older run made 0644
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.fchmod(fd, 0o600)
    f = os.fdopen(fd, "a", buffering=1)  # faulthandler keeps the descriptor: the file must stay open
    f.write(f"{MAIN_THREAD_HEADER} {threading.main_thread().ident:#x} {os.getpid()}\n")
    faulthandler.register(STACK_SIGNAL, file=f, all_threads=True, chain=False)
    STATE.stack_file = f
    if old is not None and not old.closed:
        old.close()


def keep_stack_dumps() -> None:
    """Register the SIGUSR1 handler again if it is gone (see the module docstring); a no-op while it is there.

    Only when /proc says it is gone: re-registering means unregistering first, and a SIGUSR1 that came in
    between would meet the default action, so where /proc cannot say (not Linux) nothing is done.
    """
    from nbddp.worker.engine.rank_state import STATE

    f = STATE.stack_file
    if f is not None and not f.closed and catches_signal(os.getpid(), STACK_SIGNAL) is False:
        faulthandler.unregister(STACK_SIGNAL)  # register() alone keeps its record and installs nothing
        faulthandler.register(STACK_SIGNAL, file=f, all_threads=True, chain=False)


class Monitor(threading.Thread):
    """Publishes this rank's heartbeat while a task runs, and its stack when asked."""

    def __init__(self, rank: int, publish: Any, stack_path: str | None, phase: str):
        super().__init__(name="nbddp-monitor", daemon=True)
        self.rank, self.publish, self.stack_path = rank, publish, stack_path
        self.sampled = phase in SAMPLED_PHASES
        self.task_phase = phase
        self.stopping = threading.Event()
        self.seq = 0
        self.stack_seq = 0
        self._signature: tuple | None = None
        self._stack_size = _size(stack_path)

    def run(self) -> None:
        keep_stack_dumps()  # an earlier task's code may have set SIGUSR1 back (here: 50 us off the task's path)
        next_beat = 0.0
        paused = ""
        while not self.stopping.wait(POLL_S):
            now = time.monotonic()
            size = _size(self.stack_path)
            if size > self._stack_size:
                self._stack_size = size
                self._send_stack()
            if now >= next_beat or BEAT.paused_at != paused:  # a pause is told at once: peers are not stalled
                next_beat = now + BEAT_S
                keep_stack_dumps()
                paused = BEAT.paused_at
                if self.sampled and not paused:
                    self._sample(now)
                elif BEAT.watch_waits:
                    self._see_waits()
                if BEAT.phase == "compiling":  # in Dynamo or Inductor: progress however long it takes
                    BEAT.progress += 1
                self._send_beat(now)

    def _sample(self, now: float) -> None:
        """Sampled code advances when its stack changes; it is in a collective when torch.distributed is innermost."""
        frames = user_frames(main_frame())
        signature = stack_signature(frames)
        phase = "collective" if in_collective(frames) else self.task_phase
        if signature != self._signature or phase != BEAT.phase:
            self._signature = signature
            BEAT.phase = phase
            BEAT.progress += 1
            BEAT.changed = now

    def _see_waits(self) -> None:
        """A rank blocked in a send or receive is waiting ("collective"); computing, it is in its marked phase.

        Not progress either way: a stage that waits for a stalled peer stays
        quiet, but ahead of it, so the peer is the one shown stalled.
        """
        BEAT.phase = "collective" if in_collective(user_frames(main_frame())) else BEAT.marked

    def _send_beat(self, now: float) -> None:
        idle = now - BEAT.changed
        self.seq += 1
        beat = Beat(rank=self.rank, seq=self.seq, progress=BEAT.progress, phase=BEAT.phase, step=BEAT.step,
                    micro=BEAT.micro, step_time_s=BEAT.step_time_s, idle_s=idle,
                    stack=main_thread_stack() if idle >= BEAT_S and not BEAT.paused_at else "",
                    paused_at=BEAT.paused_at)
        self._publish({PUBLISH_KEYS["beat"]: beat})

    def _send_stack(self) -> None:
        self.stack_seq += 1
        dump = StackDump(rank=self.rank, busy=True, text=main_thread_stack(), source="traceback")
        self._publish({PUBLISH_KEYS["stacks"]: (self.stack_seq, dump)})

    def _publish(self, data: dict[str, Any]) -> None:
        try:
            self.publish(data)
        except Exception:  # noqa: BLE001 - the kernel may have stopped listening; the rank goes on
            pass

    def stop(self) -> None:
        self.stopping.set()
        self.join(2.0)


def _size(path: str | None) -> int:
    if not path:
        return 0
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def engine_publisher() -> Any:
    """``publish_data`` inside an engine; None elsewhere (where it would create an IPython shell)."""
    try:
        from ipykernel.zmqshell import ZMQInteractiveShell
        from ipyparallel.datapub import publish_data
    except ImportError:  # pragma: no cover - both are dependencies
        return None
    if not ZMQInteractiveShell.initialized() or getattr(ZMQInteractiveShell.instance(), "data_pub", None) is None:
        return None
    return publish_data


def start_monitor(phase: str) -> Monitor | None:
    """Start publishing heartbeats for the task that begins now (inside an engine only)."""
    from nbddp.worker.engine.rank_state import STATE

    BEAT.reset("setup" if phase == "fit" else phase)
    publish = engine_publisher()
    if publish is None or STATE.placement is None:
        return None
    stack_path = STATE.stack_file.name if STATE.stack_file is not None else None
    monitor = Monitor(STATE.placement.rank, publish, stack_path, phase)
    monitor.start()
    return monitor


@contextlib.contextmanager
def monitoring(phase: str) -> Iterator[None]:
    """Heartbeats while the block runs; they end before it does (data published after a task ends is lost)."""
    monitor = start_monitor(phase)
    try:
        yield
    finally:
        if monitor is not None:
            monitor.stop()
