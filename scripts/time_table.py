"""Where the suite's time goes, grouped by cause: the table in docs/contributing.md.

    DURATIONS=0 bash scripts/test.sh > run.log
    .venv/bin/python scripts/time_table.py run.log

Each line of pytest's ``--durations=0`` report ("12.34s call tests/x.py::t")
is put under one cause, decided by the phase and the test's markers
(collected once with ``pytest --collect-only -m <marker>``):

* set-up and tear-down of fixtures: engine starts, kernels and torch imports
  in new processes (the shared workers start in a fixture's set-up);
* ``fresh_workers``: tests that start workers of their own;
* ``notebook`` / ``browser``: notebooks run through nbclient, JupyterLab;
* ``faults``: kills, timeouts, interrupts and the heals after them;
* ``slow`` / ``bench``: workloads sized for a measurement;
* ``slurm`` / ``netns``: a private Slurm, fake hosts in network namespaces;
* the rest: fits, cells and units on the shared warm workers.

With pytest-xdist the figures add up the time of every process, so their sum
is more than the wall time.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections import defaultdict

LINE = re.compile(r"^\s*([0-9.]+)s (setup|call|teardown)\s+(\S+)")
CAUSES = [  # (cause, the markers that put a test's call under it), first match wins
    ("tests that start their own workers (fresh_workers)", ("fresh_workers",)),
    ("notebooks through nbclient, JupyterLab (notebook, browser)", ("notebook", "browser")),
    ("faults: kills, timeouts, interrupts, heals (faults)", ("faults",)),
    ("workloads sized for a measurement (slow, bench)", ("slow", "bench")),
    ("private Slurm, fake hosts (slurm, netns)", ("slurm", "netns")),
]
FIXTURES = "fixture set-up and tear-down: engine starts, kernels, torch imports in new processes"
REST = "fits, cells and units on the shared warm workers"


def marked(marker: str, python: str = sys.executable) -> set[str]:
    """The node ids of the tests that carry ``marker``."""
    out = subprocess.run([python, "-m", "pytest", "--collect-only", "-q", "-p", "no:randomly", "-m", marker],
                         capture_output=True, text=True, check=False).stdout
    return {line.strip() for line in out.splitlines() if "::" in line}


def table(lines: list[str]) -> list[tuple[str, float, int]]:
    """(cause, seconds, test phases) rows, largest first."""
    by_marker = {m: marked(m) for _, markers in CAUSES for m in markers}
    seconds: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for line in lines:
        m = LINE.match(line)
        if not m:
            continue
        took, phase, nodeid = float(m.group(1)), m.group(2), m.group(3)
        cause = FIXTURES if phase != "call" else next(
            (c for c, markers in CAUSES if any(nodeid in by_marker[k] for k in markers)), REST)
        seconds[cause] += took
        count[cause] += 1
    return sorted(((c, seconds[c], count[c]) for c in seconds), key=lambda row: -row[1])


def main(path: str) -> None:
    with open(path) as f:
        rows = table(f.readlines())
    total = sum(s for _, s, _ in rows)
    print("| cause | seconds | share | phases |\n|---|---:|---:|---:|")
    for cause, s, n in rows:
        print(f"| {cause} | {s:.0f} | {100 * s / total:.0f} % | {n} |")
    print(f"| total (all processes) | {total:.0f} | | |")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python scripts/time_table.py RUN_LOG  (a pytest log made with --durations=0)")
    main(sys.argv[1])
