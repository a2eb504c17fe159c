"""What a detached elastic fit needs to be relaunched without the kernel that launched it, and its restarts so far.

A ``dist_fit(max_restarts=N, block=False)`` in a detached session may lose a
rank while no kernel is attached. Whoever drives the fit then (the
caretaker, ``nbddp/detached/caretaker.py``, or a kernel that attached later)
relaunches it as the launching kernel's ``FitRun`` would: the same fit task,
the same shipped arguments, from the newest snapshot. So when such a fit
starts, its **relaunch spec** is written beside the session's record
(owner-only, ``session-<id>-<fit>-care.pkl``): its ``FitConfig`` (with its
snapshot folder), its ``FitLaunch``, its ``FailurePolicy``, and the parcels
of its first send. A parcel's shared-memory file is hard-linked under a
name of the spec's own (``<prefix>-care-<fit>-<n>``): the kernel's pool
would rewrite its file for a later send, and the link costs no copy. The
code lines a fresh engine lacks travel inside (``Parcel.sources``), since
the caretaker has no notebook cells to read them from.

Its **ledger** (``session-<id>-<fit>-ledger.pkl``) is what one driver hands
the next: the restarts so far (``History.restarts``), the records of the
steps before the last resume, and how the fit ended when it failed while
no kernel was attached. Both files go when the fit's result is taken, and
with the session (``remove_session``, the reaper's ``/dev/shm`` clean-up).
"""

from __future__ import annotations

import dataclasses
import glob
import os
from dataclasses import dataclass, field
from typing import Any

from nbddp.elastic.contracts import Records
from nbddp.execution.policy import FailurePolicy
from nbddp.protocol import session_record
from nbddp.protocol.fit_options import FitConfig
from nbddp.protocol.messages import FitLaunch
from nbddp.protocol.notes import shm_dir
from nbddp.session.session import Session
from nbddp.shipping import pickling as shipping


@dataclass
class RelaunchSpec:
    """The fit task's arguments as its first send had them, for every relaunch after."""

    cfg: FitConfig
    launch: FitLaunch
    policy: FailurePolicy
    parcels: dict[bool, shipping.Parcel]  # local? -> the shipped arguments
    model_parcels: dict[bool, shipping.Parcel] = field(default_factory=dict)


@dataclass
class Ledger:
    """What one driver of the fit hands the next (see the module docstring)."""

    restarts: list[dict[str, Any]] = field(default_factory=list)
    records: Records = field(default_factory=list)  # before the current launch's (all so far while one is pending)
    pending: bool = False  # relaunched, and its rank 0 has not yet said from which step it resumed
    failed: str = ""  # how the fit ended, when it failed with no kernel attached (empty: it did not)
    error: BaseException | None = None  # that error itself, raised by the attaching kernel's handle


def _path(record_path: str, fit_id: str, what: str) -> str:
    return f"{record_path[:-len('.json')]}-{fit_id}-{what}.pkl"


def _write(path: str, blob: bytes) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(blob)
    os.replace(tmp, path)


def _read(path: str, what: str) -> Any:
    import cloudpickle

    try:
        session_record.check_owned(path, what)
        with open(path, "rb") as f:
            return cloudpickle.load(f)
    except FileNotFoundError:
        return None


def _kept(session: Session, parcel: shipping.Parcel, name: str) -> shipping.Parcel:
    """``parcel`` as the spec keeps it: its file linked under ``name``, every code line it needs inside."""
    sources = tuple(found for found in (session.sources.source(f) for f in parcel.source_files) if found is not None)
    path = parcel.path
    if path:
        link = os.path.join(shm_dir(), name)
        if os.path.lexists(link):
            os.unlink(link)
        os.link(path, link)
        path = link
    return dataclasses.replace(parcel, path=path, pooled=False, sources=sources)


def save(session: Session, run: Any, entry: dict[str, Any]) -> bool:
    """Write the relaunch spec of ``run`` (a ``FitRun`` with ``max_restarts``); whether it was written."""
    if session.record_path is None or not run.policy.restarts:
        return False
    fit_id, plan = str(entry["fit_id"]), run.plan
    base = f"{session.file_prefix}-care-{fit_id}"
    spec = RelaunchSpec(plan.cfg, plan.launch, run.policy,
                        {local: _kept(session, p, f"{base}-d{int(local)}") for local, p in plan.parcels.items()},
                        {local: _kept(session, p, f"{base}-m{int(local)}") for local, p in plan.model_parcels.items()})
    _write(_path(session.record_path, fit_id, "care"), shipping.dumps(spec, what="the fit's relaunch spec",
                                                                      label="dist_fit's arguments"))
    return True


def load(record_path: str, fit_id: str) -> RelaunchSpec | None:
    spec = _read(_path(record_path, fit_id, "care"), "the fit's relaunch spec")
    return spec if isinstance(spec, RelaunchSpec) else None


def save_ledger(record_path: str, fit_id: str, ledger: Ledger) -> None:
    if ledger.error is not None and not _travels(ledger.error):  # it still travels as its text (``failed``)
        ledger = dataclasses.replace(ledger, error=None)
    _write(_path(record_path, fit_id, "ledger"), shipping.dumps(ledger, what="the fit's restarts",
                                                                label="History.restarts"))


def _travels(error: BaseException) -> bool:
    """Whether ``error`` comes back from a pickle (an exception whose ``__init__`` takes other arguments does not)."""
    import pickle

    import cloudpickle

    try:
        pickle.loads(cloudpickle.dumps(error))
    except Exception:  # noqa: BLE001 - any failure means: send the text
        return False
    return True


def load_ledger(record_path: str, fit_id: str) -> Ledger:
    ledger = _read(_path(record_path, fit_id, "ledger"), "the fit's restarts")
    return ledger if isinstance(ledger, Ledger) else Ledger()


def forget(record_path: str | None, file_prefix: str, fit_id: str) -> None:
    """The spec, the ledger and the linked files of fit ``fit_id``: its result was taken."""
    if record_path is not None:
        for what in ("care", "ledger"):
            session_record.remove(_path(record_path, fit_id, what))
    for path in glob.glob(os.path.join(shm_dir(), glob.escape(f"{file_prefix}-care-{fit_id}-")) + "*"):
        session_record.remove(path)
