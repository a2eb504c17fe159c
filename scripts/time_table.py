"""Where the suite's time goes, grouped by cause: the table in docs/contributing.md.

    DURATIONS=0 bash scripts/test.sh > run.log
    .venv/bin/python scripts/time_table.py run.log

Each line of pytest's ``--durations=0`` report ("12.34s call tests/x.py::t")
is put under one cause, decided by the phase and the test's markers
(from one ``pytest --collect-only``):

* set-up and tear-down of fixtures: engine starts, kernels and torch imports
  in new processes (the shared workers start in a fixture's set-up);
* ``slow`` / ``bench``: workloads sized for a measurement;
* ``notebook`` / ``browser`` / ``docs``: notebooks run through nbclient, JupyterLab, doc pages;
* ``slurm`` / ``netns``: a private Slurm, fake hosts in network namespaces;
* ``faults``: kills, timeouts, interrupts and the heals after them;
* ``fresh_workers``: other tests that start workers of their own;
* the rest: fits, cells and units on the shared warm workers.

With pytest-xdist the figures add up the time of every process, so their sum
is more than the wall time.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections import defaultdict

LINE = re.compile(r"^\s*([0-9.]+)s (setup|call|teardown)\s+(\S+)")
CAUSES = [  # (cause, the markers that put a test's call under it), first match wins
    ("workloads sized for a measurement (slow, bench)", ("slow", "bench")),
    ("private Slurm, fake hosts (slurm, netns)", ("slurm", "netns")),
    ("notebooks through nbclient, JupyterLab, doc pages (notebook, browser, docs)", ("notebook", "browser", "docs")),
    ("faults: kills, timeouts, interrupts, heals (faults)", ("faults",)),
    ("tests that start their own workers (fresh_workers)", ("fresh_workers",)),
]
FIXTURES = "fixture set-up and tear-down: engine starts, kernels, torch imports in new processes"
REST = "fits, cells and units on the shared warm workers"


class _Markers:
    """A pytest plugin that notes each collected test's markers."""

    def __init__(self) -> None:
        self.of: dict[str, set[str]] = {}

    def pytest_collection_modifyitems(self, items: list) -> None:
        self.of.update({item.nodeid: {m.name for m in item.iter_markers()} for item in items})


def markers() -> dict[str, set[str]]:
    """node id -> its markers, from one collection of the suite (``--collect-only``, in this process)."""
    import pytest

    plugin = _Markers()
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
        pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider"], plugins=[plugin])
    return plugin.of


def table(lines: list[str], of: dict[str, set[str]]) -> list[tuple[str, float, int]]:
    """(cause, seconds, test phases) rows, largest first; ``of``: node id -> its markers (``markers()``)."""
    seconds: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for line in lines:
        m = LINE.match(line)
        if not m:
            continue
        took, phase, nodeid = float(m.group(1)), m.group(2), m.group(3)
        cause = FIXTURES if phase != "call" else next(
            (c for c, names in CAUSES if of.get(nodeid, set()) & set(names)), REST)
        seconds[cause] += took
        count[cause] += 1
    return sorted(((c, seconds[c], count[c]) for c in seconds), key=lambda row: -row[1])


def main(path: str) -> None:
    with open(path) as f:
        rows = table(f.readlines(), markers())
    total = sum(s for _, s, _ in rows)
    print("| cause | seconds | share | phases |\n|---|---:|---:|---:|")
    for cause, s, n in rows:
        print(f"| {cause} | {s:.0f} | {100 * s / total:.0f} % | {n} |")
    print(f"| total (all processes) | {total:.0f} | | |")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python scripts/time_table.py RUN_LOG  (a pytest log made with --durations=0)")
    main(sys.argv[1])
