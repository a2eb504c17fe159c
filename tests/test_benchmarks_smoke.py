"""The benchmark suite runs (tiny sizes, one repetition) and reports ratios.

No timing is asserted here: the machines are noisy, so speed goals live in
``benchmarks/`` as same-run ratios (``docs/performance.md``). This only
guarantees that the benchmark code keeps working as nbddp changes.
"""

from __future__ import annotations

import math
import os
import signal
import sys

import pytest

pytestmark = [pytest.mark.bench]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.fresh_workers
@pytest.mark.slow
@pytest.mark.timeout(600)  # ~80 s on a quiet machine: 8 process launches, each benchmark once at its smallest size
def test_quick_benchmarks_run_and_report_ratios(workers):
    """Every benchmark runs once at its smallest size and reports its ratios.

    The benchmarks keep the suite's workers (``reuse_workers``) instead of starting their own,
    except where start-up is what they measure, and each distinct torchrun job runs once
    (latency's and 2-CPU scaling's are throughput's quick jobs). It cannot be faster: what is
    left is one launch per competitor path, 4-10 s each on 2 cores, about 50 s together: one
    ipyparallel cluster, three torchrun jobs (MLP and CNN on 2 ranks, CNN on 1), one
    accelerate launcher, and three nbddp starts (start-up's, memory's second order after
    ``nbddp.restart()``, scaling's 1 worker); the benchmarks' own work takes the other ~30 s. Attach's
    detached session (two processes of its own) and its cold start add about 25 s.
    """
    sys.path.insert(0, ROOT)
    sigint = signal.getsignal(signal.SIGINT)  # accelerate's launcher installs torch elastic's handler
    try:
        from benchmarks import run_all

        results = run_all.run(quick=True, reuse_workers=True)
    finally:
        sys.path.remove(ROOT)
        signal.signal(signal.SIGINT, sigint)
    failed = {name: r["error"] for name, r in results["benchmarks"].items() if "error" in r}
    assert not failed, f"benchmarks crashed: {failed}"
    rows = results["summary_rows"]
    ratios = {(r["bench"], r["competitor"], r["metric"]): r.get("ratio") for r in rows}
    # each distinct torchrun job ran once: latency's and 2-CPU scaling's are throughput's quick jobs
    torchrun_jobs = {name: r.get("reused", False) for name, r in [
        ("throughput/mlp", results["benchmarks"]["throughput"]["workloads"]["mlp"]["raw"]["torchrun"][0]),
        ("throughput/cnn", results["benchmarks"]["throughput"]["workloads"]["cnn"]["raw"]["torchrun"][0]),
        ("latency", results["benchmarks"]["latency"]["raw"]["torchrun"][0]["calls"][0]),
        ("scaling/2cpu", results["benchmarks"]["scaling"]["by_count"][2]["raw"]["torchrun"][0]),
        ("scaling/1cpu", results["benchmarks"]["scaling"]["by_count"][1]["raw"]["torchrun"][0])]}
    assert torchrun_jobs == {"throughput/mlp": False, "throughput/cnn": False, "latency": True,
                             "scaling/2cpu": True, "scaling/1cpu": False}, torchrun_jobs
    for bench in ("throughput/mlp", "throughput/cnn"):
        got = [v for (b, c, m), v in ratios.items() if b == bench and c.startswith("nbddp") and m == "samples/s"]
        assert got and all(isinstance(v, float) and math.isfinite(v) and v > 0 for v in got), (bench, got)
    latency = [r.get("ratio") for r in rows  # every row that says what it is a ratio of has one
               if r["bench"].startswith("latency") and r["competitor"] != "nbddp_warm" and r.get("ratio_of")]
    assert latency and all(isinstance(v, float) and v > 0 for v in latency), latency
    weights = results["benchmarks"]["weights"]
    assert weights["summary"], "the weights benchmark reported no sizes"
    # scaling runs on whatever workers this machine has (CPU workers without CUDA): 1 worker and more
    scaling = [r for r in rows if r["bench"].startswith("scaling/") and r["competitor"] == "nbddp"]
    efficiency = [r["median"] for r in scaling if r["metric"] == "efficiency"]
    assert len(efficiency) >= 2 and all(isinstance(v, float) and v > 0 for v in efficiency), scaling
    fsdp = results["benchmarks"]["fsdp"]["summary"]
    assert fsdp["param_bytes_per_rank"]["fsdp"][0] * 2 == pytest.approx(fsdp["param_bytes_per_rank"]["ddp"][0], rel=0.05)
    assert all(v > 0 for v in fsdp["samples_per_s"].values()), fsdp
    data = results["benchmarks"]["data"]["summary"]  # num_workers 0 vs 2, map-style and stream
    assert all(d["ratio_nw2_over_nw0"]["median"] > 0 and not d["errors"] for d in data.values()), data
    from benchmarks.bench_sweep import PARTS

    sweep = results["benchmarks"]["sweep"]  # 4 trials as a sweep on 2 workers against 4 fits on 1, and the gaps
    assert sweep["summary"]["speedup"] > 0 and sweep["summary"]["gap_median_s"] is not None, sweep["summary"]
    assert set(sweep["summary"]["gap_parts_median_s"]) == {name for name, _, _ in PARTS}
    assert all(state == "complete" for r in sweep["sweep"] for state in r["states"])
    report = results["benchmarks"]["report"]  # a loop reporting every step against the same loop without
    assert report["throughput_ratio"]["median"] > 0 and report["latency_ms"]["points"] > 0, report
    assert 0 < report["outside_ns"]["report_ns"] < 1e5, report["outside_ns"]
    predict = results["benchmarks"]["predict"]  # nbddp's side only here: its torchrun side is a full run's
    assert predict["torchrun_skipped"] and predict["return_gbps"] > 0 and predict["n"] == 2048, predict
