"""Sweeps: 8 trials with ``nbddp.sweep`` on 2 workers vs the same 8 fits one after another on 1 worker.

Workload: an MLP classifier (32 inputs, hidden width from the grid) on fixed
random data (4096 samples, 512 with --quick), batch 64, 3 epochs (1 with
--quick), validation each epoch; the 8 trials are a grid of 4 learning
rates x 2 widths (--quick: 2 x 2), the same for both sides. One torch thread per worker on CPU,
so each side has one core per worker. Each side's workers are warmed by a
2-step fit before the clock (``warm_up``).

* ``sweep``: ``nbddp.sweep(..., n_trials=8, workers_per_trial=1)`` on 2 workers, no pruner (Optuna's
  ``NopPruner``), so that it trains exactly the steps the sequential side does (``steps`` in each side's figures;
  until 2026-12-03 15:20 the sweep ran with Optuna's default ``MedianPruner``, which pruned a trial in most runs);
* ``sequential``: 8 ``dist_fit`` calls on 1 worker, one after another.

The test suite's smoke run (``run_all.run(quick=True, reuse_workers=True)``)
keeps its 2 warm workers for both sides, so that it starts none: there the
sequential side is DDP on 2 workers, no baseline, and its row says so; the
figures come from a run of this file.

Also measured: for consecutive trials on the same worker, the time from one
trial's end (``timings["end_wall"]``, before its weights are packed) to the
next trial's first step (``timings["train_start_wall"]``), and its parts
(``PARTS``: the worker's and the kernel's wall clocks, one host).
Ray Tune (``sweep_ray.py``), when importable: the same trials with ``tune.Tuner`` on ``ray.init(num_cpus=2)``,
its start-up timed apart; skipped, with the reason printed and recorded, where Ray is absent or does not start.
"""

from __future__ import annotations

import os
import sys as _sys
import time
from pathlib import Path as _Path

if __package__ in (None, ""):  # run as a file: make the repo root importable
    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

from benchmarks import common, cpu_tree  # noqa: E402

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


def warm_up(train) -> None:
    """One 2-step fit before the clock, on every worker: a worker's first fit imports what training needs (torch's
    dynamo among them: seconds, more under load), once per process, on both sides alike; the figures compare what
    the trials cost on warm workers, which is what a notebook that has trained before has."""
    import nbddp

    nbddp.dist_fit(make_mlp, train, max_steps=2, batch_size=64, live=False)


def torch_threads() -> list[int]:
    """Each worker's torch intra-op threads: the same on both sides (one per worker), so a core each."""
    import nbddp

    return nbddp.run(_threads)


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def run_sweep(train, val, cfg: dict, lrs: list[float]) -> dict:
    import optuna

    import nbddp

    start_s = common.nbddp_start(2)
    try:
        t0 = time.perf_counter()
        warm_up(train)
        warm_s = time.perf_counter() - t0
        threads = torch_threads()
        sampler = optuna.samplers.GridSampler({"lr": lrs, "width": WIDTHS}, seed=0)
        cpu0 = cpu_tree.snapshot()
        t0 = time.perf_counter()
        result = nbddp.sweep(make_mlp, train, val_data=val, space={"lr": lrs, "width": WIDTHS},
                             n_trials=len(lrs) * len(WIDTHS), sampler=sampler, pruner=optuna.pruners.NopPruner(),
                             live=False, **cfg)
        wall = time.perf_counter() - t0
        cpu = cpu_tree.spent(cpu0, cpu_tree.snapshot())
    finally:
        common.nbddp_stop()
    return {"wall_s": wall, "states": list(result.trials["state"]), "gaps_s": gaps(result),
            "best_value": result.best_value, "start_s": start_s, "warm_s": warm_s, "cpu_s": cpu,
            "torch_threads": threads, "steps": int(sum(h.last_step for h in result.histories.values())),
            "tail_idle_s": tail_idle(result)}


def tail_idle(result) -> float | None:
    """How long one group sat idle at the end, with no trial left to take, while the other ran its last one: the
    trials' unequal sizes (width 128 costs about 3x width 64), not overhead; it explains a run's ratio."""
    ends = [max(result.histories[n].timings.get("end_wall", 0.0) for n in result.trials[result.trials["group"] == g]
                ["trial"] if n in result.histories) for g in sorted(set(result.trials["group"]))]
    return max(ends) - min(ends) if len(ends) > 1 else None


PARTS = (  # the gap from one trial's end to the next one's first step on the same worker, in order (History.timings)
    ("pack_and_free", "end_wall", "returned_wall"),  # the worker packs the weights, gives memory back
    ("to_kernel", "returned_wall", "seen_wall"),  # the result travels; the kernel's poll sees it
    ("settle", "seen_wall", "settled_wall"),  # History, study.tell, the best weights copied
    ("schedule", "settled_wall", "ask_wall"),  # the schedule's loop reaches the free group
    ("ask_and_send", "ask_wall", "sent_wall"),  # study.ask, the trial's config, apply_async
    ("to_worker", "sent_wall", "task_start_wall"),  # the task travels to the engine and starts
    ("setup", "task_start_wall", "train_start_wall"),  # unpack, build the model and loaders, wrap, agree
)


def gaps(result) -> list[dict]:
    """End of one trial to the first step of the next on the same worker, and its parts (wall clocks of one host)."""
    out = []
    for group in sorted(set(result.trials["group"])):
        numbers = sorted(result.trials[result.trials["group"] == group]["trial"])
        timings = [result.histories[n].timings for n in numbers if n in result.histories]
        for a, b in zip(timings, timings[1:]):
            both = {**{k: a[k] for k in ("end_wall", "returned_wall", "seen_wall", "settled_wall") if k in a},
                    **{k: b[k] for k in ("ask_wall", "sent_wall", "task_start_wall", "train_start_wall") if k in b}}
            gap = {"total": b["train_start_wall"] - a["end_wall"]}
            gap.update({name: both[end] - both[begin] for name, begin, end in PARTS if begin in both and end in both})
            out.append(gap)
    return out


def gap_parts(all_gaps: list[dict]) -> dict:
    """The median of each part over every gap measured."""
    return {name: common.median(g[name] for g in all_gaps if name in g) for name, _, _ in PARTS}


def run_sequential(train, val, cfg: dict, lrs: list[float], smoke: bool = False) -> dict:
    """The same fits one after another on 1 worker; ``smoke`` (--quick in the test suite's run, which keeps its
    workers): on the running workers instead, so that the smoke run starts none (the figure is then no baseline)."""
    import nbddp

    if not smoke:
        common.nbddp_start(1)
    workers = nbddp.status()["world_size"]
    try:
        warm_up(train)
        threads = torch_threads()
        cpu0 = cpu_tree.snapshot()
        t0 = time.perf_counter()
        steps = 0
        for lr in lrs:
            for width in WIDTHS:
                h = nbddp.dist_fit(lambda width=width: make_mlp(width), train, val_data=val, lr=lr, live=False, **cfg)
                steps += h.last_step
        wall = time.perf_counter() - t0
        return {"wall_s": wall, "workers": workers, "cpu_s": cpu_tree.spent(cpu0, cpu_tree.snapshot()),
                "torch_threads": threads, "steps": steps}
    finally:
        common.nbddp_stop()


def main(quick: bool = False, reps: int | None = None) -> dict:
    cfg = {"epochs": 1 if quick else 3, "batch_size": 64, "seed": 0}
    train, val = data(512 if quick else 4096, 0), data(128 if quick else 256, 1)
    lrs = LRS[:2] if quick else LRS  # --quick: 4 trials
    reps = reps or (1 if quick else 2)
    out: dict = {"cfg": cfg, "reps": reps, "trials": len(lrs) * len(WIDTHS), "sweep": [], "sequential": []}
    # alternate which side goes first; the smoke run (--quick, workers kept) starts no worker: the sweep on the
    # running 2, the sequential side on them too
    smoke = quick and common.REUSE_WORKERS and nbddp_running() == 2
    for rep in range(reps):
        for side in (["sweep", "sequential"] if rep % 2 == 0 else ["sequential", "sweep"]):
            res = run_sweep(train, val, cfg, lrs) if side == "sweep" else run_sequential(train, val, cfg, lrs, smoke)
            res["load_1min"] = os.getloadavg()[0]  # the machine's load as this side ended (2 cores here)
            roles = {k: round(v, 2) for k, v in res["cpu_s"]["roles"].items()} if res.get("cpu_s") else {}
            common.log(f"[sweep] rep {rep} {side}: {res['wall_s']:.2f} s (load {res['load_1min']:.2f}), CPU s {roles}")
            out[side].append(res)
    sweep_s = common.median(r["wall_s"] for r in out["sweep"])
    seq_s = common.median(r["wall_s"] for r in out["sequential"])
    all_gaps = [g for r in out["sweep"] for g in r["gaps_s"]]
    totals = [g["total"] for g in all_gaps]
    out["summary"] = {"sweep_s": sweep_s, "sequential_s": seq_s, "speedup": common.ratio(seq_s, sweep_s),
                      # each rep's sides ran back to back: their ratio is the figure least moved by other load
                      "paired_speedups": [common.ratio(q["wall_s"], w["wall_s"])
                                          for q, w in zip(out["sequential"], out["sweep"])],
                      "pruned": [r["states"].count("pruned") for r in out["sweep"]],  # 0: no pruner (NopPruner)
                      "steps": {side: [r.get("steps") for r in out[side]] for side in ("sweep", "sequential")},
                      "load_1min": [r["load_1min"] for side in ("sweep", "sequential") for r in out[side]],
                      "gap_median_s": common.median(totals) if totals else None,
                      "gap_max_s": max(totals) if totals else None,
                      "gap_parts_median_s": gap_parts(all_gaps) if all_gaps else {},
                      "cpu_per_trial_s": cpu_per_trial(out, len(lrs) * len(WIDTHS)),
                      "tail_idle_s": [r.get("tail_idle_s") for r in out["sweep"]]}
    if not quick:  # the smoke run leaves these out: Ray's start-up alone is longer than the whole quick run
        from benchmarks import machine_ceiling

        out["machine"] = machine_ceiling.measure(reps=reps)  # what 2 plain processes get from this machine, now
        out["summary"]["machine_ceiling"] = out["machine"]["ceiling"]
        out["summary"]["speedup_of_ceiling"] = common.ratio(out["summary"]["speedup"], out["machine"]["ceiling"])
        out["ray"] = ray_side(train, val, cfg, lrs, reps)
        out["summary"].update(ray_summary(out))
    common.log(f"[sweep] {out['summary']}")
    return out


def cpu_per_trial(out: dict, trials: int) -> dict:
    """Each side's median CPU seconds per trial by role (``cpu_tree``): the kernel, the controller, the engines
    (training included) and the engines' threads other than the training one. With 2 busy workers on 2 cores, what
    the kernel, controller and side threads use is taken from training; the 1-worker side gets it from the idle
    core."""
    per = {}
    for side in ("sweep", "sequential"):
        runs = [r["cpu_s"] for r in out[side] if r.get("cpu_s")]
        if runs:
            roles = {name for c in runs for name in c["roles"]} | {"engine_side_threads"}
            per[side] = {name: common.median((c["roles"].get(name, 0.0) if name != "engine_side_threads" else
                                              c["engine_side_threads"]) / trials for c in runs) for name in roles}
    return per


def ray_side(train, val, cfg: dict, lrs: list[float], fits: int) -> dict:
    """The same trials with Ray Tune (``sweep_ray``), or why not: Ray absent, or failing to start here."""
    from benchmarks import sweep_ray

    reason = sweep_ray.available()
    if reason is None:
        try:
            res = sweep_ray.run(train, val, cfg, lrs, WIDTHS, fits)
            res["load_1min"] = os.getloadavg()[0]
            common.log(f"[sweep] Ray Tune: init {res['init_s']:.2f} s, fits {[round(t, 2) for t in res['fits_s']]} s "
                       f"(load {res['load_1min']:.2f})")
            return res
        except Exception as exc:  # noqa: BLE001 - the nbddp figures stand; the Ray side says why it has none
            reason = f"Ray Tune failed here: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    common.log(f"[sweep] Ray Tune side skipped: {reason}")
    return {"skipped": reason}


def ray_summary(out: dict) -> dict:
    """Ray against the sweep, warm (the trials alone) and cold (start-up and the first trials included)."""
    ray = out["ray"]
    if "skipped" in ray:
        return {"ray_skipped": ray["skipped"]}
    sweep_s = out["summary"]["sweep_s"]
    later = ray["fits_s"][1:] or ray["fits_s"]
    cold_nbddp = common.median(r["start_s"] + r["warm_s"] + r["wall_s"] for r in out["sweep"])
    cold_ray = ray["init_s"] + ray["fits_s"][0]
    return {"ray_init_s": ray["init_s"], "ray_first_fit_s": ray["fits_s"][0], "ray_fit_s": common.median(later),
            "nbddp_start_s": common.median(r["start_s"] for r in out["sweep"]),
            "nbddp_warm_up_s": common.median(r["warm_s"] for r in out["sweep"]),
            "ray_over_sweep_warm": common.ratio(common.median(later), sweep_s),
            "ray_over_sweep_cold": common.ratio(cold_ray, cold_nbddp)}


def nbddp_running() -> int:
    import nbddp

    status = nbddp.status()
    return status["world_size"] if status["running"] else 0


def summary_rows(res: dict) -> list[dict]:
    s, n = res["summary"], res["trials"]
    seq_workers = res["sequential"][0].get("workers", 1) if res["sequential"] else 1
    return [{"bench": NAME, "competitor": "nbddp.sweep (2 workers)", "metric": f"s for {n} trials",
             "median": s["sweep_s"], "ratio": s["speedup"], "ratio_of": "sequential / sweep"},
            {"bench": NAME, "competitor": f"{n} x dist_fit ({seq_workers} worker{'s' * (seq_workers > 1)})",
             "metric": f"s for {n} trials",
             "median": s["sequential_s"], "ratio": 1.0, "ratio_of": "-"},
            {"bench": NAME, "competitor": "nbddp.sweep", "metric": "trial end -> next first step (s)",
             "median": s["gap_median_s"], "ratio": None, "ratio_of": "-"}] + ray_rows(res)


def ray_rows(res: dict) -> list[dict]:
    s, n = res["summary"], res["trials"]
    if "ray_fit_s" not in s:
        return []
    return [{"bench": NAME, "competitor": "Ray Tune (2 CPUs), warm", "metric": f"s for {n} trials",
             "median": s["ray_fit_s"], "ratio": s["ray_over_sweep_warm"], "ratio_of": "ray / sweep"},
            {"bench": NAME, "competitor": "Ray Tune: ray.init + first fit", "metric": f"s for {n} trials, cold",
             "median": s["ray_init_s"] + s["ray_first_fit_s"], "ratio": s["ray_over_sweep_cold"],
             "ratio_of": "ray / (nbddp.start + warm-up + sweep)"}]


if __name__ == "__main__":
    common.cli(main, NAME)
