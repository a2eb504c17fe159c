"""The trial groups of a sweep, opened on every rank and closed again, in the kernel's terms.

``open_trial_groups`` is one task on every rank (the same fault contract as a
``%%ddp`` cell, a rank that fails is raised here, before any trial starts);
it returns the token the trials name their group by. After a worker was
replaced the sweep opens them again under a new token: the old groups went
with the old process-group generation.
"""

from __future__ import annotations

import uuid

from nbddp.execution.calls import RankCall
from nbddp.execution.contracts import SessionLike
from nbddp.execution.send import to_ranks

CLOSE_TIMEOUT_S = 10.0


def open_trial_groups(s: SessionLike, groups: list[list[int]]) -> str:
    """One process group per entry of ``groups`` on every rank; return their token. Takes the session's lock."""
    from nbddp.worker.tasks.sweep import open_groups

    token = f"sweep-{uuid.uuid4().hex[:12]}"
    call = RankCall(s, "nbddp.sweep (opening the trial groups)")
    with s.lock:
        s.ensure_ready()
        call.launch(open_groups, lambda p: (token, s.generation, groups))
    call.wait()
    return token


def close_trial_groups(s: SessionLike, token: str) -> None:
    """Every rank destroys the groups of ``token`` (nothing to wait for on a rank that was replaced)."""
    from nbddp.worker.tasks.sweep import close_groups

    try:
        for ar in to_ranks(s.client, s.placements, close_groups, lambda p: (token,)).values():
            ar.get(CLOSE_TIMEOUT_S)
    except Exception:  # noqa: BLE001 - a killed or replaced engine holds no group to close
        pass
