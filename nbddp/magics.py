"""``%ddp`` and ``%%ddp``: parse the arguments, then call the Python API.

==========================================  =====================================
``%ddp start [-n N] [--backend B] ...``      ``nbddp.start(...)``, then the table
``%ddp stop`` / ``%ddp restart``             ``nbddp.stop()`` / ``nbddp.restart()``
``%ddp start --detach [--keep-alive 2h]``    ``nbddp.start(..., detach=True, keep_alive=...)``
``%ddp detach`` / ``%ddp attach [ID]``       ``nbddp.detach()`` / ``nbddp.attach(ID)``
                                             (``--take-over``); ``%ddp sessions``
``%ddp status``                              ``nbddp.status()`` plus a liveness and
                                             memory probe of every worker
``%ddp push NAME...``                        ``nbddp.push(NAME=value, ...)``
``%ddp pull NAME... [--targets T]``          ``nbddp.pull(NAME, ..., rank=R)`` (or ``ranks=``)
``%ddp script [--displays R] PATH [ARGS]``   ``nbddp.run_script(PATH, *ARGS, displays=R)``
``%ddp stacks [--targets T] [--timeout S]``  ``nbddp.stacks()``: every rank's stack now
``%ddp debug [RANK] [--clear]``              ``nbddp.debug(RANK)``: pdb on a failed or paused
                                             rank; ``--clear`` drops kept failures
``%%ddp [--targets 0,2] [--no-stream]``      ``nbddp.run_cell(cell, ranks, stream=...)``
``%%ddp --hooks NAME``                       ``nbddp.run_cell(cell, loggers=, callbacks=)``: the
                                             loggers and callbacks NAME holds, fed what the
                                             cell reports (``nbddp.report``)
``%%ddp --noblock``                          ``nbddp.run_cell(cell, block=False)``: the
                                             cell's value is a ``CallHandle`` (``_``)
``%%ddp --displays all``                     ``nbddp.run_cell(cell, displays="all")``: every
                                             rank's plots, not only the first rank's
==========================================  =====================================

``--targets`` is ipyparallel's spelling: one rank (``1``), a list
(``0,2``), a slice of the ranks (``::2``, ``1:``, ``-2:`` as
``--targets=-2:``) or ``all``; ``--ranks`` (and ``pull``'s ``--rank``) say
the same. ``--block``/``--noblock`` too.

Nothing here runs work itself: every sub-command is one call into
``nbddp.api``, ``nbddp.cells.cell_code`` or ``nbddp.monitor.status``. Every
misuse raises IPython's ``UsageError`` with the sub-command's usage line (a
missing name's is a ``NameError`` too).
"""

from __future__ import annotations

import argparse
import re
import shlex
from typing import Any, Protocol

from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring, real_name


class Parsed(Protocol):
    """A sub-command's function below: ``magic_arguments`` hangs its parser on it."""

    parser: argparse.ArgumentParser

    def __call__(self) -> None: ...


# ---- argument parsers (one per sub-command) ---------------------------------
@magic_arguments("%ddp start")
@argument("-n", type=int, default=None, help="workers to start (default: one per GPU, or 2 on CPU)")
@argument("--backend", choices=["gloo", "nccl"], default=None, help="default: nccl with GPUs, gloo without")
@argument("--profile", default=None, help="attach to the ipcluster of this IPython profile (name, folder or connection file)")
@argument("--cluster-id", default=None, help="attach to the ipcluster with this cluster id")
@argument("--timeout", type=float, default=None, help="process-group timeout in seconds (default 300)")
@argument("--threads", type=int, default=None, help="CPU threads per worker (default: cores / workers)")
@argument("--interface", default=None, help="network interface for gloo/NCCL across hosts (default: detected)")
@argument("--stall-timeout", type=float, default=None, help="default dist_fit(stall_timeout=...) in seconds")
@argument("--slurm", action="store_true", help="the workers are one Slurm job (ipyparallel's Slurm launcher)")
@argument("--partition", default=None, help="Slurm partition (with --slurm)")
@argument("--nodes", type=int, default=None, help="Slurm nodes to spread the workers over (with --slurm, default 1)")
@argument("--gpus-per-node", type=int, default=None, help="GPUs per node, one worker each (with --slurm)")
@argument("--time", default=None, help="Slurm time limit, e.g. 30, 04:00:00, 1-12:00:00 (with --slurm)")
@argument("--account", default=None, help="Slurm account (with --slurm)")
@argument("--sbatch", default=None, help='extra sbatch arguments, quoted: --sbatch "--qos=high --exclusive" (with --slurm)')
@argument("--queue-timeout", type=float, default=None, help="cancel the job after waiting this many s in the queue")
@argument("--controller-ip", default=None, help="this machine's address the nodes reach (default: detected)")
@argument("--detach", action="store_true", help="the workers outlive this kernel: %%ddp attach in the next one")
@argument("--keep-alive", default="2h", help="with --detach: end the session after this long unused (default 2h)")
def _start(): """Start (or attach to) the workers; the same as nbddp.start()."""  # noqa: E704


@magic_arguments("%ddp stop")
def _stop(): """Stop the workers this kernel started."""  # noqa: E704


@magic_arguments("%ddp detach")
@argument("--keep-alive", default="2h", help="end the session after this long with no kernel and no fit (default 2h)")
def _detach(): """Let the workers outlive this kernel; the same as nbddp.detach()."""  # noqa: E704


@magic_arguments("%ddp attach")
@argument("id", nargs="?", default=None, help="the session (from %%ddp sessions); default: the only one")
@argument("--take-over", action="store_true", help="move the session here from the kernel attached to it")
def _attach(): """Take a detached session up in this kernel; the same as nbddp.attach()."""  # noqa: E704


@magic_arguments("%ddp sessions")
def _sessions(): """This user's detached sessions; the same as nbddp.sessions()."""  # noqa: E704


@magic_arguments("%ddp status")
def _status(): """One row per rank: where it runs, whether it answers, its memory."""  # noqa: E704


@magic_arguments("%ddp restart")
def _restart(): """Stop and start again with the same settings."""  # noqa: E704


@magic_arguments("%ddp pull")
@argument("names", nargs="+", metavar="NAME", help="worker variables to copy into the notebook")
@argument("--targets", "--rank", "--ranks", dest="targets", default=None,
          help="the rank to copy from (default 0); a list or slice (0,1 or ::2) gives each name a list, in rank order")
def _pull(): """Copy variables from one rank's %%ddp namespace into the notebook."""  # noqa: E704


@magic_arguments("%ddp push")
@argument("names", nargs="+", metavar="NAME", help="notebook variables to send")
def _push(): """Send notebook variables to every rank's %%ddp namespace."""  # noqa: E704


@magic_arguments("%ddp script")
@argument("--displays", default=None, help="whose plots and other rich output to show (before PATH): 0,1, all or none")
@argument("path", metavar="PATH", help="the script, relative to the notebook's folder")
@argument("args", nargs=argparse.REMAINDER, metavar="ARGS", help="the script's own arguments (its sys.argv[1:])")
def _script(): """Run a script written for torchrun on every rank; the same as nbddp.run_script()."""  # noqa: E704


@magic_arguments("%ddp stacks")
@argument("--timeout", type=float, default=5.0, help="seconds to wait for the ranks' answers (default 5)")
@argument("--targets", "--ranks", dest="targets", default=None, help="these ranks only: 0,2 or ::2 (default: all)")
def _stacks(): """Every rank's current Python stack, even inside a collective; the same as nbddp.stacks()."""  # noqa: E704


@magic_arguments("%ddp debug")
@argument("rank", type=int, nargs="?", default=None, help="the rank to debug (default: the one there is, or a list)")
@argument("--clear", action="store_true", help="drop the failures the ranks keep (and the memory they hold)")
def _debug(): """pdb on a failed rank's frame or a rank paused at breakpoint(); the same as nbddp.debug()."""  # noqa: E704


@magic_arguments("%%ddp")
@argument("--targets", "--ranks", dest="targets", default=None,
          help="the ranks to run on: 0,2, a slice such as ::2 or 1:, or all (default: all)")
@argument("--no-stream", action="store_true", help="print each rank's output when the cell ends, grouped by rank")
@argument("--displays", default=None,
          help="whose plots and other rich output to show: 0 (default: the first rank), 0,1, ::2, all or none")
@argument("--block", dest="block", action="store_const", const=True, default=True, help="wait for the cell (default)")
@argument("--noblock", dest="block", action="store_const", const=False,
          help="return at once with a CallHandle (the cell's value, so _): result() is each rank's value")
@argument("--hooks", default=None, metavar="NAME",
          help="a notebook variable holding loggers and callbacks for what the cell reports (nbddp.report): a list, "
               "or a dict with 'loggers' and 'callbacks'")
def _cell(): """Run the cell on every rank (or the --targets given)."""  # noqa: E704


_SUBCOMMANDS = {"start": _start, "stop": _stop, "status": _status, "restart": _restart, "pull": _pull, "push": _push,
                "script": _script, "stacks": _stacks, "debug": _debug, "detach": _detach, "attach": _attach,
                "sessions": _sessions}


def usage() -> str:
    """One line per sub-command, generated from the parsers (so it never drifts)."""
    return "usage:\n  " + "\n  ".join(usage_line(func) for func in [*_SUBCOMMANDS.values(), _cell])


def usage_line(func: Parsed) -> str:
    """One sub-command's usage on one line, e.g. ``%ddp pull [--targets TARGETS] NAME [NAME ...]``."""
    rest = func.parser.format_usage().split(func.parser.prog, 1)[-1]
    return " ".join([real_name(func), *rest.split()])


SLURM_FLAGS = ("partition", "nodes", "gpus_per_node", "time", "account", "sbatch", "queue_timeout", "controller_ip")


def slurm_settings(args: argparse.Namespace) -> dict[str, Any] | None:
    """``%ddp start --slurm --nodes 2 ...`` -> ``start(slurm={"nodes": 2, ...})``; Slurm flags need ``--slurm``."""
    given = {k: getattr(args, k) for k in SLURM_FLAGS if getattr(args, k) is not None}
    extra = given.get("sbatch")
    if extra and len(extra) >= 2 and extra[0] == extra[-1] and extra[0] in "'\"":  # magics keep the quotes
        given["sbatch"] = extra[1:-1]
    if not args.slurm:
        if given:
            flags = ", ".join("--" + k.replace("_", "-") for k in given)
            raise UsageError(f"%ddp start {flags} only mean something with --slurm (the workers as a Slurm job)")
        return None
    return given


class MissingName(UsageError, NameError):
    """``%ddp push``/``pull`` of a name that is not defined: misuse of the magic (a ``NameError`` too)."""


def misuse(func: Parsed, text: str) -> UsageError:
    """``UsageError(text)`` followed by ``func``'s usage line (a sub-command's parser)."""
    return UsageError(f"{text}\nusage: {usage_line(func)}")


def parse(func: Parsed, line: str) -> argparse.Namespace:
    """``line`` parsed by ``func``'s parser; its errors name the usage line."""
    try:
        return parse_argstring(func, line)
    except UsageError as exc:
        raise misuse(func, str(exc)) from None


def parse_targets(text: str | None, func: Parsed) -> list[int] | slice | int | None:
    """ipyparallel's ``--targets``: ``"1"`` -> 1, ``"0,2"`` -> [0, 2], ``"::2"`` -> a slice, ``all``/None -> None."""
    if text is None:
        return None
    flat = text.strip().strip("[]").replace(" ", "")
    if flat == "all":
        return None
    try:
        if ":" in flat:
            parts = [int(p) if p else None for p in flat.split(":")]
            if len(parts) > 3 or parts[2:] == [0]:
                raise ValueError(flat)
            return slice(*parts)
        ranks = [int(part) for part in flat.split(",") if part]
    except ValueError:
        raise misuse(func, f"--targets takes a slice like ::2 or 1:, 'all', or comma-separated integers like 0,2; "
                           f"got {text!r}") from None
    if not ranks:
        raise misuse(func, f"--targets needs at least one rank, e.g. --targets 0; got {text!r}")
    return ranks[0] if len(ranks) == 1 and "," not in flat else sorted(set(ranks))


def parse_displays(text: str | None, func: Parsed) -> Any:
    """``--displays``: None (the first rank), ``all``, ``none``, or ranks as ``--targets`` spells them."""
    if text is None:
        return None
    flat = text.strip().lower()
    if flat in ("all", "none"):
        return flat
    try:
        return parse_targets(text, func)
    except UsageError:
        raise misuse(func, f"--displays takes ranks like 0 or 0,1, a slice like ::2, 'all' or 'none'; "
                           f"got {text!r}") from None


# ---- the magics ----------------------------------------------------------------
@magics_class
class DDPMagics(Magics):
    @line_cell_magic
    def ddp(self, line: str, cell: str | None = None) -> Any:
        """Drive the DDP workers: %ddp start|stop|status|restart|pull|push|script|stacks|debug, or %%ddp on every rank."""
        if cell is not None:
            return self._run_cell(cell, parse(_cell, line), line)
        words = line.strip().split(None, 1)
        if not words:
            raise UsageError(f"%ddp needs a sub-command.\n{usage()}")
        command, rest = words[0], (words[1] if len(words) > 1 else "")
        func = _SUBCOMMANDS.get(command)
        if func is None:
            raise UsageError(f"%ddp has no sub-command {command!r}.\n{usage()}")
        if command == "script":  # the script's own arguments are its business: split like a shell, parse nothing
            words = shlex.split(rest)
            displays = None
            if words[:1] == ["--displays"] or words[:1] and words[0].startswith("--displays="):
                value = words[0].partition("=")[2] if "=" in words[0] else (words[1] if len(words) > 1 else "")
                words = words[1:] if "=" in words[0] else words[2:]
                displays = parse_displays(value, _script)
            if not words:
                raise UsageError(f"%ddp script needs the script's path, e.g. %ddp script train.py --lr 0.1\n{usage()}")
            args = argparse.Namespace(path=words[0], args=words[1:], displays=displays)
        else:
            args = parse(func, rest)
        args.line = rest  # (which spelling of a flag the person used, for messages)
        return getattr(self, f"_do_{command}")(args)

    def user_ns(self) -> dict[str, Any]:
        """The notebook's namespace (a registered magic always has its shell)."""
        assert self.shell is not None, "IPython gives a registered Magics its shell"
        return self.shell.user_ns

    def _run_cell(self, cell: str, args: argparse.Namespace, line: str) -> Any:
        """The cell on its ranks; with ``--noblock`` its ``CallHandle``, the cell's value (so ``_``)."""
        from nbddp.cells.cell_code import run_cell
        from nbddp.execution.calls import UnknownRanks

        loggers, callbacks = self._hooks(args.hooks)
        try:
            return run_cell(cell, parse_targets(args.targets, _cell), stream=not args.no_stream, block=args.block,
                            loggers=loggers, callbacks=callbacks, displays=parse_displays(args.displays, _cell))
        except UnknownRanks as exc:
            raise misuse(_cell, f"%%ddp {flag_in(line)} {args.targets}: {exc.detail}") from None

    def _hooks(self, name: str | None) -> tuple[Any, Any]:
        """``--hooks NAME``: the loggers and callbacks the notebook variable holds (None, None without it)."""
        from nbddp.cells.reported_call import split_hooks

        if name is None:
            return None, None
        ns = self.user_ns()
        if name not in ns:
            raise MissingName(f"%%ddp --hooks {name}: no variable named {name!r} in the notebook; define it first, "
                              f"e.g. {name} = [nbddp.loggers.CSV('runs/metrics.csv'), nbddp.EarlyStopping('loss')]")
        return split_hooks(name, ns[name])

    def _do_start(self, args: argparse.Namespace) -> None:
        from nbddp import api
        from nbddp.monitor.status import status_table

        api.start(args.n, backend=args.backend, profile=args.profile, cluster_id=args.cluster_id,
                  timeout=args.timeout, threads=args.threads, interface=args.interface,
                  stall_timeout=args.stall_timeout, slurm=slurm_settings(args), detach=args.detach,
                  keep_alive=args.keep_alive)
        _show(status_table())

    def _do_detach(self, args: argparse.Namespace) -> None:
        from nbddp import api

        row = api.detach(args.keep_alive)
        print(f"nbddp: session {row['id']} detached: it outlives this kernel; `%ddp attach {row['id']}` in the next "
              f"one (it ends after {row['keep_alive_s']:.0f} s with no kernel attached and no fit running)")

    def _do_attach(self, args: argparse.Namespace) -> None:
        from nbddp import api
        from nbddp.monitor.status import status_table

        status = api.attach(args.id, take_over=args.take_over)
        print(f"nbddp: attached to session {status['detached']}" + (
            "; its fit goes on: nbddp.running() is its handle" if api.running() is not None else ""))
        _show(status_table())

    def _do_sessions(self, args: argparse.Namespace) -> None:
        from nbddp import api

        _show(api.sessions())

    def _do_stop(self, args: argparse.Namespace) -> None:
        from nbddp import api

        api.stop()
        print("nbddp: workers stopped")

    def _do_restart(self, args: argparse.Namespace) -> None:
        from nbddp import api
        from nbddp.monitor.status import status_table

        api.restart()
        _show(status_table())

    def _do_status(self, args: argparse.Namespace) -> None:
        from nbddp.monitor.status import status_table

        _show(status_table())

    def _do_push(self, args: argparse.Namespace) -> None:
        from nbddp.cells.cell_code import push

        ns = self.user_ns()
        missing = [n for n in args.names if n not in ns]
        if missing:
            raise MissingName(f"%ddp push: no variable named {', '.join(map(repr, missing))} in the notebook; define "
                              "it in a cell first (push sends existing notebook variables to the workers)\n"
                              f"usage: {usage_line(_push)}")
        push(**{n: ns[n] for n in args.names})

    def _do_script(self, args: argparse.Namespace) -> None:
        from nbddp.cells.scripts import run_script

        run_script(args.path, *args.args, displays=args.displays)

    def _do_stacks(self, args: argparse.Namespace) -> None:
        from nbddp.execution.calls import UnknownRanks
        from nbddp.monitor.stacks import stacks

        try:
            _show(stacks(timeout=args.timeout, ranks=parse_targets(args.targets, _stacks)))
        except UnknownRanks as exc:
            raise misuse(_stacks, f"%ddp stacks {flag_in(args.line)} {args.targets}: {exc.detail}") from None

    def _do_debug(self, args: argparse.Namespace) -> None:
        from nbddp.debugging.conversation import NoPrompt
        from nbddp.api import clear_debug as clear, debug
        from nbddp.protocol.errors import NothingToDebug

        if args.clear:
            print(clear())
            return
        try:
            debug(args.rank)
        except (ValueError, NothingToDebug, NoPrompt) as exc:
            raise misuse(_debug, f"%ddp debug{'' if args.rank is None else f' {args.rank}'}: {exc}") from None

    def _do_pull(self, args: argparse.Namespace) -> None:
        from nbddp.cells.cell_code import pull
        from nbddp.execution.calls import UnknownRanks

        targets = parse_targets(args.targets, _pull)
        one = 0 if args.targets is None else targets  # an int: that rank's values; a list or slice: a list each
        try:
            if isinstance(one, int):
                self.user_ns().update(pull(*args.names, rank=one))
            else:  # a list, a slice, or all
                self.user_ns().update(pull(*args.names, ranks=slice(None) if targets is None else targets))
        except UnknownRanks as exc:
            raise misuse(_pull, f"%ddp pull {flag_in(args.line)} {args.targets}: {exc.detail}") from None
        except NameError as exc:
            raise MissingName(f"{exc}\nusage: {usage_line(_pull)}") from None


def flag_in(line: str, flags: tuple[str, ...] = ("--targets", "--ranks", "--rank")) -> str:
    """Which spelling of ``--targets`` the person wrote (their words in the message)."""
    return next((f for f in flags if re.search(rf"{f}(?![-\w])", line)), flags[0])


def _show(obj: object) -> None:
    from IPython.display import display

    if isinstance(obj, str):
        print(obj)
    else:
        display(obj)


def register(ipython: InteractiveShell) -> None:
    """Register ``%ddp``/``%%ddp`` and put ``dist_fit`` in the notebook's namespace."""
    from nbddp.api import dist_fit

    ipython.register_magics(DDPMagics)
    ipython.user_ns.setdefault("dist_fit", dist_fit)


def unregister(ipython: InteractiveShell) -> None:
    """Remove exactly what ``register`` added (workers keep running)."""
    from nbddp.api import dist_fit

    manager = ipython.magics_manager
    manager.registry.pop(DDPMagics.__name__, None)
    for kind in ("line", "cell"):
        bound = manager.magics[kind].get("ddp")
        if bound is not None and isinstance(getattr(bound, "__self__", None), DDPMagics):
            del manager.magics[kind]["ddp"]
    if ipython.user_ns.get("dist_fit") is dist_fit:
        del ipython.user_ns["dist_fit"]
