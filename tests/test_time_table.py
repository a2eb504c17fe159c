"""scripts/time_table.py: pytest's --durations lines grouped by cause (docs/contributing.md)."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import time_table  # noqa: E402


def test_each_phase_goes_under_its_cause_and_the_first_matching_marker_wins():
    lines = ["============ slowest durations ============",
             "12.50s call     tests/test_a.py::test_bench",
             "3.00s setup    tests/test_a.py::test_bench",
             "2.00s call     tests/test_b.py::test_plain",
             "4.00s call     tests/test_c.py::test_notebook_fault",
             "1.00s teardown tests/test_b.py::test_plain",
             "not a duration line"]
    of = {"tests/test_a.py::test_bench": {"bench", "fresh_workers"}, "tests/test_b.py::test_plain": set(),
          "tests/test_c.py::test_notebook_fault": {"faults", "notebook"}}
    rows = {cause: (seconds, n) for cause, seconds, n in time_table.table(lines, of)}
    assert rows == {"workloads sized for a measurement (slow, bench)": (12.5, 1),
                    time_table.FIXTURES: (4.0, 2),
                    "notebooks through nbclient, JupyterLab, doc pages (notebook, browser, docs)": (4.0, 1),
                    time_table.REST: (2.0, 1)}


def test_without_a_log_it_says_how_to_make_one():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "time_table.py")], capture_output=True, text=True)
    assert proc.returncode == 1
    assert "usage: python scripts/time_table.py RUN_LOG  (a pytest log made with --durations=0)" in proc.stderr


def test_the_costs_conftest_orders_by_are_each_test_functions_mean_wall_time_over_its_parameters():
    import cpu_table

    rows = [{"test": "tests/test_a.py::test_fit[ddp]", "cpu_s": 2.0, "wall_s": 3.0},
            {"test": "tests/test_a.py::test_fit[fsdp]", "cpu_s": 2.0, "wall_s": 5.0},
            {"test": "tests/test_a.py::test_unit", "cpu_s": 0.1, "wall_s": 0.2},
            {"test": "tests/test_b.py::test_slow", "cpu_s": 30.0, "wall_s": 61.04}]
    assert cpu_table.costs(rows) == {"tests/test_a.py::test_fit": 4.0, "tests/test_b.py::test_slow": 61.0}
