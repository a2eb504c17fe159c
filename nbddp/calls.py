"""``nbddp.run``: call one function on every rank and bring the results back in rank order."""

from __future__ import annotations

from typing import Any, Callable

from nbddp import shipping
from nbddp.jobs import Job
from nbddp.output import RankOutput


def call_everywhere(session: Any, fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> list[Any]:
    """``fn(*args, **kwargs)`` on every rank, shipped by value; its output labelled by rank."""
    from nbddp.worker.entry import call_task

    name = getattr(fn, "__name__", "the function")
    parcels: dict[bool, shipping.Parcel] = {}
    session.ensure_started()
    job = Job(session, f"nbddp.run({name})")
    try:
        with session.lock:
            session.ensure_ready()
            for local in {p.local for p in session.placements}:
                parcels[local] = shipping.pack((fn, args, kwargs), what=f"nbddp.run({name}, ...)", local=local)
            job.launch(lambda p: session.client[p.engine_id].apply_async(call_task, parcels[p.local],
                                                                       session.generation))
        output = RankOutput(job.tasks.ars)
        try:
            results = job.wait(on_tick=output.tick)
        finally:
            output.finish(job.tasks)
    finally:
        for parcel in parcels.values():
            parcel.discard()
    try:
        return [shipping.unpack(results[rank]) for rank in sorted(results)]
    finally:
        for parcel in results.values():
            parcel.discard()
