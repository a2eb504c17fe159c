"""One benchmark run from two source trees in turn (old, new, old, new, ...): a same-run A/B of a change.

Each turn runs ``python <tree>/benchmarks/<bench>.py --out <json>`` with
``PYTHONPATH=<tree>``, so the kernel and the workers it starts import that
tree; turns alternate so that a change in the machine's load hits both
sides alike. Each turn's JSON, the load average (``os.getloadavg``) before
it, and the figures named by ``--figures`` are printed as one table.

Run: ``python benchmarks/ab_trees.py OLD_TREE NEW_TREE [--bench bench_predict] [--turns 2]
[--figures call_vs_loop,return_gbps] [--quick] [--out PATH]`` (``--quick``: each turn runs the benchmark at its
``--quick`` size).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def turn(tree: str, bench: str, out: str, quick: bool = False) -> dict:
    """One run of ``bench`` from ``tree``; its JSON (the benchmark's own key, else the whole file)."""
    script = os.path.join(tree, "benchmarks", f"{bench}.py")
    env = {**os.environ, "PYTHONPATH": tree}
    proc = subprocess.run([sys.executable, script, "--out", out, *(["--quick"] if quick else [])], cwd=tree, env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{script} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    data = json.loads(Path(out).read_text())
    name = bench.removeprefix("bench_")
    return data.get(name, data)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--bench", default="bench_predict")
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--figures", default="call_vs_loop,return_gbps")
    ap.add_argument("--quick", action="store_true", help="each turn at the benchmark's --quick size")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.turns):
            for side, tree in (("old", args.old), ("new", args.new)):
                load = os.getloadavg()[0]
                res = turn(os.path.abspath(tree), args.bench, os.path.join(tmp, f"{side}{i}.json"), args.quick)
                row = {"turn": i, "side": side, "load": round(load, 2),
                       **{f: res.get(f) for f in args.figures.split(",")}, "raw": res.get("raw")}
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "raw"}), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1, default=str))


if __name__ == "__main__":
    main()
