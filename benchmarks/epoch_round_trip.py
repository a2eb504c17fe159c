"""What a synchronous ``on_epoch_end`` costs a fit: one round trip to the kernel per epoch (issue 37).

A fit of ``epochs`` short epochs, alternately with a callback that defines
``on_epoch_end`` (the ranks wait at every epoch end for the kernel's answer)
and with one that defines only ``on_record`` (no wait; the kernel's hooks
thread runs all the same, so the two differ only in the waits). The round
trip per epoch is measured two ways: directly, as rank 0's time from
publishing the epoch's record to having the answer broadcast
(``History.timings["answer_wait_s"] / ["answer_points"]``), and as the
difference of the workers' training time (``train_s``, which holds the
waits) divided by the epochs: medians of paired rounds (the second is
noisier on a loaded machine).
"""

from __future__ import annotations

import statistics
from typing import Any


class EpochEnds:
    """Synchronous: the ranks wait for this hook at every epoch end."""

    def __init__(self) -> None:
        self.epochs = 0

    def on_epoch_end(self, record: Any) -> None:
        self.epochs += 1


class RecordsOnly:
    """Asynchronous only: the ranks never wait."""

    def __init__(self) -> None:
        self.records = 0

    def on_record(self, record: Any) -> None:
        self.records += 1


def _fit(callback: Any, data: Any, epochs: int) -> dict[str, float]:
    import torch
    import torch.nn.functional as F

    import nbddp

    torch.manual_seed(0)
    h = nbddp.dist_fit(torch.nn.Linear(8, 1), data, epochs=epochs, batch_size=8, loss_fn=F.mse_loss,
                       optimizer=torch.optim.SGD, lr=0.01, live=False, log_every=10 ** 6, callbacks=[callback])
    if h.status != "completed" or len(h.epochs) != epochs:
        raise RuntimeError(f"the round-trip fit ended {h.status} after {len(h.epochs)} of {epochs} epochs")
    return h.timings


def measure(reps: int = 5, epochs: int = 20) -> dict[str, Any]:
    """Median per-epoch round trip (ms) over ``reps`` paired fits; the fits' own figures too."""
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)  # 2 ranks x batch 8: 4 steps an epoch, so the waits dominate the difference
    data = (x, x.sum(1, keepdim=True))
    _fit(EpochEnds(), data, 2)  # warm-up: both paths once
    _fit(RecordsOnly(), data, 2)
    synced: list[dict[str, float]] = []
    free: list[dict[str, float]] = []
    for r in range(reps):
        pair = [(synced, EpochEnds), (free, RecordsOnly)]
        for out, make in (pair if r % 2 == 0 else pair[::-1]):
            out.append(_fit(make(), data, epochs))
    if any("answer_points" in t for t in free) or not all(t.get("answer_points") == epochs for t in synced):
        raise RuntimeError("the synchronous fits did not wait at every epoch end, or the others waited")
    waits = [t["answer_wait_s"] / t["answer_points"] * 1e3 for t in synced]
    per_epoch = [(s["train_s"] - f["train_s"]) / epochs * 1e3 for s, f in zip(synced, free)]
    free_s = statistics.median(t["train_s"] for t in free)
    return {"reps": reps, "epochs": epochs, "steps_per_epoch": 4,
            "round_trip_ms": statistics.median(waits), "round_trip_ms_all": waits,
            "train_s_difference_ms": statistics.median(per_epoch), "train_s_difference_ms_all": per_epoch,
            "train_s_synced": statistics.median(t["train_s"] for t in synced), "train_s_free": free_s,
            "epoch_ms_free": free_s / epochs * 1e3}


def rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    """One summary row: the round trip, and its share of an epoch of this tiny fit."""
    return [{"bench": "latency/epoch", "competitor": "synchronous on_epoch_end", "metric": "ms/epoch round trip",
             "median": res["round_trip_ms"], "ratio": res["round_trip_ms"] / res["epoch_ms_free"],
             "ratio_of": f"x an epoch of {res['steps_per_epoch']} steps without it"}]
