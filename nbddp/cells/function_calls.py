"""``nbddp.run``: call one function on every rank and bring the results back in rank order."""

from __future__ import annotations

from typing import Any, Callable

from nbddp.shipping import pickling as shipping
from nbddp.cells.rank_output import run_on_ranks
from nbddp.protocol.placement import Placement
from nbddp.session.session import Session


def call_everywhere(session: Session, fn: Callable[..., Any], args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> list[Any]:
    """``fn(*args, **kwargs)`` on every rank, shipped by value; its output labelled by rank."""
    from nbddp.worker.tasks.entry import call_task

    name = getattr(fn, "__name__", "the function")
    parcels: dict[bool, shipping.Parcel] = {}

    def args_for(p: Placement) -> tuple[Any, ...]:  # packed under the session's lock, once per kind of worker
        if p.local not in parcels:
            parcels[p.local] = shipping.pack((fn, args, kwargs), what=f"nbddp.run({name}, ...)", local=p.local)
        return session.sources.attach(parcels[p.local], p), session.generation

    try:
        results = run_on_ranks(session, f"nbddp.run({name})", call_task, args_for, output=True)
    finally:
        for parcel in parcels.values():
            parcel.discard()
    try:
        return [shipping.unpack(results[rank]) for rank in sorted(results)]
    finally:
        for parcel in results.values():
            parcel.discard()
