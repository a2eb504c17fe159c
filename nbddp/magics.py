"""``%ddp`` and ``%%ddp``: parse the arguments, then call ``nbddp.api`` and the Session.

==========================================  =====================================
``%ddp start [-n N] [--backend B] ...``      ``nbddp.start(...)``, then the table
``%ddp stop`` / ``%ddp restart``             ``nbddp.stop()`` / ``nbddp.restart()``
``%ddp status``                              ``nbddp.status()`` plus a liveness and
                                             memory probe of every worker
``%ddp push NAME...``                        kernel variables -> every rank
``%ddp pull NAME... [--rank R]``             a rank's variables -> the kernel
``%%ddp [--ranks 0,2] [--no-stream]``        run the cell on every (or some) rank
==========================================  =====================================

A ``%%ddp`` cell runs as one task per rank, watched by ``tasks.RankTasks``:
the same fault handling as ``dist_fit`` (the first failing rank is raised as
``WorkerError`` at once; ranks stuck in a collective are killed and replaced).
Engine output reaches the kernel in batches; it is polled while the cell
waits and printed line by line with a ``[rank N]`` label.
"""

from __future__ import annotations

import argparse
import ast
import html
import itertools
import signal
import sys
import time
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring, real_name

from nbddp.session import get_session

HEALTH_TIMEOUT_S = 3.0
OUTPUT_WAIT_S = 2.0
_CELL_NUMBERS = itertools.count(1)


# ---- argument parsers (one per sub-command) ---------------------------------
@magic_arguments("%ddp start")
@argument("-n", type=int, default=None, help="workers to start (default: one per GPU, or 2 on CPU)")
@argument("--backend", choices=["gloo", "nccl"], default=None, help="default: nccl with GPUs, gloo without")
@argument("--profile", default=None, help="attach to the ipcluster of this IPython profile")
@argument("--cluster-id", default=None, help="attach to the ipcluster with this cluster id")
def _start(): """Start (or attach to) the workers; the same as nbddp.start()."""  # noqa: E704


@magic_arguments("%ddp stop")
def _stop(): """Stop the workers this kernel started."""  # noqa: E704


@magic_arguments("%ddp status")
def _status(): """One row per rank: where it runs, whether it answers, its memory."""  # noqa: E704


@magic_arguments("%ddp restart")
def _restart(): """Stop and start again with the same settings."""  # noqa: E704


@magic_arguments("%ddp pull")
@argument("names", nargs="+", metavar="NAME", help="worker variables to copy into the notebook")
@argument("--rank", type=int, default=0, help="the rank to copy from (default 0)")
def _pull(): """Copy variables from one rank's %%ddp namespace into the notebook."""  # noqa: E704


@magic_arguments("%ddp push")
@argument("names", nargs="+", metavar="NAME", help="notebook variables to send")
def _push(): """Send notebook variables to every rank's %%ddp namespace."""  # noqa: E704


@magic_arguments("%%ddp")
@argument("--ranks", default=None, help="comma-separated ranks to run on, e.g. 0,2 (default: all)")
@argument("--no-stream", action="store_true", help="print each rank's output when the cell ends, grouped by rank")
def _cell(): """Run the cell on every rank (or the --ranks given)."""  # noqa: E704


_SUBCOMMANDS = {"start": _start, "stop": _stop, "status": _status, "restart": _restart, "pull": _pull, "push": _push}


def usage() -> str:
    """One line per sub-command, generated from the parsers (so it never drifts)."""
    lines = []
    for func in [*_SUBCOMMANDS.values(), _cell]:
        formatter = argparse.HelpFormatter(prog=real_name(func), width=200)
        formatter.add_usage(None, func.parser._actions, func.parser._mutually_exclusive_groups, prefix="")
        lines.append(formatter.format_help().strip())
    return "usage:\n  " + "\n  ".join(lines)


# ---- the magics ----------------------------------------------------------------
@magics_class
class DDPMagics(Magics):
    @line_cell_magic
    def ddp(self, line: str, cell: str | None = None) -> None:
        """Drive the DDP workers: %ddp start|stop|status|restart|pull|push, or %%ddp to run a cell on every rank."""
        if cell is not None:
            args = parse_argstring(_cell, line)
            run_cell(cell, parse_ranks(args.ranks), stream=not args.no_stream)
            return
        words = line.strip().split(None, 1)
        if not words:
            raise UsageError(f"%ddp needs a sub-command.\n{usage()}")
        command, rest = words[0], (words[1] if len(words) > 1 else "")
        func = _SUBCOMMANDS.get(command)
        if func is None:
            raise UsageError(f"%ddp has no sub-command {command!r}.\n{usage()}")
        args = parse_argstring(func, rest)
        getattr(self, f"_do_{command}")(args)

    def _do_start(self, args: Any) -> None:
        from nbddp import api

        api.start(args.n, backend=args.backend, profile=args.profile, cluster_id=args.cluster_id)
        _show(status_table())

    def _do_stop(self, args: Any) -> None:
        from nbddp import api

        api.stop()
        print("nbddp: workers stopped")

    def _do_restart(self, args: Any) -> None:
        from nbddp import api

        api.restart()
        _show(status_table())

    def _do_status(self, args: Any) -> None:
        _show(status_table())

    def _do_push(self, args: Any) -> None:
        ns = self.shell.user_ns
        missing = [n for n in args.names if n not in ns]
        if missing:
            raise NameError(f"%ddp push: no variable named {', '.join(map(repr, missing))} in the notebook; "
                            "define it in a cell first (push sends existing notebook variables to the workers)")
        push({n: ns[n] for n in args.names})

    def _do_pull(self, args: Any) -> None:
        self.shell.user_ns.update(pull(args.names, args.rank))


def register(ipython: Any) -> None:
    """Register ``%ddp``/``%%ddp`` and put ``dist_fit`` in the notebook's namespace."""
    import nbddp

    ipython.register_magics(DDPMagics)
    ipython.user_ns.setdefault("dist_fit", nbddp.dist_fit)


def unregister(ipython: Any) -> None:
    """Remove exactly what ``register`` added (workers keep running)."""
    import nbddp

    manager = ipython.magics_manager
    manager.registry.pop(DDPMagics.__name__, None)
    for kind in ("line", "cell"):
        bound = manager.magics[kind].get("ddp")
        if bound is not None and isinstance(getattr(bound, "__self__", None), DDPMagics):
            del manager.magics[kind]["ddp"]
    if ipython.user_ns.get("dist_fit") is nbddp.dist_fit:
        del ipython.user_ns["dist_fit"]


# ---- %%ddp ------------------------------------------------------------------------
def parse_ranks(text: str | None) -> list[int] | None:
    """``"0,2"`` -> ``[0, 2]``; ``None`` -> all ranks."""
    if text is None:
        return None
    try:
        ranks = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UsageError(f"%%ddp --ranks takes comma-separated integers like 0,2; got {text!r}") from None
    if not ranks:
        raise UsageError(f"%%ddp --ranks needs at least one rank, e.g. --ranks 0; got {text!r}")
    return sorted(set(ranks))


def run_cell(cell: str, ranks: list[int] | None, stream: bool = True) -> None:
    """Run ``cell`` on ``ranks`` (all by default); print labelled output; raise ``WorkerError`` on failure."""
    from nbddp.tasks import RankTasks
    from nbddp.worker.cells import CELL_FILENAME
    from nbddp.worker.cells import run_cell as remote_cell

    number = next(_CELL_NUMBERS)
    ast.parse(cell, filename=CELL_FILENAME.format(n=number))  # a SyntaxError is raised here, before any rank runs
    s = get_session()
    s.ensure_started()
    with s.lock:
        s.ensure_ready()
        chosen = _placements(s, ranks)
        meta = {"generation": s.generation}
        ars = {p.rank: s.client[p.engine_id].apply_async(remote_cell, cell, number, meta) for p in chosen}
    tasks = RankTasks(s, ars, "%%ddp cell")
    output = RankOutput(ars, live=stream)
    interrupted = False
    try:
        while True:
            try:
                tasks.wait(on_tick=output.tick)
                return
            except KeyboardInterrupt:
                if interrupted:  # second interrupt: kill what still runs, replace it
                    _kill_pending(s, tasks)
                    raise KeyboardInterrupt(
                        "%%ddp: killed the ranks still running after a second interrupt; "
                        "replacement workers are starting (names defined on them are lost)") from None
                interrupted = True
                pending = [p.engine_id for p in chosen if p.rank in tasks.pending]
                s.workers.signal(pending, signal.SIGINT)
    except Exception as exc:
        from nbddp.errors import WorkerError

        if interrupted and isinstance(exc, WorkerError):
            raise KeyboardInterrupt(f"%%ddp cell interrupted on every rank ({exc})") from None
        raise
    finally:
        output.finish(tasks)


def _placements(session: Any, ranks: list[int] | None) -> list[Any]:
    if ranks is None:
        return list(session.placements)
    by_rank = {p.rank: p for p in session.placements}
    unknown = [r for r in ranks if r not in by_rank]
    if unknown:
        raise UsageError(f"%%ddp --ranks {','.join(map(str, ranks))}: no rank {', '.join(map(str, unknown))}; "
                         f"the workers have ranks 0..{session.world_size - 1}")
    return [by_rank[r] for r in ranks]


def _kill_pending(session: Any, tasks: Any) -> None:
    placements = {p.rank: p for p in session.placements}
    ids = [placements[r].engine_id for r in tasks.pending]
    if ids:
        session.workers.kill(ids, {p.engine_id: p.pid for p in placements.values()})
        session.heal_async(ids)


class RankOutput:
    """Each rank's engine stdout/stderr, printed as complete lines with a ``[rank N]`` label.

    ``live``: print as it arrives (polled at every tick); otherwise print
    everything, grouped by rank, when the cell ends.
    """

    def __init__(self, ars: dict[int, Any], live: bool = True):
        self.ars = ars
        self.live = live
        self.seen = {(r, k): 0 for r in ars for k in ("stdout", "stderr")}
        self.partial = {key: "" for key in self.seen}
        self.lines: list[tuple[int, str, str]] = []  # (rank, stream, line) held back when not live

    def tick(self) -> None:
        for rank, ar in self.ars.items():
            for kind in ("stdout", "stderr"):
                self._take(rank, kind, _metadata(ar, kind))

    def _take(self, rank: int, kind: str, text: str) -> None:
        key = (rank, kind)
        new = text[self.seen[key]:]
        if not new:
            return
        self.seen[key] = len(text)
        *complete, rest = (self.partial[key] + new).split("\n")
        self.partial[key] = rest
        for line in complete:
            self._emit(rank, kind, line)

    def _emit(self, rank: int, kind: str, line: str) -> None:
        if self.live:
            _write(kind, f"[rank {rank}] {line}\n")
        else:
            self.lines.append((rank, kind, line))

    def finish(self, tasks: Any) -> None:
        """Wait briefly for the last output of ranks that ended, then print the rest."""
        deadline = time.monotonic() + OUTPUT_WAIT_S
        for rank, ar in self.ars.items():
            if rank in tasks.results or rank in tasks.failures:
                try:
                    ar.wait_for_output(max(0.01, deadline - time.monotonic()))
                except Exception:  # noqa: BLE001 - output is best effort
                    pass
        self.tick()
        for (rank, kind), rest in self.partial.items():
            if rest:
                self._emit(rank, kind, rest)
                self.partial[(rank, kind)] = ""
        for rank, kind, line in sorted(self.lines, key=lambda item: item[0]):
            _write(kind, f"[rank {rank}] {line}\n")
        self.lines.clear()
        sys.stdout.flush()
        sys.stderr.flush()


def _metadata(ar: Any, key: str) -> str:
    try:
        value = ar[key]
    except Exception:  # noqa: BLE001 - a dead engine's task may have none
        return ""
    return value if isinstance(value, str) else ""


def _write(kind: str, text: str) -> None:
    (sys.stderr if kind == "stderr" else sys.stdout).write(text)


# ---- push / pull --------------------------------------------------------------
def push(values: dict[str, Any]) -> None:
    """Send ``{name: value}`` into every rank's ``%%ddp`` namespace."""
    from nbddp import shipping
    from nbddp.tasks import RankTasks
    from nbddp.worker.cells import push as remote_push

    s = get_session()
    s.ensure_started()
    what = f"%ddp push {' '.join(values)}"
    with s.lock:
        s.ensure_ready()
        parcels = {local: shipping.pack(values, what=what, local=local) for local in {p.local for p in s.placements}}
        try:
            ars = {p.rank: s.client[p.engine_id].apply_async(remote_push, parcels[p.local]) for p in s.placements}
        except BaseException:
            for parcel in parcels.values():
                parcel.discard()
            raise
    try:
        RankTasks(s, ars, what).wait()
    finally:
        for parcel in parcels.values():
            parcel.discard()


def pull(names: list[str], rank: int = 0) -> dict[str, Any]:
    """``{name: value}`` copied from ``rank``'s ``%%ddp`` namespace."""
    from nbddp import shipping
    from nbddp.tasks import RankTasks
    from nbddp.worker.cells import pull as remote_pull

    s = get_session()
    s.ensure_started()
    with s.lock:
        s.ensure_ready()
        placement = _placements(s, [rank])[0]
        ar = s.client[placement.engine_id].apply_async(remote_pull, list(names))
    reply = RankTasks(s, {rank: ar}, f"%ddp pull {' '.join(names)}").wait()[rank]
    if "missing" in reply:
        available = ", ".join(reply["available"]) or "none yet"
        raise NameError(f"%ddp pull: rank {rank} has no variable named {', '.join(map(repr, reply['missing']))}; "
                        f"the names defined there are: {available}. Define it in a %%ddp cell first.")
    parcel = reply["parcel"]
    try:
        return shipping.unpack(parcel)
    finally:
        parcel.discard()


# ---- %ddp status --------------------------------------------------------------------
COLUMNS = ("rank", "local rank", "host", "pid", "device", "alive", "memory", "fit running")


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
        return (f"<div><p>{html.escape(self.summary)}</p>"
                f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>")


def status_table() -> StatusTable | str:
    """``nbddp.status()`` plus each worker's liveness and memory (a quick probe)."""
    from nbddp import api

    st = api.status()
    if not st["running"]:
        return "nbddp: no workers are running; start them with %ddp start (or nbddp.start())"
    s = get_session()
    fit = "yes" if st["fit_running"] else "no"
    health = _probe_health(s, busy=st["fit_running"])
    rows = []
    for row in st["ranks"]:
        alive, memory = health.get(row["engine"], ("?", "?"))
        rows.append({"rank": row["rank"], "local rank": row["local_rank"], "host": row["host"], "pid": row["pid"],
                     "device": row["device"], "alive": alive, "memory": memory, "fit running": fit})
    owner = "started by this kernel" if st["owned"] else "attached"
    summary = (f"nbddp: {st['world_size']} worker(s), backend {st['backend']}, {owner}, "
               f"process-group generation {st['generation']}")
    return StatusTable(rows, summary)


def _probe_health(session: Any, busy: bool) -> dict[int, tuple[str, str]]:
    """engine id -> (alive, memory). A fit keeps engines busy, so then only local pids are checked."""
    from nbddp.worker.cells import health

    registered = set(session.client.ids)
    out: dict[int, tuple[str, str]] = {}
    ars = {}
    if not busy:
        ars = {p.engine_id: session.client[p.engine_id].apply_async(health)
               for p in session.placements if p.engine_id in registered}
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    for p in session.placements:
        if p.engine_id not in registered:
            out[p.engine_id] = ("no (unregistered)", "-")
            continue
        ar = ars.get(p.engine_id)
        if ar is not None:
            try:
                info = ar.get(timeout=max(0.01, deadline - time.monotonic()))
                out[p.engine_id] = ("yes", _memory(info))
                continue
            except Exception:  # noqa: BLE001 - busy, stuck or dead: decided below
                pass
        out[p.engine_id] = _local_health(p.pid, busy) if p.local else ("no reply", "?")
    return out


def _local_health(pid: int, busy: bool) -> tuple[str, str]:
    import psutil

    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return "no (exited)", "-"
        rss = proc.memory_info().rss
    except psutil.Error:
        return "no (process gone)", "-"
    return ("yes (busy)" if busy else "yes (no reply)"), _bytes(rss)


def _memory(info: dict[str, Any]) -> str:
    text = _bytes(info["rss"])
    if "cuda_allocated" in info:
        text += f", GPU {_bytes(info['cuda_allocated'])} (reserved {_bytes(info['cuda_reserved'])})"
    return text


def _bytes(n: float) -> str:
    if n < 1024**2:
        return f"{n / 1024:.0f} KB"
    if n < 1024**3:
        return f"{n / 1024**2:.0f} MB"
    return f"{n / 1024**3:.1f} GB"


def _show(obj: Any) -> None:
    from IPython.display import display

    if isinstance(obj, str):
        print(obj)
    else:
        display(obj)
