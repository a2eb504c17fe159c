"""What every test that shares the suite's workers may count on: the default start options.

A test that changes them (a new process-group timeout, a stall timeout) and fails before it puts them back
must not change what the next test sees; with pytest-xdist the next test is whichever file that process
runs next, so a leftover shows up as a failure somewhere else, in some runs only.
"""

from __future__ import annotations

from typing import Any


def reset_to_default_options(session: Any) -> None:
    """The default timeout (a new group on the same engines, only when it differs) and no stall timeout."""
    import nbddp
    from nbddp.session.session import DEFAULT_PG_TIMEOUT_S

    if session.options.timeout != DEFAULT_PG_TIMEOUT_S:
        nbddp.start(n=session.world_size, backend=session.backend, timeout=DEFAULT_PG_TIMEOUT_S)
    session.options.stall_timeout = None
