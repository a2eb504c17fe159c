"""``%ddp status``: one row per rank, with whether it answers and its memory.

``nbddp.status()`` says what the session believes; this module also asks
every worker (or, while a fit keeps them busy, looks at the local pids).
"""

from __future__ import annotations

import html
import time
from typing import Any

from nbddp.protocol.messages import Health
from nbddp.session.session import Session, get_session
from nbddp.cluster.slurm.watch import job_lines
from nbddp.execution.send import to_engines

HEALTH_TIMEOUT_S = 3.0

COLUMNS = ("rank", "local rank", "host", "pid", "device", "alive", "memory", "keeps", "fit running")
SHOWN_RESIDENT = 4  # items named per worker in the keeps column; the rest are summed


class StatusTable:
    """``%ddp status`` rows, shown as HTML in Jupyter and as text elsewhere."""

    def __init__(self, rows: list[dict[str, Any]], summary: str):
        self.rows = rows
        self.summary = summary

    def __repr__(self) -> str:
        cells = [COLUMNS, *[tuple(str(row[c]) for c in COLUMNS) for row in self.rows]]
        widths = [max(len(r[i]) for r in cells) for i in range(len(COLUMNS))]
        lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in cells]
        return "\n".join([self.summary, *lines])

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(c)}</th>" for c in COLUMNS)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(str(row[c]))}</td>" for c in COLUMNS) + "</tr>"
                       for row in self.rows)
        return (f"<div><p>{html.escape(self.summary).replace(chr(10), '<br>')}</p>"
                f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>")


def status_table() -> StatusTable | str:
    """``nbddp.status()`` plus each worker's liveness and memory (a quick probe)."""
    s = get_session()
    st = s.snapshot()
    if not st["running"]:
        return "nbddp: no workers are running; start them with %ddp start (or nbddp.start())"
    fit = "yes" if st["fit_running"] else "no"
    health = _probe_health(s, busy=st["fit_running"])
    rows = []
    for row in st["ranks"]:
        alive, memory, keeps = health.get(row["engine"], ("?", "?", "?"))
        rows.append({"rank": row["rank"], "local rank": row["local_rank"], "host": row["host"], "pid": row["pid"],
                     "device": row["device"], "alive": alive, "memory": memory, "keeps": keeps, "fit running": fit})
    owner = "started by this kernel" if st["owned"] else "attached"
    if st.get("detached"):  # it outlives the kernel (nbddp.detach / nbddp.attach)
        owner = f"detached session {st['detached']}"
    summary = (f"nbddp: {st['world_size']} worker(s), backend {st['backend']}, {owner}, "
               f"process-group generation {st['generation']}")
    summary = "\n".join([summary, *job_lines(st.get("slurm") or [])])  # the Slurm job(s) holding the workers
    return StatusTable(rows, summary)


def _probe_health(session: Session, busy: bool) -> dict[int, tuple[str, str, str]]:
    """engine id -> (alive, memory, keeps). A fit keeps engines busy, so then only local pids are checked."""
    from nbddp.worker.tasks.status import health

    registered = set(session.client.ids)
    out: dict[int, tuple[str, str, str]] = {}
    ars = {}
    if not busy:
        ars = to_engines(session.client, [p.engine_id for p in session.placements if p.engine_id in registered],
                         health)
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    for p in session.placements:
        if p.engine_id not in registered:
            out[p.engine_id] = ("no (unregistered)", "-", "-")
            continue
        ar = ars.get(p.engine_id)
        if ar is not None:
            try:
                info = ar.get(timeout=max(0.01, deadline - time.monotonic()))
                out[p.engine_id] = ("yes", _memory(info), resident_text(info.resident))
                continue
            except Exception:  # noqa: BLE001 - busy, stuck or dead: decided below
                pass
        out[p.engine_id] = _local_health(p.pid, busy) if p.local else ("no reply", "?", "?")
    return out


def _local_health(pid: int, busy: bool) -> tuple[str, str, str]:
    import psutil

    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return "no (exited)", "-", "-"
        rss = proc.memory_info().rss
    except psutil.Error:
        return "no (process gone)", "-", "-"
    return ("yes (busy)" if busy else "yes (no reply)"), _bytes(rss), "?"


def _memory(info: Health) -> str:
    text = _bytes(info.rss)
    if info.cuda_allocated is not None:
        text += f", GPU {_bytes(info.cuda_allocated)} (reserved {_bytes(info.cuda_reserved or 0)})"
    return text


def resident_text(resident: tuple[tuple[str, int], ...]) -> str:
    """The keeps column: ``"net 1.2 GB, x 64 KB, and 3 more (2 MB)"``, largest first; ``"nothing"`` when none."""
    if not resident:
        return "nothing"
    shown = ", ".join(f"{name} {_bytes(size)}" for name, size in resident[:SHOWN_RESIDENT])
    rest = resident[SHOWN_RESIDENT:]
    return shown + (f", and {len(rest)} more ({_bytes(sum(size for _, size in rest))})" if rest else "")


def _bytes(n: float) -> str:
    if n < 1024**2:
        return f"{n / 1024:.0f} KB"
    if n < 1024**3:
        return f"{n / 1024**2:.0f} MB"
    return f"{n / 1024**3:.1f} GB"
