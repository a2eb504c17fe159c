"""What ``nbddp.report`` costs: a custom DDP loop reporting every step, against the same loop without it.

On 2 workers, one run, three figures:

* ``throughput_ratio``: samples/s of a custom DDP loop (an MLP, gloo) given to
  ``nbddp.run`` that calls ``nbddp.report(step, loss=..., samples=...)``
  every step, over the same loop without the call; the two alternate, and
  each repetition's ratio is paired (same machine state), in ABBA order, and
  the median's 95 % bootstrap interval is kept (``ci95``). Goal: 0.99 or
  better. Each rank times its own loop after a warm-up, so the kernel's start
  and end of the call are not counted; the kernel draws its text view (as a
  terminal would), so its CPU is counted.
* ``latency_ms``: from a step's report on the ranks (the later rank's, the
  worker's wall clock) to the moment the kernel adds the reduced point to
  the History the live view draws (same host, same clock). Goal: median
  250 ms or less. The view's own redraw throttle (0.5-1 s) comes on top.
* ``outside_ns``: one ``nbddp.report(step, loss=x)`` call in a process where
  no nbddp task runs (what a script costs under ``torchrun``), per call,
  beside an empty function taking the same arguments.

Also kept: each rank's time inside ``report`` per call (``inside_us``), beside
the same call of a function that does nothing (``inside_noop_us``: what the
GIL and the engine's other threads cost any call there), and the machine's
load average before and after (other engineers share it).
"""

from __future__ import annotations

import os
import statistics
import sys as _sys
import time
import timeit
from pathlib import Path as _Path

if __package__ in (None, ""):  # run as a file: make the repo root importable
    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402

NAME = "report"


def ddp_loop(steps: int, warmup: int, reporting: bool) -> dict:
    """On each rank: a DDP MLP trained ``steps`` steps after ``warmup``; its samples/s and time in report."""
    import torch
    import torch.distributed as dist

    import nbddp

    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(),
        torch.nn.Linear(512, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(64, 256, generator=g), torch.randint(0, 10, (64,), generator=g)
    def noop(step=None, *, reduce="mean", **metrics):  # the same call to a function that does nothing
        return None

    in_report = in_noop = 0.0
    t0 = 0.0
    for step in range(warmup + steps):
        if step == warmup:
            t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if reporting:
            r0 = time.perf_counter()
            nbddp.report(step, loss=loss.detach(), samples=64)
            r1 = time.perf_counter()
            noop(step, loss=loss.detach(), samples=64)
            in_report += r1 - r0
            in_noop += time.perf_counter() - r1
    took = time.perf_counter() - t0
    return {"samples_per_s": steps * 64 / took, "in_report_s": in_report, "in_noop_s": in_noop,
            "reports": warmup + steps if reporting else 0}


def arrivals() -> tuple[list[float], object]:
    """Record, for every reduced point, how long after its last rank's report the kernel took it in."""
    from nbddp.cells import reported_call

    seen: list[float] = []
    real = reported_call.ReportedRun._take

    def take(self, reduced, per_rank):
        now = time.time()
        t0 = self.collector.t0
        real(self, reduced, per_rank)
        if t0 is None:
            t0 = self.collector.t0
        seen.extend(now - (t0 + r["time"]) for r in reduced)

    reported_call.ReportedRun._take = take
    return seen, real


def median_ci(values: list[float], draws: int = 2000) -> list[float] | None:
    """A 95 % bootstrap interval of the median of ``values`` (seeded: the same values give the same interval).

    Pairs on this machine spread by tens of per cent either way, so the
    median alone cannot tell 0.99 from 0.97: the interval says how far it can
    be trusted.
    """
    import random

    if len(values) < 5:
        return None
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    return [medians[int(0.025 * draws)], medians[int(0.975 * draws) - 1]]


def outside_cost(calls: int) -> dict:
    """ns per call of nbddp.report where no nbddp task runs, and of an empty function with the same arguments."""
    import nbddp

    def empty(step=None, *, reduce="mean", **metrics):
        return None

    report = nbddp.report
    best_report = min(timeit.repeat(lambda: report(3, loss=0.5), number=calls, repeat=5)) / calls
    best_empty = min(timeit.repeat(lambda: empty(3, loss=0.5), number=calls, repeat=5)) / calls
    return {"report_ns": best_report * 1e9, "empty_function_ns": best_empty * 1e9, "calls": calls}


def main(quick: bool = False, reps: int | None = None) -> dict:
    import nbddp
    from nbddp.cells import reported_call

    reps = reps or (1 if quick else 10)  # many short pairs: on a shared machine the noise averages out
    steps, warmup = (60, 10) if quick else (300, 30)
    out: dict = {"reps": reps, "steps": steps, "warmup": warmup, "load_before": os.getloadavg()}
    common.nbddp_start(2)
    seen, real = arrivals()
    raw: dict[str, list[dict]] = {"report": [], "plain": []}
    try:
        for rep in range(reps):
            for mode in ("plain", "report") if rep % 2 == 0 else ("report", "plain"):  # ABBA: no order bias
                ranks = nbddp.run(ddp_loop, steps, warmup, mode == "report", live="text")
                raw[mode].append({"samples_per_s": sum(r["samples_per_s"] for r in ranks),
                                  "in_report_us": [1e6 * r["in_report_s"] / max(r["reports"], 1) for r in ranks],
                                  "in_noop_us": [1e6 * r["in_noop_s"] / max(r["reports"], 1) for r in ranks]})
    finally:
        reported_call.ReportedRun._take = real
        common.nbddp_stop()
    ratios = [r["samples_per_s"] / p["samples_per_s"] for r, p in zip(raw["report"], raw["plain"])]
    out["raw"] = raw
    out["throughput_ratio"] = {"median": common.median(ratios), "ci95": median_ci(ratios), "each": ratios}
    out["latency_ms"] = {"median": common.median(1e3 * s for s in seen), "max": 1e3 * max(seen) if seen else None,
                         "points": len(seen)}
    out["inside_us"] = common.median(v for r in raw["report"] for v in r["in_report_us"])
    out["inside_noop_us"] = common.median(v for r in raw["report"] for v in r["in_noop_us"])
    out["outside_ns"] = outside_cost(20_000 if quick else 1_000_000)
    out["load_after"] = os.getloadavg()
    return out


def summary_rows(res: dict) -> list[dict]:
    return [
        {"bench": "report", "competitor": "report every step", "metric": "samples/s",
         "median": common.median(r["samples_per_s"] for r in res["raw"]["report"]),
         "ratio": res["throughput_ratio"]["median"], "ratio_of": "x no report (paired)"},
        {"bench": "report", "competitor": "report -> kernel", "metric": "latency ms",
         "median": res["latency_ms"]["median"]},
        {"bench": "report", "competitor": "outside nbddp", "metric": "ns per call",
         "median": res["outside_ns"]["report_ns"]},
    ]


if __name__ == "__main__":
    common.cli(main, NAME)
