"""Engine side of ``%%ddp`` and ``%ddp push/pull/status``.

A ``%%ddp`` cell runs in ``STATE.namespace``, one dict per worker that
outlives every cell (``join_process_group`` refreshes ``rank``,
``local_rank``, ``world_size`` and ``device`` in it). The cell's source
travels as a plain string; values travel as ``shipping.Parcel``s, so classes
and functions defined in the notebook (or in an earlier cell) keep working.

Cell code runs with the engine's ordinary SIGINT behaviour: the kernel
forwards Kernel > Interrupt as SIGINT, which raises ``KeyboardInterrupt`` in
the cell like in a local Python cell.
"""

from __future__ import annotations

import ast
import builtins
import sys
from typing import Any

from nbddp.shipping import pickling as shipping
from nbddp.shipping.source_lines import register_text
from nbddp.worker.engine.figures import show_open_figures
from nbddp.worker.engine.rank_state import STATE
from nbddp.worker.memory.release import run_task
from nbddp.worker.tasks.user_task import user_task
CELL_FILENAME = "<%%ddp cell {n}>"


def _namespace() -> dict[str, Any]:
    ns = STATE.namespace
    # "__main__": classes and functions defined in cells pickle by value (cloudpickle),
    # so `%ddp pull` of an instance works in the kernel.
    ns.setdefault("__name__", "__main__")
    ns.setdefault("__builtins__", builtins)
    return ns


def run_cell(source: str, cell_number: int, generation: int, keep_value: bool = False,
             figures: bool = False) -> shipping.Parcel | None:
    """Execute ``source`` in this worker's namespace; print the last expression's value.

    Like a notebook cell: names it defines persist for later cells, and a
    final bare expression that is not ``None`` is printed (``repr``).
    ``keep_value`` (``%%ddp --noblock``): that value also comes back, packed
    (None without a final expression). ``figures``: this rank's displays are
    shown, so the figures the cell leaves open are drawn at its end
    (``nbddp/worker/engine/figures.py``); otherwise they are closed.
    """
    return run_task(_run_cell, source, cell_number, generation, keep_value, figures)


def _run_cell(source: str, cell_number: int, generation: int, keep_value: bool,
              figures: bool) -> shipping.Parcel | None:
    ns = _namespace()
    filename = CELL_FILENAME.format(n=cell_number)
    register_text(filename, source)  # tracebacks, stacks and pdb show the cell's lines
    tree = ast.parse(source, filename=filename, mode="exec")
    last = None
    final = tree.body[-1] if tree.body else None
    if isinstance(final, ast.Expr):
        tree.body.pop()
        last = ast.Expression(final.value)
    value = None
    try:
        with user_task(generation, "cell"):
            exec(compile(tree, filename, "exec"), ns)  # noqa: S102 - running the person's cell is the point
            if last is not None:
                value = eval(compile(last, filename, "eval"), ns)  # noqa: S307
                if value is not None:
                    print(repr(value))
    finally:
        try:
            show_open_figures(figures)
        except Exception as exc:  # noqa: BLE001 - a figure that cannot be drawn must not hide the cell's own error
            print(f"nbddp: could not draw the cell's figures: {type(exc).__name__}: {exc}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
    if not keep_value or last is None:
        return None
    return shipping.pack(value, what=f"the value of %%ddp cell {cell_number}", prefix=STATE.file_prefix or None,
                         local=STATE.placement.local)


def push(parcel: shipping.Parcel, generation: int | None = None) -> list[str]:
    """Put the shipped ``{name: value}`` into this worker's namespace."""
    return run_task(_push, parcel, generation)


def _push(parcel: shipping.Parcel, generation: int | None = None) -> list[str]:
    with user_task(generation, "push"):
        values = shipping.unpack(parcel)
    _namespace().update(values)
    return sorted(values)


def pull(names: list[str]) -> dict[str, Any]:
    """Pack the named variables, or say which are missing (the kernel raises)."""
    ns = _namespace()
    missing = [n for n in names if n not in ns]
    if missing:
        return {"missing": missing, "available": user_names()}
    parcel = shipping.pack({n: ns[n] for n in names}, what=f"%ddp pull {' '.join(names)}", prefix=STATE.file_prefix or None,
                           local=STATE.placement.local)
    return {"parcel": parcel}


def user_names() -> list[str]:
    """The names a person defined (no dunders, no modules)."""
    import types

    return sorted(k for k, v in STATE.namespace.items()
                  if not k.startswith("__") and not isinstance(v, types.ModuleType))
