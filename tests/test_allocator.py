"""The workers' C allocator keeps training's buffers (nbddp/worker/memory/allocator.py).

The effect is checked where it is deterministic: a fresh interpreter frees
100 MiB of 1 MiB tensors and allocates them again. With glibc's defaults the
freed top of the heap goes back to the system and the second round page-faults
all of it in again; tuned, the second round reuses touched memory.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

import nbddp
from nbddp.protocol import allocator_setting
from nbddp.worker.memory import allocator as memory
glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt tuning is glibc-only")

_PROBE = r"""
import json, resource, sys, torch
from nbddp.worker.memory.allocator import tune_allocator
done = tune_allocator()
def round_trip():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [torch.ones(256 * 1024) for _ in range(100)]   # 100 x 1 MiB, touched
    del blocks
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
round_trip()                      # the heap grows once either way
print(json.dumps({"done": done, "faults": round_trip()}))
"""


def _probe(extra_env: dict[str, str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (allocator_setting.OPT_OUT, "LD_PRELOAD")}
    env.update(extra_env)
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.heavy
@glibc_only
def test_tuned_allocator_reuses_freed_memory_where_the_default_faults_it_in_again():
    """Heavy: two fresh Python processes import torch and fault in the same buffers, tuned and default."""
    tuned = _probe({})
    default = _probe({allocator_setting.OPT_OUT: "default"})
    assert tuned["done"] == "tuned"
    assert default["done"] == f"default ({allocator_setting.OPT_OUT}=default)"
    # 100 MiB is 25,600 pages of 4 KiB: the default run faults them all in again (25,594 here); the tuned
    # one reuses them (256-2,048 faults here, from the interpreter's own allocations around the loop)
    assert default["faults"] > 20_000, default
    assert tuned["faults"] < default["faults"] / 5, (tuned, default)


@pytest.mark.parametrize("env, why", [
    ({"NBDDP_MALLOC": "off"}, "NBDDP_MALLOC=off"),
    ({"MALLOC_TRIM_THRESHOLD_": "1000"}, "MALLOC_TRIM_THRESHOLD_ is set"),
    ({"MALLOC_MMAP_THRESHOLD_": "1000"}, "MALLOC_MMAP_THRESHOLD_ is set"),
    ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}, "GLIBC_TUNABLES is set"),
    ({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}, "another allocator is preloaded (/usr/lib/libjemalloc.so.2)"),
])
def test_a_persons_own_allocator_choice_is_left_alone(env, why):
    assert allocator_setting.reason_to_leave_alone(env) == why
    assert memory.tune_allocator(env) == f"default ({why})"


def test_unrelated_glibc_tunables_do_not_stop_the_tuning():
    expected = None if platform.libc_ver()[0] == "glibc" else allocator_setting.reason_to_leave_alone({})
    assert allocator_setting.reason_to_leave_alone({"GLIBC_TUNABLES": "glibc.pthread.rseq=0"}) == expected


def test_an_unknown_setting_is_an_error_that_names_the_value():
    with pytest.raises(ValueError, match=r"NBDDP_MALLOC='fast' is not understood; set it to 'default'"):
        allocator_setting.reason_to_leave_alone({"NBDDP_MALLOC": "fast"})


@glibc_only
def test_workers_report_a_tuned_allocator(workers):
    assert nbddp.status()["allocator"] == ["tuned"]


def test_start_refuses_an_unknown_setting_before_starting_anything(monkeypatch):
    monkeypatch.setenv("NBDDP_MALLOC", "fast")
    with pytest.raises(ValueError, match=r"NBDDP_MALLOC='fast' is not understood"):
        nbddp.start(n=2)


@glibc_only
@pytest.mark.fresh_workers
def test_workers_started_under_nbddp_malloc_default_keep_glibc_defaults(_suite_session, monkeypatch):
    nbddp.stop()
    monkeypatch.setenv("NBDDP_MALLOC", "default")  # engines started from this kernel inherit its environment
    try:
        nbddp.start(n=2, backend="gloo")
        assert nbddp.status()["allocator"] == ["default (NBDDP_MALLOC=default)"]
    finally:
        nbddp.stop()  # the next test that needs workers starts tuned ones


@glibc_only
def test_a_refused_mallopt_is_reported_not_hidden(monkeypatch):
    class _Libc:
        def mallopt(self, param, value):
            return 0  # glibc's answer to a value out of range

    monkeypatch.setattr(memory.heap, "libc", lambda: _Libc())
    assert memory.tune_allocator({}) == "default (mallopt refused the values)"
