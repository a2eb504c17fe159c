"""What a finished fit's ``History`` says of its ranks and of where its time went, put together in the kernel.

``rank_rows`` joins where each rank ran (the kernel knows) with what it
measured (rank 0's last reduction) and its own time split; ``fit_timings``
splits the call's wall time into shipping, set-up, training, the weights'
way back and what the kernel added (``overhead_s``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable

from nbddp.fit.preflight import FitPlan
from nbddp.shipping import pickling as shipping
from nbddp.profiling.time_split import split_ranks
from nbddp.protocol.messages import FitResult, RankInfo

if TYPE_CHECKING:
    from torch.nn import Module


def load_weights(model: Module | None, factory: Callable[[], Module] | None, parcel: shipping.Parcel) -> Module:
    """Into the notebook's own ``model`` (or one built from ``factory``); else the trained module itself.

    Also how a kernel that attached takes a fit's weights (``handle.result(into=model)``).
    """
    target = model
    if target is None and factory is not None:
        target = factory()
    if target is None:
        return shipping.unpack(parcel)
    state = shipping.unpack(parcel, copy=False)
    target.load_state_dict(state)
    del state
    return target


def rank_rows(head: FitResult, results: dict[int, FitResult], placements: list[RankInfo]) -> list[dict[str, Any]]:
    """One dict per rank: where it ran, what it measured (rank 0's last reduction), and its time split (from its own
    result: the time after the last reduction included)."""
    figures = {r["rank"]: r for r in head.ranks}
    splits = split_ranks([results[p.rank].phase_s if p.rank in results else {} for p in placements])
    rows = [{"rank": p.rank, "host": p.host, "device": p.device,
             **{k: v for k, v in figures.get(p.rank, {}).items() if k not in ("rank", "phase_s")},
             "time_split": split}
            for p, split in zip(placements, splits)]
    for row in rows:  # what this fit added, whatever earlier work left resident (the order of fits cancels out)
        if "peak_mem" in row and "base_mem" in row:
            row["fit_peak_mem"] = row["peak_mem"] - row["base_mem"]
    return rows


def fit_timings(plan: FitPlan, head: FitResult, t0: float, loaded: float, started_at: float,
                local: bool) -> dict[str, float]:
    """``History.timings``: ``t0`` when the kernel began reading the weights, ``loaded`` when they were in the
    model, ``started_at`` when the call began shipping (``time.perf_counter``); ``local``: rank 0 shares the
    kernel's clock."""
    worker = head.timings
    timings: dict[str, float] = {
        "ship_s": plan.ship_s,
        "setup_s": worker["setup_s"],
        "train_s": worker["train_s"],
        "publish_s": worker.get("publish_s", 0.0),  # of train_s: rank 0 streaming records to the kernel
        # from rank 0's last step to the weights in the notebook's model: same clock on one host
        "return_s": (time.time() - worker["end_wall"]) if local else worker.get("pack_s", 0.0) + loaded - t0,
        "pack_s": worker.get("pack_s", 0.0),  # rank 0 writing the weights out
        "load_s": loaded - t0,  # the kernel reading them into the model
        "total_s": loaded - started_at,
        **{k: worker[k] for k in ("snapshot_s", "snapshots", "snapshot_write_s", "snapshot_wait_s",
                                  "snapshot_copy_s", "snapshot_copy_bytes") if k in worker},  # an elastic fit's snapshots
        # rank 0 waiting for the synchronous callbacks (on_epoch_end): seconds, and how many points
        **{k: worker[k] for k in ("answer_wait_s", "answer_points") if k in worker},
    }
    timings["overhead_s"] = timings["total_s"] - timings["train_s"]
    return timings
