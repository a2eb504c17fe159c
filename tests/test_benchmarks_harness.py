"""The benchmark harness's handling of a torchrun job that crashes (no torchrun is started here)."""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import common  # noqa: E402

CFG = common.workload_cfg("mlp", quick=True)
RESULT = common.JSON_MARKER + json.dumps({"loop_s": 0.5, "samples_per_s": 4096.0})
ABORT = "terminate called without an active exception\nChildFailedError: ..."


def _jobs(monkeypatch, outcomes):
    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        rc, out, err = outcomes[len(calls) - 1]
        return SimpleNamespace(returncode=rc, stdout=out, stderr=err)

    monkeypatch.setattr(common.subprocess, "run", fake_run)
    return calls


def test_a_crash_after_rank_0_reported_keeps_the_measurement(monkeypatch):
    calls = _jobs(monkeypatch, [(1, RESULT + "\n", ABORT)])
    res = common.run_torchrun(CFG)
    assert len(calls) == 1 and res["samples_per_s"] == 4096.0
    assert res["teardown_error"] == "exit 1: terminate called without an active exception"
    assert "retried" not in res


def test_a_job_that_crashed_before_reporting_runs_again_and_says_so(monkeypatch):
    calls = _jobs(monkeypatch, [(1, "", ABORT), (0, RESULT + "\n", "")])
    res = common.run_torchrun(CFG, retries=1)
    assert len(calls) == 2 and res["samples_per_s"] == 4096.0
    assert len(res["retried"]) == 1 and "terminate called without an active exception" in res["retried"][0]


def test_a_job_that_keeps_crashing_raises_with_the_ranks_own_message(monkeypatch):
    _jobs(monkeypatch, [(1, "", ABORT), (1, "", ABORT)])
    with pytest.raises(RuntimeError, match=r"torchrun exit 1: terminate called without an active exception"):
        common.run_torchrun(CFG, retries=1)



def test_the_smoke_run_launches_each_distinct_torchrun_job_once(monkeypatch):
    """``REUSE_TORCHRUN`` (the smoke run): the same workload and world size reuse the first job's figures."""
    calls = _jobs(monkeypatch, [(0, RESULT + "\n", "")] * 3)
    monkeypatch.setattr(common, "REUSE_TORCHRUN", {})
    first, again = common.run_torchrun(CFG), common.run_torchrun(dict(CFG))
    assert len(calls) == 1 and "reused" not in first and again["reused"] is True
    assert again["samples_per_s"] == first["samples_per_s"] == 4096.0
    common.run_torchrun(CFG, nproc=1)  # another world size is another job
    common.run_torchrun({**CFG, "n_samples": 4096})  # and so is another workload
    assert len(calls) == 3


def test_a_full_run_launches_every_torchrun_job(monkeypatch):
    calls = _jobs(monkeypatch, [(0, RESULT + "\n", "")] * 2)
    assert common.REUSE_TORCHRUN is None
    common.run_torchrun(CFG)
    assert "reused" not in common.run_torchrun(CFG) and len(calls) == 2
