"""``nbddp.kept()``: the models ``dist_fit(keep=...)`` left on the ranks, as every rank says.

Asked of the ranks each time (they are the truth: a ``%%ddp`` cell may have
rebound or deleted a name), so it is as right after ``nbddp.attach()`` in a
new kernel as in the kernel that ran the fit.
"""

from __future__ import annotations

from typing import Any

from nbddp.session.session import Session


def kept_models(session: Session) -> list[dict[str, Any]]:
    """One dict per name every rank keeps: ``name``, ``strategy`` (``"module"``, ``"fsdp"``, ``"pipeline"``,
    ``"tensor"``), ``precision``, ``ranks_per_copy`` and ``params``: the whole model's (a sharded parameter counts
    its whole size; a pipeline's stages are summed over one copy)."""
    from nbddp.execution.calls import call_on_ranks
    from nbddp.worker.tasks.predict import kept_models as on_rank

    held = call_on_ranks(session, "nbddp.kept()", on_rank, lambda p: (session.generation,)).wait()
    by_name: dict[str, list[dict[str, Any]]] = {}
    for rank in sorted(held):
        for entry in held[rank]:
            by_name.setdefault(entry["name"], []).append(entry)
    out = []
    for name, entries in by_name.items():
        if len(entries) != len(held):
            continue  # not on every rank (one rank's name was rebound): predict could not run it
        first = entries[0]
        params = first["local_params"]  # (DTensor parameters of FSDP and tensor parallel count their whole size)
        if first["kind"] == "pipeline":  # each stage rank holds its layers: one copy's ranks hold them all
            params = sum(e["local_params"] for e in entries) // max(1, len(entries) // first["mp"])
        out.append({"name": name, "strategy": first["kind"], "precision": first["precision"] or "32-true",
                    "ranks_per_copy": first["mp"], "params": params})
    return out
