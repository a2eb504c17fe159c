"""The kernel's half of ``%%ddp`` and ``%ddp push/pull``, callable from Python too.

``run_cell(code)`` is what ``%%ddp`` runs: the code goes to every rank (or
the ``ranks`` given) as a string and runs in a namespace that persists on
that rank, with ``rank``, ``local_rank``, ``world_size`` and ``device``
defined and the process group ready. Output comes back labelled
``[rank N]``; a failing rank raises ``WorkerError`` at once; interrupts
follow ``nbddp.execution.calls.RankCall``.
"""

from __future__ import annotations

import ast
import itertools
from typing import Any

from nbddp.shipping import pickling as shipping
from nbddp.cells.call_handle import CallHandle, start_call
from nbddp.execution.handle import check_block
from nbddp.cells.rank_displays import Displays
from nbddp.cells.rank_output import run_on_ranks, shown_for
from nbddp.cells.reported_call import hooks_for, run_reporting
from nbddp.live.choice import LiveChoice
from nbddp.execution.calls import Targets
from nbddp.protocol.placement import Placement
from nbddp.session.session import get_session
from nbddp.shipping.source_lines import register_text

_CELL_NUMBERS = itertools.count(1)


def run_cell(code: str, ranks: Targets = None, *, stream: bool = True, block: bool = True, loggers: Any = None,
             callbacks: Any = None, live: LiveChoice = None, displays: Displays = None) -> CallHandle | None:
    """Run ``code`` on every rank (or ``ranks``), as ``%%ddp`` does; print each rank's output labelled.

    Args:
        code: Python source, as in a notebook cell; names it defines stay
            defined on each rank for later cells; a final expression's value
            is printed.
        ranks: run on these ranks only: a list (``[0, 2]``), one rank, or a
            slice of them (``slice(None, None, 2)``: every other rank);
            negative ranks count from the end.
        stream: print output as it arrives; ``False`` prints it grouped by
            rank when the cell ends.
        block: ``False`` returns a ``CallHandle`` at once (``%%ddp
            --noblock``): its ``result()`` is each rank's final expression's
            value (None without one), in rank order; what the ranks print is
            kept on it (``display_outputs()``).
        loggers, callbacks: as ``dist_fit``'s, fed what the cell reports
            (``nbddp.report``), from the kernel (``%%ddp --hooks NAME``).
        live: the view of what the cell reports (``live=`` as everywhere);
            nothing shows for a cell that reports nothing.
        displays: whose rich output (figures, HTML, widgets' snapshots) is
            shown under the cell: by default the lowest rank it runs on
            (rank 0); a rank, a list of ranks, ``"all"`` or ``"none"``
            (``%%ddp --displays``). Figures a cell leaves open are shown at
            its end on those ranks, as a notebook's inline backend does.

    Raises:
        SyntaxError: before any rank runs.
        WorkerError: a rank raised (the first one; the others are listed).
    """
    from nbddp.worker.tasks.cells import CELL_FILENAME
    from nbddp.worker.tasks.cells import run_cell as remote_cell

    if not isinstance(code, str):
        raise TypeError(f"run_cell(code=...) takes the cell's source as a str, got {type(code).__name__}")
    check_block(block, "run_cell")
    number = next(_CELL_NUMBERS)
    filename = CELL_FILENAME.format(n=number)
    ast.parse(code, filename=filename)  # a SyntaxError is raised here, before any rank runs
    register_text(filename, code)  # nbddp.stacks() and the debugger show its lines
    s = get_session()
    shown = shown_for(s, displays, ranks, "run_cell")

    def shows(p: Placement) -> bool:  # a rank whose displays are shown draws the figures left open at the end
        return shown is None or p.rank in shown

    if not block:
        return start_call(s, "%%ddp cell", remote_cell, lambda p: (code, number, s.generation, True, shows(p)),
                          ranks, shown=shown)
    hooks = hooks_for(loggers, callbacks)
    run_reporting(s, "%%ddp cell", remote_cell, lambda p: (code, number, s.generation, False, shows(p)), ranks,
                  output=stream, live=live, hooks=hooks, shown=shown)
    return None


def push(**values: Any) -> None:
    """Put ``name=value`` pairs into every rank's ``%%ddp`` namespace (by value, like ``dist_fit``'s arguments)."""
    from nbddp.worker.tasks.cells import push as remote_push

    if not values:
        raise TypeError("push() needs at least one name=value pair, e.g. nbddp.push(config=config)")
    s = get_session()
    what = f"%ddp push {' '.join(values)}"
    parcels: dict[bool, shipping.Parcel] = {}

    def args_for(p: Placement) -> tuple[Any, ...]:
        if p.local not in parcels:
            parcels[p.local] = shipping.pack(values, what=what, local=p.local)
        return s.sources.attach(parcels[p.local], p), s.generation

    try:
        run_on_ranks(s, what, remote_push, args_for)
    finally:
        for parcel in parcels.values():
            parcel.discard()


def pull(*names: str, rank: int = 0, ranks: Targets = None) -> dict[str, Any]:
    """``{name: value}`` copied from ``rank``'s ``%%ddp`` namespace into the notebook.

    ``ranks`` (a list, a slice or one rank, as ``run_cell`` takes them):
    from each of these ranks instead, ``{name: [value on each rank, in rank
    order]}``, as ipyparallel's ``DirectView.pull`` gives them.

    Raises:
        NameError: a name is not defined on a rank (the message lists those that are).
    """
    from nbddp.worker.tasks.cells import pull as remote_pull

    if not names or not all(isinstance(n, str) for n in names):
        raise TypeError(f"pull() takes the variable names as strings, e.g. nbddp.pull('model', rank=0); got {names!r}")
    s = get_session()
    what = f"%ddp pull {' '.join(names)}"
    replies = run_on_ranks(s, what, remote_pull, lambda p: (list(names),), [rank] if ranks is None else ranks)
    for r, reply in sorted(replies.items()):
        if "missing" in reply:
            for other in replies.values():
                if "parcel" in other:
                    other["parcel"].discard()
            available = ", ".join(reply["available"]) or "none yet"
            raise NameError(f"%ddp pull: rank {r} has no variable named {', '.join(map(repr, reply['missing']))}; "
                            f"the names defined there are: {available}. Define it in a %%ddp cell first.")
    try:
        values = [shipping.unpack(replies[r]["parcel"]) for r in sorted(replies)]
    finally:
        for reply in replies.values():
            reply["parcel"].discard()
    if ranks is None:
        return values[0]
    return {name: [v[name] for v in values] for name in names}
