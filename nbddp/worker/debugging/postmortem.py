"""The failure a rank keeps for a post-mortem, and the task that opens pdb on it.

When the person's code raises on a rank (inside any task: a fit, a cell,
``run``, a script), the rank keeps the exception and its traceback, so
``%ddp debug`` can open pdb on the failing frame afterwards, as
``%debug`` does in a local notebook. The frames hold their locals (a model,
its activations), so they are dropped when the rank next trains (a fit, a
batch-size trial, a scaling report: ``user_task(trains=True)``), or by
``%ddp debug --clear``. A rank that failed only because a peer did
(``PeerFailed``), an interrupt and a debugger ``q`` keep nothing.

The rank is idle after a failure, so the post-mortem is an ordinary task:
it connects to the kernel's debug listener like a breakpoint does
(``rank_pdb.py``) and returns when the person leaves pdb.
"""

from __future__ import annotations

from dataclasses import dataclass

from nbddp.worker.debugging.rank_pdb import DebuggerQuit
from nbddp.worker.memory.release import drop_failed_frames
from nbddp.worker.engine.rank_state import STATE

NOT_KEPT = ("PeerFailed", "BdbQuit")


@dataclass
class Failure:
    """An exception kept on this rank, with the rank it had when it failed."""

    exc: BaseException
    rank: int
    generation: int
    where: str
    function: str


def keep(exc: BaseException) -> None:
    """Keep ``exc`` for a post-mortem (replacing an older one), unless it is no failure of the person's code."""
    if isinstance(exc, (KeyboardInterrupt, SystemExit, DebuggerQuit)) or type(exc).__name__ in NOT_KEPT:
        return
    tb = exc.__traceback__
    if tb is None:
        return
    while tb.tb_next is not None:
        tb = tb.tb_next
    where = f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}"
    function = tb.tb_frame.f_code.co_name
    rank = STATE.placement.rank if STATE.placement is not None else -1
    STATE.failure = Failure(exc, rank, STATE.generation, where, function)


def clear() -> bool:
    """Drop the kept failure and the memory its frames hold; whether there was one."""
    if STATE.failure is None:
        return False
    STATE.failure = None
    # the engine's shell may keep the same frames; they hold the DDP module -> old process group cycle, frozen
    # with the engine's objects when a task began (worker/memory/release.py): only a full collection finds it
    drop_failed_frames(everything=True)
    return True
