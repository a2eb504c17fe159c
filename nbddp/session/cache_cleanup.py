"""The session's Inductor cache on the other hosts, removed at ``nbddp.stop()``.

``dist_fit(compile=...)`` keeps Inductor's caches in one directory per session
and host (``protocol/compile_settings.py``). ``stop()`` removes the kernel's
host's directory itself, and the reaper does if the kernel dies; a directory
on another host (Slurm, SSH) can only be removed by a process there, so
``stop()`` asks one of that host's engines before stopping them.
"""

from __future__ import annotations

from nbddp.execution.contracts import SessionLike
from nbddp.execution.send import once_per_other_host

REMOTE_CLEANUP_S = 5.0  # stop() waits at most this long for the other hosts to remove their cache


def remove_remote_caches(session: SessionLike, timeout: float = REMOTE_CLEANUP_S) -> list[str]:
    """At ``stop()``: remove the session's Inductor cache on every host but the kernel's; the hosts asked.

    One engine per other host removes the directory (the kernel's own is removed by ``stop()``,
    and by the reaper if the kernel dies). Best effort, bounded by ``timeout``: an engine that
    is gone or busy leaves its host's directory in ``/tmp``, as before.
    """
    import shutil

    from nbddp.protocol.compile_settings import session_cache_dir

    path = session_cache_dir(session.file_prefix)
    return once_per_other_host(session.client, session.placements, shutil.rmtree, path, True, timeout=timeout)
