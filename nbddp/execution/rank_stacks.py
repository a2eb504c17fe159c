"""Asking ranks where they are: every rank's Python stack now, even inside a collective.

A rank busy with a task (a fit, a ``%%ddp`` cell, ``nbddp.run``, a script)
gets SIGUSR1: ``faulthandler``, registered when the rank joined its group
(``nbddp/worker/engine/heartbeat.py``), writes every thread's stack to the
rank's stack file from C, so it answers even while the rank waits in a
gloo/NCCL collective or runs C code. On the kernel's host the kernel reads
the file itself and picks the main thread (named on the file's first line);
for a rank on another host the signal goes through its nanny and the rank's
monitor thread publishes the stack (``messages.StackDump``). A rank with no
task running is asked with an ordinary task and reports ``idle``. A rank on
this host whose code set SIGUSR1 back to its default (which ends a process)
is not signalled until its monitor has put the handler back.

``nbddp.stacks()`` (``nbddp/monitor/stacks.py``) shows them; a stalled
fit's error carries them (``nbddp/execution/stalls.py``).
"""

from __future__ import annotations

import linecache
import os
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nbddp.execution.contracts import SessionLike
from nbddp.execution.send import to_ranks
from nbddp.protocol.host import catches_signal
from nbddp.protocol.messages import ENGINE_FRAME, MAIN_THREAD_HEADER, STACK_SIGNAL, published
from nbddp.protocol.placement import Placement
from nbddp.protocol.notes import shm_dir

if TYPE_CHECKING:
    from ipyparallel import AsyncResult

IDLE_ASK_S = 1.5  # an engine believed idle that does not answer a task this fast is busy after all
SETTLE_S = 0.1  # a dump is complete when the file stopped growing for this long
HANDLER_WAIT_S = 2.5  # a rank's monitor puts a lost SIGUSR1 handler back within a beat (heartbeat.BEAT_S, 1 s)

_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+)")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')
# what a signalled rank's answer is awaited from: ("file", its stack file, the size before) on the kernel's host,
# ("published", its task's AsyncResult, the last StackDump's seq) on another
Wait = tuple[str, Any, int]


@dataclass(frozen=True)
class RankStack:
    """One rank's stack: ``state`` is ``"busy"``, ``"idle"`` or ``"no answer"``; ``text`` innermost frame last."""

    rank: int
    host: str
    pid: int
    state: str
    text: str
    source: str  # "faulthandler" (read from the rank's stack file), "traceback" (published by the rank), "idle", ""

    @property
    def label(self) -> str:
        where = f"rank {self.rank} (pid {self.pid} on {self.host})"
        collective = self.state == "busy" and "distributed_c10d.py" in self.text.rsplit("File ", 1)[-1]
        return f"{where}: {self.state}" + (", waiting in a collective" if collective else "")


def stack_path(session: SessionLike, rank: int) -> str:
    """The stack file a rank's faulthandler writes to (named like every file of the session)."""
    return os.path.join(shm_dir(), f"{session.file_prefix}-w{rank}-stacks")


def collect(session: SessionLike, placements: list[Placement], busy: dict[int, AsyncResult], timeout: float,
            ranks: list[int] | None = None) -> tuple[list[RankStack], float]:
    """Ask ``ranks`` (all by default) for their stacks: busy ones by signal, the others by a task.

    Returns the stacks (one per rank asked) and the seconds it took.
    """
    t0 = time.monotonic()
    deadline = t0 + timeout
    chosen = [p for p in placements if ranks is None or p.rank in ranks]
    pending = _signal(session, [p for p in chosen if p.rank in busy], busy)
    answers, busy_after_all = _ask_idle(session, [p for p in chosen if p.rank not in busy],
                                        min(IDLE_ASK_S, timeout / 2))
    pending.update(_signal(session, [p for p in chosen if p.rank in busy_after_all], busy))
    while pending and time.monotonic() < deadline:
        for p in list(pending):
            entry = _answer(p, pending[p])
            if entry is not None:
                answers[p.rank] = entry
                del pending[p]
        time.sleep(0.02)
    for p in chosen:
        if p.rank not in answers:
            answers[p.rank] = RankStack(p.rank, p.host, p.pid, "no answer", "", "")
    return list(answers.values()), time.monotonic() - t0


def _ask_idle(session: SessionLike, placements: list[Placement],
              wait_s: float) -> tuple[dict[int, RankStack], set[int]]:
    """Idle engines answer a task at once; one that does not is busy with something after all."""
    from nbddp.worker.tasks.debugging import idle_stack

    ars = to_ranks(session.client, placements, idle_stack, lambda p: ())
    deadline = time.monotonic() + wait_s
    answers: dict[int, RankStack] = {}
    late: set[int] = set()
    for p in placements:
        try:
            ars[p.rank].get(timeout=max(0.01, deadline - time.monotonic()))
            answers[p.rank] = RankStack(p.rank, p.host, p.pid, "idle", "", "idle")
        except Exception:  # noqa: BLE001 - busy (or dead): signalled below
            late.add(p.rank)
    return answers, late


def _signal(session: SessionLike, placements: list[Placement], busy: dict[int, AsyncResult]) -> dict[Placement, Wait]:
    """SIGUSR1 to each engine; what to wait for: (file, offset) locally, (AsyncResult, last seq) remotely."""
    waits: dict[Placement, Wait] = {}
    remote = []
    patience = time.monotonic() + HANDLER_WAIT_S
    for p in placements:
        if p.local:
            if not _catches(p.pid, patience):
                continue  # SIGUSR1 would end it: "no answer" rather than a dead rank
            path = stack_path(session, p.rank)
            waits[p] = ("file", path, _size(path))
            try:
                os.kill(p.pid, STACK_SIGNAL)
            except OSError:
                waits.pop(p)
        else:
            ar = busy.get(p.rank)
            waits[p] = ("published", ar, _published_seq(ar))
            remote.append(p.engine_id)
    if remote:
        try:
            session.client.send_signal(STACK_SIGNAL.name, targets=remote, block=False)
        except Exception:  # noqa: BLE001 - unreachable: they count as "no answer"
            pass
    return waits


def _catches(pid: int, until: float) -> bool:
    """Whether the rank ``pid`` catches SIGUSR1, waiting until ``until`` for its monitor to put the handler back.

    The person's code may have set SIGUSR1 to its default, which ends the process (the worker's
    ``heartbeat.keep_stack_dumps`` says how); the rank's monitor registers it again within a beat. Where /proc
    cannot say (not Linux), the rank is signalled as before.
    """
    while True:
        caught = catches_signal(pid, STACK_SIGNAL)
        if caught is not False:
            return True
        if time.monotonic() >= until:
            return False
        time.sleep(0.02)


def _answer(p: Placement, wait: Wait) -> RankStack | None:
    """The rank's stack once it arrived, else None."""
    kind, where, mark = wait
    if kind == "file":
        text = read_dump(where, mark)
        if text is None:
            return None
        return RankStack(p.rank, p.host, p.pid, "busy", text, "faulthandler")
    sent = published(where, "stacks")
    if not sent or sent[0] <= mark:
        return None
    return RankStack(p.rank, p.host, p.pid, "busy", sent[1].text, "traceback")


def _published_seq(ar: AsyncResult | None) -> int:
    sent = published(ar, "stacks")
    return sent[0] if sent else 0


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def read_dump(path: str, offset: int) -> str | None:
    """The main thread's stack from the dump written after ``offset``, once complete; None before."""
    size = _size(path)
    if size <= offset:
        return None
    time.sleep(SETTLE_S)
    if _size(path) != size:
        return None  # still being written
    with open(path, encoding="utf-8", errors="replace") as f:
        content = f.read()
    headers = re.findall(rf"^{MAIN_THREAD_HEADER} (0x[0-9a-fA-F]+)", content[:offset], re.M)
    main = int(headers[-1], 16) if headers else None
    return main_thread_text(content[offset:], main)


def main_thread_text(dump: str, main_ident: int | None) -> str:
    """faulthandler's dump -> the main thread's task frames, formatted like ``traceback`` (innermost last)."""
    blocks: dict[int, list[tuple[str, int, str]]] = {}
    current = None
    for line in dump.splitlines():
        head = _THREAD.match(line)
        if head:
            current = int(head.group(2), 16)
            blocks[current] = []
            continue
        frame = _FRAME.match(line)
        if frame and current is not None:
            blocks[current].append((frame.group(1), int(frame.group(2)), frame.group(3).strip()))
    frames = blocks.get(main_ident) if main_ident is not None else None
    if frames is None:
        frames = next(iter(blocks.values()), [])
    return format_frames(task_frames(frames))


def task_frames(frames: list[tuple[str, int, str]]) -> list[tuple[str, int, str]]:
    """Innermost-first frames -> the task's own, innermost last (the engine's loop left out)."""
    mine: list[tuple[str, int, str]] = []
    for frame in frames:
        if frame[0].endswith(ENGINE_FRAME):
            if mine and mine[-1][0] == "<string>":
                mine.pop()
            break
        mine.append(frame)
    return list(reversed(mine))


def format_frames(frames: list[tuple[str, int, str]]) -> str:
    out = []
    for filename, lineno, name in frames:
        out.append(f'  File "{filename}", line {lineno}, in {name}\n')
        source = linecache.getline(filename, lineno).strip()
        if source:
            out.append(f"    {source}\n")
    return "".join(out)
