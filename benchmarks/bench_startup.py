"""Worker start-up: ``nbddp.start(n=2)`` until ready vs plain ipyparallel.

Competitors, alternating, 3 repetitions (1 with --quick):

* ``nbddp``: ``nbddp.start(n=2)`` until it returns (workers ready for
  dist_fit), then ``nbddp.stop()`` (timed separately).
* ``ipp``: ``ipp.Cluster(n=2).start_and_connect_sync()`` (controller + 2
  engines registered), then ``cluster.stop_cluster_sync()``.
* ``ipp+torch``: the same plus ``import torch`` on both engines, a closer
  like-for-like to what nbddp must do before it can train. With --quick one
  ``ipp+torch`` cluster gives both: ``ipp`` is its time to connect.

Reported: median seconds to ready, and nbddp - ipp differences.
"""

from __future__ import annotations

import sys as _sys
import time
from pathlib import Path as _Path

if __package__ in (None, ""):  # run as a file: make the repo root importable
    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402

NAME = "startup"


def nbddp_cycle(n: int) -> dict:
    import nbddp

    if common.REUSE_WORKERS and nbddp.status()["running"]:
        # the smoke run: the same two figures in the other order (the running workers' stop, then a
        # fresh start), so the fresh workers stay for the benchmarks after this one
        stop_s = common.nbddp_stop(fresh=True)
        return {"start_s": common.nbddp_start(n, fresh=True), "stop_s": stop_s}
    common.nbddp_stop(fresh=True)  # (workers another benchmark kept would make start() a no-op)
    start_s = common.nbddp_start(n, fresh=True)
    stop_s = common.nbddp_stop(fresh=True)
    return {"start_s": start_s, "stop_s": stop_s}


def ipp_cycle(n: int, import_torch: bool = False) -> dict:
    import os

    import ipyparallel as ipp

    os.environ["OMP_NUM_THREADS"] = str(common.CPU_THREADS_PER_RANK)
    t0 = time.perf_counter()
    cluster = ipp.Cluster(n=n)
    rc = cluster.start_and_connect_sync()
    ready = time.perf_counter() - t0
    res = {"connect_s": ready}
    try:
        if import_torch:
            rc[:].execute("import torch", block=True)
            ready = time.perf_counter() - t0
        res["start_s"] = ready
    finally:
        t1 = time.perf_counter()
        try:
            rc.close()
        finally:
            cluster.stop_cluster_sync()
        res["stop_s"] = time.perf_counter() - t1
    return res


def main(quick: bool = False, reps: int | None = None, n: int = 2) -> dict:
    reps = reps or (1 if quick else 3)
    ok, reason = common.nbddp_status()
    out: dict = {"n": n, "reps": reps, "nbddp": reason}
    comps = {}
    if ok:
        comps["nbddp"] = lambda: nbddp_cycle(n)
    else:
        common.log(f"nbddp side skipped: {reason}")
    if not quick:
        comps["ipp"] = lambda: ipp_cycle(n)
    comps["ipp+torch"] = lambda: ipp_cycle(n, import_torch=True)
    raw = common.alternate(comps, reps=reps, label="startup")
    if quick:  # one cluster gives both: "ipp" is its connect time, before the engines import torch
        raw["ipp"] = [{"start_s": r["connect_s"]} if "connect_s" in r else r for r in raw["ipp+torch"]]
    summary = {
        name: {
            "start_s": common.summarize(common.field_values(r, "start_s")),
            "stop_s": common.summarize(common.field_values(r, "stop_s")),
            "errors": common.errors_of(r),
        }
        for name, r in raw.items()
    }
    nb = summary.get("nbddp", {}).get("start_s", {}).get("median")
    diffs = {}
    for other in ("ipp", "ipp+torch"):
        o = summary[other]["start_s"]["median"]
        diffs[f"nbddp-{other}_s"] = (nb - o) if nb is not None and o is not None else None
        diffs[f"nbddp/{other}"] = common.ratio(nb, o)
    out.update(summary=summary, differences=diffs, raw=raw)
    rows = [
        {
            "competitor": name,
            "start->ready s (median)": s["start_s"]["median"],
            "min": s["start_s"]["min"],
            "max": s["start_s"]["max"],
            "stop s": s["stop_s"]["median"],
            "nbddp minus this s": (nb - s["start_s"]["median"]) if nb is not None and s["start_s"]["median"] is not None else None,
            "errors": len(s["errors"]),
        }
        for name, s in summary.items()
    ]
    common.print_table(rows, title=f"\n== startup: {n} workers to ready ==")
    return out


def summary_rows(res: dict) -> list[dict]:
    nb = res.get("summary", {}).get("nbddp", {}).get("start_s", {}).get("median")
    return [
        {"bench": "startup", "competitor": name, "metric": "start s",
         "median": s["start_s"]["median"], "ratio": common.ratio(nb, s["start_s"]["median"]) if name != "nbddp" else None,
         "ratio_of": "nbddp / this" if name != "nbddp" else ""}
        for name, s in res.get("summary", {}).items()
    ]


if __name__ == "__main__":
    common.cli(main, NAME)
