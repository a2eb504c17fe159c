"""The public calls of sessions that outlive the kernel: ``detach``, ``attach``, ``sessions``, ``running``, ``kept``.

Thin, as ``nbddp/api.py``'s are (which re-exports them, so ``nbddp.api.attach``
works); kept in a module of their own so that each stays one idea and
within the house's module size. The machinery is ``nbddp/detached/``
(``docs/sessions.md``).
"""

from __future__ import annotations

from typing import Any

from nbddp.fit.handle import FitHandle
from nbddp.session.session import get_session


def detach(keep_alive: str | float = "2h") -> dict[str, Any]:
    """Let the running workers outlive this kernel; the session's ``sessions()`` row.

    The workers, the controller, a running fit, kept models, resident
    datasets and every ``%%ddp`` name stay when the kernel exits, restarts or
    dies; ``nbddp.attach()`` in the next kernel takes them up again. With no
    kernel attached and no fit running for ``keep_alive`` (``"2h"``, ``"30m"``,
    ``"90s"`` or seconds; never "forever"), the session ends by itself,
    leaving no process, file or Slurm job behind. Called again, it sets a new
    ``keep_alive``. See ``docs/sessions.md``.

    Raises:
        NotStartedError: no workers run here. SessionError: another kernel
            drives the session now. ClusterError: the workers are an
            ipcluster nbddp did not start (they already outlive the kernel).
        TypeError, ValueError: ``keep_alive`` is not a duration above zero.
    """
    from nbddp.detached.detach import detach as detach_session
    from nbddp.detached.listing import row

    return row(detach_session(get_session(), keep_alive))


def attach(id: str | None = None, *, take_over: bool = False) -> dict[str, Any]:
    """Take a detached session up in this kernel (a new one after a restart, or another notebook); ``status()``.

    ``id``: one of ``nbddp.sessions()``; default: the only one there is.
    The workers come back as they are: their process group, kept models
    (``nbddp.kept()``), resident datasets and ``%%ddp`` names; a fit that
    was running comes back as ``nbddp.running()``. One kernel drives a
    session at a time: ``take_over=True`` moves it here from a live one.

    Raises:
        SessionError: no session (the message lists ``sessions()``), the one
            named has ended, several exist and none was named, another live
            kernel is attached (naming its pid), or its controller is gone
            (the record is then removed). PermissionError: the session
            belongs to another user.
    """
    from nbddp.detached.attach import attach as attach_session

    attach_session(get_session(), id, take_over)
    return get_session().snapshot()  # nbddp.status()


def sessions() -> list[dict[str, Any]]:
    """This user's detached sessions: ``id``, ``world``, ``backend``, ``started``, ``attached`` (a kernel's pid),
    ``running`` (the fit running there), ``kept`` (names), ``keep_alive_s``, ``slurm_jobs``."""
    from nbddp.detached.listing import rows

    return rows()


def running() -> FitHandle | None:
    """The handle of the fit running on this kernel's workers (also one found running by ``attach()``), or None."""
    from nbddp.detached.resumed_fit import running_handle

    return running_handle(get_session())


def kept() -> list[dict[str, Any]]:
    """The models ``dist_fit(keep=...)`` left on the ranks: ``name``, ``strategy`` ("module", "fsdp", "pipeline",
    "tensor"), ``precision``, ``params``; each usable as ``predict("name", ...)`` and ``evaluate("name", ...)``."""
    from nbddp.inference.kept_listing import kept_models

    return kept_models(get_session())
