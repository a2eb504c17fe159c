"""What the kernel's debugging commands run on a rank: ``%ddp debug``, ``%ddp stacks`` and the debugger's address.

The machinery is ``worker/debugging/`` (the rank's pdb, the kept failure)
and ``worker/engine/heartbeat.py`` (stack dumps); these are the entry points
the kernel sends, each one task on an idle rank.
"""

from __future__ import annotations

from nbddp.protocol.messages import PostMortemFailure, StackDump
from nbddp.worker.debugging.postmortem import clear
from nbddp.worker.debugging.rank_pdb import Channel, RankPdb
from nbddp.worker.debugging.rank_pdb import set_address as set_debugger_address
from nbddp.worker.engine.rank_state import STATE


def post_mortem_failure() -> PostMortemFailure | None:
    """The failure this rank keeps for a post-mortem, for the kernel's list (None: nothing)."""
    f = STATE.failure
    if f is None:
        return None
    current = STATE.placement.rank if STATE.placement is not None else -1
    return PostMortemFailure(rank=f.rank, current_rank=current, generation=f.generation, exc_type=type(f.exc).__name__,
                       message=str(f.exc)[:300], where=f.where, function=f.function)


def post_mortem_task() -> str:
    """pdb on the kept failure's innermost frame, over the kernel's line; returns how it ended."""
    f = STATE.failure
    if f is None:
        return "nothing kept"
    summary = f"{type(f.exc).__name__}: {str(f.exc)[:300]}"
    channel = Channel.open("post-mortem", f.where, f.function, summary, rank=f.rank)
    if isinstance(channel, str):
        return channel
    debugger = RankPdb(channel, "post-mortem", f.where)
    try:
        debugger.reset()
        debugger.interaction(None, f.exc.__traceback__)
    finally:
        debugger.finish("post-mortem ended")
        debugger.forget()
    return "ended"


def clear_task() -> int | None:
    """``%ddp debug --clear`` on this rank: the rank whose failure was dropped, or None."""
    # only the rank is kept here: a local holding the failure itself would keep it alive while clear() collects it
    rank = STATE.failure.rank if STATE.failure is not None else None
    clear()
    return rank


def idle_stack() -> StackDump:
    """What an engine with no task running reports to ``nbddp.stacks()``."""
    rank = STATE.placement.rank if STATE.placement is not None else -1
    return StackDump(rank=rank, busy=False, text="", source="idle")


__all__ = ["post_mortem_failure", "post_mortem_task", "clear_task", "idle_stack", "set_debugger_address"]
