"""Sweeps: 8 trials with ``nbddp.sweep`` on 2 workers vs the same 8 fits one after another on 1 worker.

Workload: an MLP classifier (32 inputs, hidden width from the grid) on fixed
random data (4096 samples, 1024 with --quick), batch 64, 3 epochs (1 with
--quick), validation each epoch; the 8 trials are a grid of 4 learning
rates x 2 widths, the same for both sides. One torch thread per worker on CPU,
so each side has one core per worker.

* ``sweep``: ``nbddp.sweep(..., n_trials=8, workers_per_trial=1)`` on 2 workers;
* ``sequential``: 8 ``dist_fit`` calls on 1 worker, one after another.

Also measured: for consecutive trials on the same worker, the time from one
trial's end (its weights packed, ``timings["end_wall"]``) to the next trial's
first step (``timings["train_start_wall"]``), on the worker's clock.
Ray Tune is not compared: it is not installed here (see docs/sweeps.md).
"""

from __future__ import annotations

import sys as _sys
import time
from pathlib import Path as _Path

if __package__ in (None, ""):  # run as a file: make the repo root importable
    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402

NAME = "sweep"
LRS = [3e-4, 1e-3, 3e-3, 1e-2]
WIDTHS = [64, 128]


def make_mlp(width: int = 64):
    import torch.nn as nn

    return nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 4))


def data(n: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 32, generator=g)
    return x, (x[:, :4].argmax(1))


def run_sweep(train, val, cfg: dict) -> dict:
    import optuna

    import nbddp

    common.nbddp_start(2)
    try:
        sampler = optuna.samplers.GridSampler({"lr": LRS, "width": WIDTHS}, seed=0)
        t0 = time.perf_counter()
        result = nbddp.sweep(make_mlp, train, val_data=val, space={"lr": LRS, "width": WIDTHS}, n_trials=8,
                             sampler=sampler, live=False, **cfg)
        wall = time.perf_counter() - t0
    finally:
        common.nbddp_stop()
    return {"wall_s": wall, "states": list(result.trials["state"]), "gaps_s": gaps(result),
            "best_value": result.best_value}


def gaps(result) -> list[float]:
    """End of one trial to the first step of the next on the same worker (the worker's clock)."""
    out = []
    for group in sorted(set(result.trials["group"])):
        numbers = sorted(result.trials[result.trials["group"] == group]["trial"])
        timings = [result.histories[n].timings for n in numbers if n in result.histories]
        out += [b["train_start_wall"] - a["end_wall"] for a, b in zip(timings, timings[1:])]
    return out


def run_sequential(train, val, cfg: dict) -> dict:
    import nbddp

    common.nbddp_start(1)
    try:
        t0 = time.perf_counter()
        for lr in LRS:
            for width in WIDTHS:
                nbddp.dist_fit(lambda width=width: make_mlp(width), train, val_data=val, lr=lr, live=False, **cfg)
        return {"wall_s": time.perf_counter() - t0}
    finally:
        common.nbddp_stop()


def main(quick: bool = False, reps: int | None = None) -> dict:
    cfg = {"epochs": 1 if quick else 3, "batch_size": 64, "seed": 0}
    train, val = data(1024 if quick else 4096, 0), data(256, 1)
    reps = reps or (1 if quick else 2)
    out: dict = {"cfg": cfg, "reps": reps, "sweep": [], "sequential": []}
    for rep in range(reps):  # alternate which side goes first
        for side in (["sweep", "sequential"] if rep % 2 == 0 else ["sequential", "sweep"]):
            fn = run_sweep if side == "sweep" else run_sequential
            res = fn(train, val, cfg)
            common.log(f"[sweep] rep {rep} {side}: {res['wall_s']:.2f} s")
            out[side].append(res)
    sweep_s = common.median(r["wall_s"] for r in out["sweep"])
    seq_s = common.median(r["wall_s"] for r in out["sequential"])
    all_gaps = [g for r in out["sweep"] for g in r["gaps_s"]]
    out["summary"] = {"sweep_s": sweep_s, "sequential_s": seq_s, "speedup": common.ratio(seq_s, sweep_s),
                      "gap_median_s": common.median(all_gaps), "gap_max_s": max(all_gaps) if all_gaps else None}
    common.log(f"[sweep] {out['summary']}")
    return out


def summary_rows(res: dict) -> list[dict]:
    s = res["summary"]
    return [{"bench": NAME, "competitor": "nbddp.sweep (2 workers)", "metric": "s for 8 trials",
             "median": s["sweep_s"], "ratio": s["speedup"], "ratio_of": "sequential / sweep"},
            {"bench": NAME, "competitor": "8 x dist_fit (1 worker)", "metric": "s for 8 trials",
             "median": s["sequential_s"], "ratio": 1.0, "ratio_of": "-"},
            {"bench": NAME, "competitor": "nbddp.sweep", "metric": "trial end -> next first step (s)",
             "median": s["gap_median_s"], "ratio": None, "ratio_of": "-"}]


if __name__ == "__main__":
    common.cli(main, NAME)
