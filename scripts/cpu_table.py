"""Where the suite's CPU goes, by test file and by marker: the per-file table in docs/contributing.md.

    NBDDP_CPU_LOG=/tmp/run.cpu CI=true bash scripts/test.sh
    .venv/bin/python scripts/cpu_table.py /tmp/run.cpu [--top 30] [--costs tests/test_costs.json]

Reads every ``<log>.<worker>`` file that ``tests/cpu_meter.py`` wrote (one
JSON line per test: CPU seconds of the test process and of every process it
started, and wall seconds) and prints the files sorted by CPU, with their
share, tests and wall seconds, then the totals by the first marker that
places each test in a tier (from one ``pytest --collect-only``).

``--costs PATH`` also writes each test function's mean wall seconds (those
of half a second or more), which ``tests/conftest.py`` orders the files by:
the longest first, so that none of them ends the run alone.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(__file__))
from time_table import markers  # noqa: E402

TIERS = ("slow", "bench", "slurm", "netns", "notebook", "browser", "docs", "faults", "fresh_workers", "heavy")


def read(log: str) -> list[dict]:
    rows = []
    for path in sorted(glob.glob(glob.escape(log) + ".*")):
        with open(path, encoding="utf-8") as f:
            rows += [json.loads(line) for line in f if line.strip()]
    return rows


def tables(rows: list[dict], of: dict[str, set[str]]) -> tuple[list[tuple], dict[str, float]]:
    """(file, cpu_s, tests, wall_s) rows, largest first; and CPU seconds by tier (``quick``: none of ``TIERS``)."""
    files: dict[str, list[float]] = defaultdict(lambda: [0.0, 0, 0.0])
    tiers: dict[str, float] = defaultdict(float)
    for r in rows:
        entry = files[r["test"].split("::")[0]]
        entry[0] += r["cpu_s"]
        entry[1] += 1
        entry[2] += r["wall_s"]
        tier = next((t for t in TIERS if t in of.get(r["test"], set())), "quick")
        tiers[tier] += r["cpu_s"]
    ranked = sorted(((f, v[0], v[1], v[2]) for f, v in files.items()), key=lambda row: -row[1])
    return ranked, dict(tiers)


def costs(rows: list[dict], least: float = 0.5) -> dict[str, float]:
    """``file::function`` -> its mean wall seconds over its parameters, for those of ``least`` seconds or more."""
    walls: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        walls[r["test"].split("[", 1)[0]].append(r["wall_s"])
    means = {test: sum(w) / len(w) for test, w in walls.items()}
    return {test: round(mean, 1) for test, mean in sorted(means.items()) if mean >= least}


def write_costs(rows: list[dict], log: str, path: str) -> None:
    made_by = f"scripts/cpu_table.py {os.path.basename(log)} --costs {path}"
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"made_by": made_by, "seconds": costs(rows)}, f, indent=1)
        f.write("\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--costs", metavar="PATH", help="also write each test's wall seconds here (tests/test_costs.json)")
    args = ap.parse_args()
    rows = read(args.log)
    if not rows:
        sys.exit(f"no {args.log}.* files with tests in them")
    if args.costs:
        write_costs(rows, args.log, args.costs)
    ranked, tiers = tables(rows, markers())
    total = sum(r[1] for r in ranked)
    print("| file | CPU s | share | tests | wall s |\n|---|---:|---:|---:|---:|")
    for f, cpu, n, wall in ranked[: args.top]:
        print(f"| `{f}` | {cpu:,.0f} | {cpu / total:.0%} | {n} | {wall:,.0f} |")
    rest = ranked[args.top:]
    if rest:
        print(f"| {len(rest)} other files | {sum(r[1] for r in rest):,.0f} | {sum(r[1] for r in rest) / total:.0%} | "
              f"{sum(r[2] for r in rest)} | {sum(r[3] for r in rest):,.0f} |")
    print(f"| total | {total:,.0f} | | {len(rows)} | |\n")
    print("| tier (first marker) | CPU s | share |\n|---|---:|---:|")
    for tier, cpu in sorted(tiers.items(), key=lambda kv: -kv[1]):
        print(f"| {tier} | {cpu:,.0f} | {cpu / total:.0%} |")


if __name__ == "__main__":
    main()
