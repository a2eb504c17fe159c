"""``nbddp.run``: call one function on every rank and bring the results back in rank order."""

from __future__ import annotations

from typing import Any, Callable

from nbddp.shipping import pickling as shipping
from nbddp.cells.call_handle import CallHandle, start_call, unpacked
from nbddp.callbacks.fit_hooks import FitHooks
from nbddp.cells.live_lines import Drawing
from nbddp.cells.rank_displays import Displays
from nbddp.cells.rank_output import shown_for
from nbddp.cells.reported_call import RankResults, run_reporting
from nbddp.live.choice import LiveChoice
from nbddp.protocol.placement import Placement
from nbddp.session.session import Session


class Shipped:
    """``fn(*args, **kwargs)`` packed for the ranks, once per kind of worker (same host or not), and removed after."""

    def __init__(self, session: Session, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]):
        self.session, self.call = session, (fn, args, kwargs)
        self.name = getattr(fn, "__name__", "the function")
        self.parcels: dict[bool, shipping.Parcel] = {}

    def args_for(self, p: Placement) -> tuple[Any, ...]:  # packed under the session's lock
        if p.local not in self.parcels:
            self.parcels[p.local] = shipping.pack(self.call, what=f"nbddp.run({self.name}, ...)", local=p.local)
        return self.session.sources.attach(self.parcels[p.local], p), self.session.generation

    def discard(self) -> None:
        for parcel in self.parcels.values():
            parcel.discard()


def call_everywhere(session: Session, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                    output: bool = True, live: LiveChoice = None, hooks: FitHooks | None = None,
                    displays: Displays = None, drawing: Drawing | None = None) -> RankResults:
    """``fn(*args, **kwargs)`` on every rank, shipped by value; its output labelled by rank (``output``), the
    rich output of the ranks ``displays`` names, bars drawn as ``drawing`` says (``nbddp.cells.rank_output``);
    what it reports shown (``live``) and given to ``hooks``: the values in rank order, with the History
    (``.history``)."""
    from nbddp.worker.tasks.entry import call_task

    shown = shown_for(session, displays, None, "nbddp.run") if output else set()
    shipped = Shipped(session, fn, args, kwargs)
    try:
        results, history = run_reporting(session, f"nbddp.run({shipped.name})", call_task, shipped.args_for,
                                         output=True if output else None, live=live, hooks=hooks, shown=shown,
                                         drawing=drawing)
    finally:
        shipped.discard()
    values = RankResults(unpacked(results))
    values.history = history
    return values


def start_everywhere(session: Session, fn: Callable[..., Any], args: tuple[Any, ...],
                     kwargs: dict[str, Any], displays: Displays = None) -> CallHandle:
    """``run(..., block=False)``: the same call, handed back at once as a ``CallHandle`` (which keeps the output;
    ``display_outputs()`` shows the displays of the ranks ``displays`` names)."""
    from nbddp.worker.tasks.entry import call_task

    shown = shown_for(session, displays, None, "nbddp.run")
    shipped = Shipped(session, fn, args, kwargs)
    return start_call(session, f"nbddp.run({shipped.name})", call_task, shipped.args_for, cleanup=shipped.discard,
                      shown=shown)
