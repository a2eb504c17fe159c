"""``nbddp.debug()`` and ``%ddp debug``: pdb on a failed rank, or on a rank paused at ``breakpoint()``.

Design (issue "debug"): a rank in pdb owns a line to the kernel
(``worker/debugging/rank_pdb.py``, ``rank_lines.py``), and the notebook reads the person's
commands with ``input()``, which ipykernel turns into an input request in
the running cell. Two cases, one conversation (``conversation.py``'s ``Conversation``):

* **Breakpoints.** The rank connects from inside its task. During a blocking
  fit, cell or call, the cell that waits (``waiting.wait_interruptibly``,
  ``nbddp.execution.calls.RankCall.wait``) calls ``attend`` on every tick and the prompt opens
  right there. With ``block=False`` the live view says "rank 1 paused at
  file:line, ``%ddp debug 1`` to attach", and ``nbddp.debug()`` in any cell
  attaches. Kernel > Interrupt at the prompt lets every paused rank go on and
  stops the work as an interrupt always does. Without a person to type
  (nbclient without ``allow_stdin``, a script without a terminal), each
  breakpoint is reported with its place and the rank goes on: nothing waits
  forever.
* **Post-mortems.** After a ``WorkerError`` the failing rank keeps its
  exception (``worker/debugging/postmortem.py``) and is idle; ``debug()`` starts a small
  task there that connects like a breakpoint, on the failing frame.

Why a socket and not ipyparallel's own messages: an engine runs tasks in its
main thread, one at a time, so a rank paused inside a fit can take no task;
the loopback line with a per-session token needs no change to the engines.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from nbddp.debugging.contracts import DebuggedSession
from nbddp.debugging.conversation import Conversation, Interactive, NoPrompt, Scripted
from nbddp.debugging.prompt import waiting_note
from nbddp.protocol.errors import NothingToDebug
from nbddp.shipping.source_lines import describe_where
from nbddp.debugging.rank_lines import DebugBoard
from nbddp.execution.contracts import SessionLike
from nbddp.execution.send import to_engine, to_ranks
from nbddp.protocol.messages import PostMortemFailure
from nbddp.protocol.placement import Placement

if TYPE_CHECKING:
    from IPython.lib.pretty import RepresentationPrinter
    from ipyparallel import AsyncResult

CONNECT_S = 10.0  # post-mortem tasks have this long to connect
END_S = 10.0


class Transcript(str):
    """What a debugger session showed, as text (its repr is the text itself, for notebooks)."""

    def __repr__(self) -> str:
        return str(self)

    def _repr_pretty_(self, p: RepresentationPrinter, cycle: bool) -> None:
        p.text(str(self))


def check_commands(commands: list[str] | None) -> list[str] | None:
    if commands is None:
        return None
    if isinstance(commands, str) or not isinstance(commands, (list, tuple)) \
            or not all(isinstance(c, str) for c in commands):
        raise TypeError(f"debug(commands=...) takes a list of pdb command strings, e.g. commands=['p x', 'c']; "
                        f"got {type(commands).__name__} {commands!r}")
    return list(commands)


def debug(s: DebuggedSession, rank: int | None = None, commands: list[str] | None = None) -> Transcript | None:
    """``nbddp.debug`` on the session ``s`` (``api.debug`` documents the commands and the errors)."""
    commands = check_commands(commands)
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        raise TypeError(f"debug(rank=...) takes a rank number, e.g. debug(1); got {type(rank).__name__} {rank!r}")
    if not s.started:
        raise NothingToDebug("nothing to debug: no workers are running (start them with nbddp.start())")
    board = s.debugger
    lines = board.poll()
    if not lines and not s.busy:
        s.wait_healed(raise_error=False)  # ranks killed after the failure are being replaced: ask the new set
    if rank is not None and not 0 <= rank < s.world_size:
        raise ValueError(f"no rank {rank}: the workers have ranks 0..{s.world_size - 1}. {what_exists(s)}")
    started: dict[int, AsyncResult] = {}
    if not lines:
        if s.busy:
            raise NothingToDebug(f"nothing to debug: {s.running.describe()} is running and no rank is paused at "
                                 "breakpoint(); put breakpoint() in your code, or wait for a failure")
        with s.lock:
            s.ensure_ready()
            started = start_post_mortems(s, rank)
    elif rank is not None and rank not in [ln.rank for ln in lines]:
        raise ValueError(f"rank {rank} is not in the debugger. {what_exists(s)}")
    reader = Scripted(commands) if commands is not None else Interactive()
    convo = Conversation(board, reader, echo=commands is None, note=waiting_note(s))
    try:
        convo.run(only=rank)
    except NoPrompt as exc:
        raise NoPrompt(f"no prompt can open here ({exc}); pass the commands instead: "
                       "nbddp.debug(commands=['w', 'p x'])") from None
    finally:
        end_post_mortems(board, started)
    return Transcript("".join(convo.text)) if commands is not None else None


def what_exists(session: DebuggedSession) -> str:
    """One sentence: the ranks paused or keeping a failure, for error messages."""
    paused = [ln.describe() for ln in session.debugger.poll()]
    if paused:
        return "In the debugger: " + "; ".join(paused) + "."
    if session.busy:
        return f"{session.running.describe()} is running; no rank is paused at breakpoint()."
    failures = post_mortem_failures(session)
    if failures:
        return "Failures kept: " + "; ".join(f"rank {k.rank}: {k.exc_type} at {describe_where(k.where)}"
                                             for k, _ in failures.values()) + "."
    return ("No rank is paused at breakpoint() and none keeps a failure (a rank keeps the failure of a WorkerError "
            "until its next fit).")


def post_mortem_failures(session: SessionLike) -> dict[int, tuple[PostMortemFailure, Placement]]:
    """rank (as it failed) -> (a ``PostMortemFailure``, the placement that holds it now), for every idle rank.

    The failures are ``nbddp.protocol.messages.PostMortemFailure`` records.
    """
    from nbddp.worker.tasks.debugging import post_mortem_failure

    ars = {p: to_engine(session.client, p.engine_id, post_mortem_failure) for p in session.placements}
    found: dict[int, tuple[PostMortemFailure, Placement]] = {}
    for p, ar in ars.items():
        try:
            info = ar.get(timeout=5.0)
        except Exception:  # noqa: BLE001 - a rank that cannot answer keeps nothing we can reach
            continue
        if info is not None:
            found[info.rank] = (info, p)
    return dict(sorted(found.items()))


def start_post_mortems(session: DebuggedSession, rank: int | None) -> dict[int, AsyncResult]:
    """Open pdb on the failure each chosen rank keeps; rank -> its task's AsyncResult."""
    from nbddp.worker.tasks.debugging import post_mortem_task

    failures = post_mortem_failures(session)
    if not failures:
        raise NothingToDebug(f"nothing to debug: {what_exists(session)} Put breakpoint() in your code, or run the "
                             "failing call again.")
    if rank is not None and rank not in failures:
        raise ValueError(f"rank {rank} keeps no failure to debug. {what_exists(session)}")
    chosen = [rank] if rank is not None else sorted(failures)
    ars = {r: to_engine(session.client, failures[r][1].engine_id, post_mortem_task) for r in chosen}
    deadline = time.monotonic() + CONNECT_S
    while time.monotonic() < deadline:
        here = {ln.rank for ln in session.debugger.poll()}
        if all(r in here or ars[r].ready() for r in chosen):
            break
        time.sleep(0.02)
    return ars


def end_post_mortems(board: DebugBoard, started: dict[int, AsyncResult]) -> None:
    """The person is done: post-mortems still open end (the failures stay kept)."""
    if not started:
        return
    for line in board.poll():
        if line.kind == "post-mortem" and line.rank in started:
            line.release("the debugger session ended")
    for ar in started.values():
        try:
            ar.get(timeout=END_S)
        except Exception:  # noqa: BLE001 - its engine failed: nothing more to end
            pass
    board.poll()


def clear(s: DebuggedSession) -> str:
    """``%ddp debug --clear`` on the session ``s``: every rank drops the failure it keeps (and the memory its frames hold)."""
    from nbddp.worker.tasks.debugging import clear_task

    if not s.started:
        return "nbddp: no workers are running: nothing to clear"
    if s.busy:
        return f"nbddp: {s.running.describe()} is running; its ranks dropped their failures when it started"
    s.wait_healed(raise_error=False)
    with s.lock:
        s.ensure_ready()
        ars = to_ranks(s.client, s.placements, clear_task, lambda p: ())
    cleared = sorted(r for r in (ar.get(timeout=10.0) for ar in ars.values()) if r is not None)
    if not cleared:
        return "nbddp: no rank kept a failure"
    return f"nbddp: dropped the failure kept on rank {', '.join(map(str, cleared))}"
