"""Run every nbddp benchmark, print a summary table, write one JSON file.

    python benchmarks/run_all.py            # full sizes, several repetitions
    python benchmarks/run_all.py --quick    # tiny sizes, 1 repetition (smoke)
    python benchmarks/run_all.py --only throughput latency

Results go to ``benchmarks/results/<date>.json`` (or ``--out``). A benchmark
that crashes is recorded as ``{"error": ...}`` and the others still run.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402

# scaling comes last: it ends on 1 worker, and every other benchmark works on the 2 it leaves running
BENCHES = ["startup", "attach", "throughput", "live", "latency", "weights", "fsdp", "memory", "data", "topologies",
           "sweep", "predict", "report", "scaling"]


def run(quick: bool = False, only: list[str] | None = None, reuse_workers: bool = False) -> dict:
    """Every benchmark (or ``only`` those).

    ``reuse_workers`` (the test suite's smoke run): benchmarks keep the running workers, and a torchrun job
    identical to one already run is not launched again (``common.REUSE_TORCHRUN``).
    """
    results: dict = {"quick": quick, "reuse_workers": reuse_workers, "benchmarks": {}}
    rows: list[dict] = []
    common.REUSE_WORKERS = reuse_workers
    common.REUSE_TORCHRUN = {} if reuse_workers else None
    try:
        for name in only or BENCHES:
            _run_one(name, quick, results, rows)
    finally:
        common.REUSE_WORKERS = False
        common.REUSE_TORCHRUN = None
    results["summary_rows"] = rows
    print()
    results["summary_table"] = common.print_table(
        rows, ["bench", "competitor", "metric", "median", "ratio", "ratio_of"],
        title=f"==== nbddp benchmarks summary ({'quick' if quick else 'full'}) ====")
    return results


def _run_one(name: str, quick: bool, results: dict, rows: list[dict]) -> None:
    mod = importlib.import_module(f"benchmarks.bench_{name}")
    common.log(f"=== {name} ===")
    t0 = time.perf_counter()
    try:
        res = mod.main(quick=quick)
        rows += mod.summary_rows(res)
    except Exception as exc:  # keep going with the other benchmarks
        res = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        rows.append({"bench": name, "competitor": "-", "metric": "ERROR", "median": None, "ratio_of": res["error"][:60]})
        common.log(f"{name} FAILED: {res['error']}")
    res["bench_wall_s"] = time.perf_counter() - t0
    results["benchmarks"][name] = res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes, 1 repetition")
    ap.add_argument("--only", nargs="*", choices=BENCHES, help="run only these benchmarks")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/<date>.json)")
    args = ap.parse_args(argv)
    results = run(quick=args.quick, only=args.only)
    common.write_json(results, path=args.out)
    failed = [n for n, r in results["benchmarks"].items() if "error" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
