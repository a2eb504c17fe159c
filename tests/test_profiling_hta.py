"""HTA on a profile's per-rank traces: the files HTA reads, its figures against nbddp's own, and the fallbacks.

A synthetic GPU trace in the shape torch's profiler exports on CUDA (CPU
operators, their ``cudaLaunchKernel`` and the kernels they launch, linked by
``correlation``; a GEMM, an NCCL all-reduce and a host-to-device copy a step)
stands for a GPU rank, since this machine has none. The tests that run HTA
skip without it (``pip install 'nbddp[profile]'``); the fallbacks run anyway.
"""

from __future__ import annotations

import json
import os
import sys
import types

import pytest
import torch

from nbddp.profiling.hta_analysis import hta_analyses, hta_lines
from nbddp.live.timeline import timeline_figure
from nbddp.profiling.trace_merge import profile_summary, rank_traces_of, write_trace
from nbddp.protocol.profile_spec import ProfileSpec
from nbddp.worker.training.profiler import StepProfiler

HOST, GPU = 4242, 0  # the rank's process id and its device's lane, as torch exports them


def _x(name: str, cat: str, ts: float, dur: float, pid: int = HOST, tid: int = HOST, **args) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur, "args": args}


# (name, category, start in the step, duration, stream): 10-50 compute, 40-70 NCCL (10 of it under the GEMM),
# 2-7 a copy on the compute stream before the GEMM
KERNELS = (("sm80_xmma_gemm_f32f32", "kernel", 10, 40, 7),
           ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "kernel", 40, 30, 20),
           ("Memcpy HtoD (Pageable -> Device)", "gpu_memcpy", 2, 5, 7))


def gpu_trace(steps: int = 3, step_us: int = 100, start: int = 5_000_000) -> dict:
    """One rank's trace as ``StepProfiler.close()`` sends it, with GPU kernels (integer µs, as HTA rounds)."""
    events, corr, ext = [], 100, 1
    for s in range(steps):
        t0 = start + s * step_us
        events.append(_x(f"ProfilerStep#{s + 2}", "user_annotation", t0, step_us, **{"External id": ext}))
        for name, cat, at, dur, stream in KERNELS:
            ext, corr = ext + 1, corr + 1
            events += [_x("aten::mm", "cpu_op", t0 + 1, 1, **{"External id": ext}),
                       _x("cudaLaunchKernel", "cuda_runtime", t0 + 1, 1, **{"External id": ext, "correlation": corr}),
                       _x(name, cat, t0 + at, dur, pid=GPU, tid=stream,
                          **{"External id": ext, "correlation": corr, "device": 0, "stream": stream})]
    return {"events": events, "clock_us": 0.0, "agreed_us": 0.0, "host": "here", "top": [], "steps": steps,
            "meta": {"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "a GPU"}],
                     "distributedInfo": {"backend": "nccl", "rank": 0, "world_size": 2}}}


def test_each_rank_trace_is_written_where_hta_finds_its_rank(tmp_path):
    t = gpu_trace()
    path = write_trace({0: t, 1: t}, str(tmp_path))
    folder = rank_traces_of(path)
    assert sorted(os.listdir(folder)) == ["rank-0.json", "rank-1.json"]
    assert os.stat(folder).st_mode & 0o777 == 0o700
    docs = {}
    for r in (0, 1):
        assert os.stat(os.path.join(folder, f"rank-{r}.json")).st_mode & 0o777 == 0o600
        with open(os.path.join(folder, f"rank-{r}.json")) as f:
            docs[r] = json.load(f)
    # the rank is nbddp's, whatever the export said; the rest of the export's metadata is kept
    assert docs[1]["distributedInfo"] == {"backend": "nccl", "rank": 1, "world_size": 2}
    assert docs[0]["deviceProperties"] == [{"id": 0, "name": "a GPU"}]
    # on the merged file's clock: its first event at 0, the kernels still on their own lanes and streams
    with open(path) as f:
        merged = json.load(f)["traceEvents"]
    assert min(e["ts"] for e in docs[0]["traceEvents"]) == 0 == min(e["ts"] for e in merged if e.get("ph") == "X")
    gemm = next(e for e in docs[0]["traceEvents"] if e["name"].startswith("sm80"))
    assert (gemm["pid"], gemm["tid"], gemm["args"]["stream"]) == (GPU, 7, 7)


def test_hta_figures_agree_with_nbddps_own_breakdown_of_the_same_trace(tmp_path):
    hta = pytest.importorskip("hta.common.trace_file")
    t = gpu_trace()
    path = write_trace({0: t, 1: t}, str(tmp_path))
    assert hta.get_trace_files(rank_traces_of(path)) == {r: os.path.join(rank_traces_of(path), f"rank-{r}.json")
                                                        for r in (0, 1)}  # HTA's own way of finding the ranks
    profile = profile_summary(path, {0: t, 1: t}, expected=2)
    assert profile["hta"]["used"] and profile["hta"]["reason"] is None and profile["hta"]["version"]
    for r in (0, 1):
        own, f = profile["breakdown"][r], profile["hta"]["ranks"][r]
        assert own["basis"] == "gpu kernels"
        # 3 steps: compute 3 x 40 µs; non-compute the NCCL kernel outside the GEMM (20) and the copy (5) a step
        assert f["compute_s"] == pytest.approx(own["compute_s"]) == pytest.approx(120e-6)
        assert f["non_compute_s"] == pytest.approx(own["communication_s"] + own["memory_s"]) == pytest.approx(75e-6)
        assert f["overlap"] == pytest.approx(own["overlap"], abs=1e-4)  # HTA gives a percentage to 2 decimals
        assert own["overlap"] == pytest.approx(1 / 3)
        # HTA counts from the first kernel's start to the last's end (2 to 270 µs); nbddp from the first traced
        # step's start to the last step's end (0 to 300): the idle time differs by exactly that
        assert f["kernel_time_s"] == pytest.approx(268e-6) and own["window_s"] == pytest.approx(300e-6)
        assert own["idle_s"] - f["idle_s"] == pytest.approx(own["window_s"] - f["kernel_time_s"])
        # idle by cause: gaps before each step's first kernel are the host's; 3 µs between copy and GEMM is not
        assert f["host_wait_s"] > f["kernel_wait_s"] > 0 and f["streams"] == [7, 20]
        assert f["host_wait_share"] + f["kernel_wait_share"] + f["other_share"] == pytest.approx(1)
        assert (f"HTA {profile['hta']['version']}, rank {r} over 0.3 ms of GPU kernels: compute 45 %, "
                f"non-compute 28 %, idle 27 % (33 % of its communication under compute); idle by cause over 2 "
                f"stream(s): host wait ") in profile["summary"]


def cpu_trace() -> dict:
    """A real CPU trace of 2 traced steps, as a rank sends it."""
    prof = StepProfiler(ProfileSpec(wait=0, warmup=1, active=2), torch.device("cpu"), agreed_us=0.0)
    model = torch.nn.Linear(8, 2)
    for _ in range(3):
        model(torch.randn(4, 8)).sum().backward()
        prof.step()
    return prof.close()


def test_without_gpu_kernels_hta_is_not_run_and_the_summary_says_why(tmp_path):
    t = cpu_trace()
    profile = profile_summary(write_trace({0: t}, str(tmp_path)), {0: t}, expected=1)
    assert profile["hta"] == {"used": False, "reason": "no GPU kernels in the traces, and HTA reads GPU kernels only",
                              "version": None, "ranks": {}}
    assert ("HTA not used: no GPU kernels in the traces, and HTA reads GPU kernels only; the breakdown above is "
            "nbddp's own") in profile["summary"]
    assert profile["breakdown"][0]["basis"] == "cpu operators"  # nbddp's own figures stand
    assert os.listdir(profile["rank_traces"]) == ["rank-0.json"]  # written for HTA all the same


def test_without_hta_installed_the_profile_keeps_nbddps_figures(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "hta", None)  # import hta... raises ModuleNotFoundError
    monkeypatch.setitem(sys.modules, "hta.trace_analysis", None)
    t = gpu_trace()
    profile = profile_summary(write_trace({0: t}, str(tmp_path)), {0: t}, expected=1)
    assert not profile["hta"]["used"] and "HTA could not be imported (not installed); pip install 'nbddp[profile]'" \
        in profile["hta"]["reason"]
    assert profile["breakdown"][0]["compute_s"] == pytest.approx(120e-6)
    assert hta_lines(profile["hta"])[0] in profile["summary"]


def test_an_hta_failure_is_reported_and_never_fails_the_profile(tmp_path, monkeypatch):
    class Failing:
        def __init__(self, trace_files, include_last_profiler_step):
            raise IndexError("single positional indexer is out-of-bounds")

    fake = types.ModuleType("hta.trace_analysis")
    fake.TraceAnalysis = Failing
    monkeypatch.setitem(sys.modules, "hta", types.ModuleType("hta"))
    monkeypatch.setitem(sys.modules, "hta.trace_analysis", fake)
    monkeypatch.setitem(sys.modules, "hta.version", types.SimpleNamespace(__version_tuple__=(9, 9)))
    t = gpu_trace()
    path = write_trace({0: t, 1: t}, str(tmp_path))
    result = hta_analyses({r: os.path.join(rank_traces_of(path), f"rank-{r}.json") for r in (0, 1)}, [0, 1])
    assert result == {"used": False, "version": None, "ranks": {},
                      "reason": "HTA 9.9 failed on rank 0: IndexError: single positional indexer is out-of-bounds"}
    profile = profile_summary(path, {0: t, 1: t}, expected=2)
    assert "HTA not used: HTA 9.9 failed on rank 0: IndexError" in profile["summary"]
    assert set(profile["breakdown"]) == {0, 1}


def test_the_timeline_shows_each_ranks_breakdown_as_a_stacked_bar_beside_its_lane(tmp_path):
    slow = gpu_trace(step_us=150)  # rank 1: the same kernels in longer steps, so more idle
    path = write_trace({0: gpu_trace(), 1: slow}, str(tmp_path))
    profile = profile_summary(path, {0: gpu_trace(), 1: slow}, expected=2)
    fig = timeline_figure(path)
    assert fig._repr_png_()[:4] == b"\x89PNG"
    lanes, bars = fig.axes
    assert [t.get_text() for t in lanes.get_yticklabels()] == ["rank 0", "rank 1"]
    assert [t.get_text() for t in bars.get_legend().get_texts()] == ["compute", "communication", "memory", "idle"]
    widths = [p.get_width() for p in bars.patches]
    for lane, rank in enumerate((0, 1)):
        b = profile["breakdown"][rank]
        assert widths[lane * 4:lane * 4 + 4] == pytest.approx([b["compute_share"], b["communication_share"],
                                                               b["memory_share"], b["idle_share"]])
        assert sum(widths[lane * 4:lane * 4 + 4]) == pytest.approx(1)
        assert [p.get_y() + p.get_height() / 2 for p in bars.patches[lane * 4:lane * 4 + 4]] == \
            pytest.approx([lane * 2 + 0.9] * 4)  # beside the rank's lane
    assert widths[7] > widths[3]  # rank 1 idles more
