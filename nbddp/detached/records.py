"""A session written into its record and read back: the process group, the start options, the resident datasets.

Everything a new kernel needs to use the workers as they are (never forming
the group again: that would empty the ranks' dataset caches and forget the
kept models' groups) is plain data here, so the record stays JSON.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from nbddp.cluster.slurm.request import SlurmRequest
from nbddp.protocol import session_record
from nbddp.protocol.placement import Placement, Probe
from nbddp.protocol.session_record import SessionRecord
from nbddp.session.process_group import GroupState
from nbddp.session.session import Session
from nbddp.session.start_options import StartOptions

_OPTION_FIELDS = ("n", "backend", "profile", "cluster_id", "timeout", "threads", "interface", "stall_timeout")


def group_to_json(group: GroupState) -> dict[str, Any]:
    return dataclasses.asdict(group)


def group_from_json(data: dict[str, Any]) -> GroupState:
    return GroupState(generation=int(data["generation"]), backend=str(data["backend"]),
                      placements=tuple(Placement(**p) for p in data["placements"]),
                      probes=tuple(Probe(**p) for p in data["probes"]),
                      init_method=str(data["init_method"]), master_addr=str(data["master_addr"]),
                      master_port=int(data["master_port"]), allocator=tuple(data.get("allocator", ())))


def options_to_json(options: StartOptions, engine_env: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {name: getattr(options, name) for name in _OPTION_FIELDS}
    out["slurm"] = dataclasses.asdict(options.slurm) if options.slurm is not None else None
    out["engine_env"] = dict(engine_env)
    return out


def options_from_json(data: dict[str, Any]) -> StartOptions:
    slurm = data.get("slurm")
    request = SlurmRequest(**{**slurm, "sbatch": tuple(slurm.get("sbatch") or ())}) if slurm else None
    return StartOptions(n=data.get("n"), backend=data.get("backend"), cluster=None, profile=data.get("profile"),
                        cluster_id=data.get("cluster_id"), timeout=float(data["timeout"]), threads=data.get("threads"),
                        interface=data.get("interface"), stall_timeout=data.get("stall_timeout"), slurm=request)


def build(session: Session, session_id: str, keep_alive_s: float, started: float) -> SessionRecord:
    """The record of ``session`` now, this kernel attached."""
    workers, options = session.workers, session.options
    assert workers is not None and options is not None and session.group is not None, "a started session"
    cluster = workers.cluster
    reaper = workers.reaper
    return SessionRecord(
        id=session_id, owner_uid=os.getuid(), kernel_pid=os.getpid(),
        cluster_file=str(getattr(cluster, "cluster_file", "") or ""), connection_file=workers.connection_file,
        world=session.world_size, backend=session.backend, started=started, keep_alive_s=keep_alive_s,
        file_prefix=session.file_prefix, token=session.token, reaper_pid=reaper.pid or 0,
        reaper_pidfile=reaper.pidfile or "", slurm_job_ids=workers.job_ids(), group=group_to_json(session.group),
        options=options_to_json(options, workers.engine_env), resident=session.resident.keys())


def refresh(session: Session, keep_owner: bool = False, **changes: Any) -> SessionRecord | None:
    """Write this kernel's session's record again (its group, resident datasets, jobs may have changed).

    ``keep_owner``: the kernel the record names stays (the caretaker writes it: ``nbddp/detached/caretaker.py``).
    """
    path = session.record_path
    if path is None or session.workers is None or session.group is None:
        return None
    old = session_record.read(path)
    if old is None:
        return None
    record = build(session, old.id, old.keep_alive_s, old.started)
    record.running, record.kept, record.caretaker_pid = old.running, old.kept, old.caretaker_pid
    if keep_owner:
        record.kernel_pid = old.kernel_pid
    for name, value in changes.items():
        setattr(record, name, value)
    session_record.write(record, os.path.dirname(path))
    return record
