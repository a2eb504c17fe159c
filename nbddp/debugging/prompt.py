"""The prompt that opens in the waiting cell when a rank stops at ``breakpoint()``.

A blocking fit, cell or call waits in the kernel (``nbddp/execution/work.py``,
``nbddp/execution/calls.py``); on every tick it calls ``attend`` (through
``Session.attend``), which opens the
conversation with the paused ranks right there, or, with nobody to type,
tells each rank where it stopped and lets it go on.
"""

from __future__ import annotations

import threading
import time
from nbddp.debugging.conversation import Conversation, Interactive, NoPrompt
from nbddp.debugging.rank_lines import DebugBoard, RankLine
from nbddp.execution.contracts import SessionLike, WorkLike
from nbddp.shipping.source_lines import describe_where

SETTLE_S = 0.3  # ranks that stop at one breakpoint together are listed together


def waiting_note(session: SessionLike) -> str:
    """How long the other ranks can wait for a paused one: their collectives fail after the group's timeout."""
    timeout = getattr(session.options, "timeout", None)
    if not timeout:
        return ""
    return (f"nbddp: the other ranks wait for it in their collectives, for up to {timeout:.0f} s (the process-group "
            "timeout; nbddp.start(timeout=...) sets it)\n")


def attend(work: WorkLike) -> None:
    """From the cell that waits for ``work``: open the prompt for its ranks paused at ``breakpoint()``.

    Without a person to type, each paused rank is told where it stopped and goes on (and so does any
    later breakpoint of this work). Kernel > Interrupt at the prompt lets the paused ranks go on, then
    raises, so the waiter stops the work as for any interrupt.
    """
    session = getattr(work, "session", None)  # (a Work's; the board is the session's DebugBoard)
    board = getattr(session, "debugger", None)
    if session is None or board is None or threading.current_thread() is not threading.main_thread():
        return
    lines = board.poll()
    for line in board.take_notes():
        _say_released(line, board.auto_release[1] if board.auto_release else "")
    if not [ln for ln in lines if ln.kind == "breakpoint"] or session.running is not work:
        return
    _settle(board)
    reader = Interactive()
    convo = Conversation(board, reader, echo=True, note=waiting_note(session))
    try:
        reader.check()
        convo.run()
    except NoPrompt as exc:
        reason = f"no prompt can open here: {exc}"
        board.auto_release = (work, reason)
        for line in board.poll():
            if line.kind == "breakpoint":
                _say_released(line, reason)
                line.release(reason)
    except BaseException:
        board.let_go(work, "the work was interrupted at the debugger prompt")
        raise


def _settle(board: DebugBoard) -> None:
    """Ranks that reach one breakpoint together arrive within moments: wait a little for the others."""
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline:
        time.sleep(0.02)
        board.poll()


def _say_released(line: RankLine, reason: str) -> None:
    where = describe_where(line.where) + (f" in {line.function}" if line.function else "")
    print(f"nbddp: rank {line.rank} stopped at breakpoint() at {where}, but {reason}; it continues", flush=True)
