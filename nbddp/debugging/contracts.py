"""What the debugger needs of the session: the ``SessionLike`` the execution package sees, and its board.

``nbddp.debug()`` and ``%ddp debug`` act on the session (``session/session.py``'s
``Session``), which imports this package (its ``DebugBoard``), so the session
is a Protocol here: ``SessionLike`` and the board of the ranks in pdb, whether
it started workers and whether work holds them.
"""

from __future__ import annotations

from typing import Protocol

from nbddp.debugging.rank_lines import DebugBoard
from nbddp.execution.contracts import SessionLike


class DebuggedSession(SessionLike, Protocol):
    """The session, as ``nbddp.debug()`` sees it."""

    @property
    def debugger(self) -> DebugBoard: ...

    @property
    def started(self) -> bool: ...

    @property
    def busy(self) -> bool: ...
