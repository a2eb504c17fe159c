"""The time split: phases timed on every rank, the wait for a slower rank told apart, the sentence the views print.

Unit tests drive the heartbeat with a fake clock and the split with made-up
seconds; three fits on the suite's two CPU workers check it end to end
(a rank made slower, a dataset that makes data loading dominate).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import time
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nbddp
from nbddp.fit.history import History
from nbddp.live.state import LiveState
from nbddp.live.text import TextView
from nbddp.live.time_bars import bar_html, rank_splits, split_sentence
from nbddp.live.widget import rank_rows, rank_table_html, summary_text
from nbddp.profiling.time_split import SPLIT_PHASES, efficiency, split_frame, split_ranks, summary
from nbddp.protocol.messages import TIMED_PHASES, FitPlanInfo, RankInfo, timed_phases
from nbddp.live.timeline import timeline_figure
from nbddp.profiling.trace_analysis import breakdown_lines, trace_breakdown
from nbddp.profiling.trace_merge import merge_traces, profile_summary, write_trace
from nbddp.protocol.profile_spec import ProfileSpec, profile_spec
from nbddp.worker.engine.heartbeat import Heartbeat
from nbddp.worker.training.profiler import CLOCK_MARK, StepProfiler


# ---------------------------------------------------------------------------
# the rank's clock


def test_heartbeat_times_each_marked_phase_once_timing_starts(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    beat = Heartbeat()
    beat.mark("forward")
    now[0] += 5.0  # before time_phases: not counted
    beat.time_phases("data")
    for phase, seconds in (("forward", 0.5), ("backward", 1.0), ("data", 2.0), ("forward", 0.25)):
        now[0] += seconds
        beat.mark(phase)
    now[0] += 0.125  # the phase running now counts too
    # each mark closes the phase before it: data 0.5 + 0.25, forward 1.0 + 0.125 (running), backward 2.0
    assert beat.phase_seconds() == {"data": 0.75, "forward": 1.125, "backward": 2.0}
    assert beat.phase_seconds(stop=True) == {"data": 0.75, "forward": 1.125, "backward": 2.0}
    now[0] += 9.0
    beat.mark("finish")  # stopped: later marks add nothing
    assert beat.phase_seconds() == {"data": 0.75, "forward": 1.125, "backward": 2.0}


def test_timed_phases_has_every_phase_and_counts_the_unnamed_as_other():
    out = timed_phases({"forward": 1.0, "paused": 2.0, "setup": 0.5})
    assert list(out) == list(TIMED_PHASES)
    assert out["forward"] == 1.0 and out["other"] == 2.5 and out["data"] == 0.0


# ---------------------------------------------------------------------------
# the split


def _raw(**seconds: float) -> dict[str, float]:
    return timed_phases(seconds)


def test_a_rank_slower_in_its_forward_makes_the_other_wait_in_its_backward():
    # rank 1 spends 2 s more in forward; under DDP rank 0 waits for it in the gradient all-reduce (backward)
    fast = _raw(data=1.0, forward=1.0, backward=3.0, optimizer=0.5, collective=0.25)
    slow = _raw(data=1.0, forward=3.0, backward=1.0, optimizer=0.5, collective=0.25)
    s0, s1 = split_ranks([fast, slow])
    assert s0["wait"] == pytest.approx(2.0) and s0["backward"] == pytest.approx(1.0)
    assert s0["communication"] == pytest.approx(0.25)
    assert s1["wait"] == 0.0 and s1["backward"] == 1.0
    assert sum(s0.values()) == pytest.approx(sum(fast.values()))  # the split only moves seconds between phases
    assert list(s0) == list(SPLIT_PHASES)
    text = summary([s0, s1])
    # rank 1 worked 5.75 s, rank 0 3.75 s of its own (53 % less); rank 0 waited 2 of its 5.75 s
    assert text.startswith("rank 1 is 53 % slower (the forward pass); rank 0 waits 35 % of each step for it; ")


def test_the_wait_comes_out_of_the_reduction_first():
    s0, s1 = split_ranks([_raw(forward=1.0, collective=2.5), _raw(forward=3.0, collective=0.5)])
    assert s0["wait"] == pytest.approx(2.0) and s0["communication"] == pytest.approx(0.5)
    assert s1["communication"] == pytest.approx(0.5)


def test_a_longer_backward_with_no_less_own_work_is_not_waiting():
    # rank 1's backward computes longer (a pipeline's stage): rank 0 did not do less of its own work
    s0, s1 = split_ranks([_raw(forward=1.0, backward=1.0), _raw(forward=1.0, backward=3.0)])
    assert s0["wait"] == 0.0 and s1["wait"] == 0.0 and s1["backward"] == 3.0


def test_one_rank_never_waits_and_the_summary_names_the_largest_share():
    (split,) = split_ranks([_raw(data=6.0, forward=1.0, backward=2.0, optimizer=1.0)])
    assert split["wait"] == 0.0
    assert efficiency(split) == pytest.approx(0.4)
    assert summary([split]) == "data loading takes 60 % of the time, the largest share besides compute (40 %)"
    assert summary([]) == "" and summary(split_ranks([_raw()])) == ""


def test_ranks_alike_name_no_straggler():
    a = _raw(data=0.5, forward=1.0, backward=1.0, collective=1.5)
    text = summary(split_ranks([a, dict(a)]))
    assert "slower" not in text
    assert text == ("communication takes 38 % of the time on average over the ranks, the largest share besides "
                    "compute (50 %)")


def test_history_time_split_is_a_frame_of_ranks_by_phases():
    splits = split_ranks([_raw(data=1.0, forward=1.0, backward=3.0), _raw(data=1.0, forward=3.0, backward=1.0)])
    history = History(world_size=2, ranks=[{"rank": r, "host": "h", "time_split": s} for r, s in enumerate(splits)])
    frame = history.time_split()
    assert list(frame.index) == [0, 1]
    assert frame.loc[0, "wait"] == pytest.approx(2.0) and frame.loc[0, "total"] == pytest.approx(5.0)
    assert frame.loc[0, "wait_share"] == pytest.approx(0.4)
    assert frame.loc[1, "efficiency"] == pytest.approx(0.8)
    assert frame.attrs["summary"].startswith("rank 1 is 67 % slower (the forward pass)")
    assert split_frame([]).empty  # a failed fit's History has no ranks


# ---------------------------------------------------------------------------
# the views


def _run(ranks_live=None, ranks_final=None):
    live = LiveState(status="completed", world_size=2, backend="gloo", epochs=1,
                     plan=FitPlanInfo(total_steps=4, steps_per_epoch=4, start_step=0, batch_size=8),
                     placements=[RankInfo(0, "a", "cpu", 1), RankInfo(1, "a", "cpu", 2)], ranks=ranks_live or [])
    history = History(world_size=2, ranks=ranks_final or [])
    history.add("step", {"step": 4, "epoch": 0, "loss": 1.0, "lr": 0.1, "samples_per_s": 10.0, "time": 1.0})
    return SimpleNamespace(history=history, live_state=live, error=None, finished=True, started_at=None)


def test_views_draw_a_bar_per_rank_live_then_the_final_split():
    live = [{"rank": r, "samples_per_s": 5.0, "peak_mem": 1, "phase_s": _raw(forward=1.0 + 2 * r, backward=3.0 - 2 * r)}
            for r in (0, 1)]
    run = _run(ranks_live=live)
    assert rank_splits(run)[0]["wait"] == pytest.approx(2.0)  # live: from the last reduction's seconds
    table = rank_table_html(rank_rows(run))
    assert table.count("class='nbddp-split'") == 2 and "waiting for a slower rank: 2.00 s (50 %)" in table
    final = split_ranks([_raw(data=3.0, forward=1.0), _raw(data=3.0, forward=1.0)])
    run = _run(ranks_live=live, ranks_final=[{"rank": r, "time_split": s} for r, s in enumerate(final)])
    assert split_sentence(run).startswith("data loading takes 75 %")  # the end: every rank's own totals
    assert "time split: data loading takes 75 %" in summary_text(run)
    out = io.StringIO()
    TextView(stream=out).finish(run)
    assert out.getvalue().splitlines()[-1].startswith("nbddp: time split: data loading takes 75 %")
    assert bar_html(None) == "-" and rank_splits(_run()) == []


# ---------------------------------------------------------------------------
# on the workers


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 2)

    def forward(self, x):
        return self.lin(x)


def _rank_one_slower(model, batch):
    if torch.distributed.get_rank() == 1:
        time.sleep(0.02)
    x, y = batch
    return F.cross_entropy(model(x), y)


def _data(n: int = 160):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 8, generator=g), torch.randint(0, 2, (n,), generator=g)


def test_a_rank_slower_by_20_ms_a_step_shows_as_the_others_wait(workers):
    steps = 16
    h = nbddp.dist_fit(Small(), _data(), epochs=1, max_steps=steps, batch_size=4, lr=0.01, optimizer=torch.optim.SGD,
                       step_fn=_rank_one_slower, live=False)
    split0, split1 = (r["time_split"] for r in h.ranks)
    assert split0["wait"] / steps >= 0.015, split0
    assert split1["wait"] / steps < 0.005, split1
    text = h.time_split().attrs["summary"]
    assert text.startswith("rank 1 is ") and "rank 0 waits" in text, text
    for split in (split0, split1):  # the phases add up to the training loop's wall time
        assert sum(split.values()) == pytest.approx(h.timings["train_s"], rel=0.05)


class SlowSamples(torch.utils.data.Dataset):
    """Each sample takes 10 ms to load: data loading outweighs a linear layer's step many times."""

    def __init__(self, n: int):
        self.x, self.y = _data(n)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        time.sleep(0.01)
        return self.x[i], self.y[i]


def test_a_slow_dataset_makes_data_loading_the_largest_share(workers, capsys):
    h = nbddp.dist_fit(Small(), SlowSamples(32), epochs=1, batch_size=4, lr=0.01, optimizer=torch.optim.SGD,
                       live="text")
    frame = h.time_split()
    for rank in (0, 1):
        assert frame.loc[rank, "data_share"] > 0.5, frame.loc[rank]
    assert "data loading takes" in frame.attrs["summary"], frame.attrs["summary"]
    printed = capsys.readouterr().out.splitlines()
    assert printed[-1] == f"nbddp: time split: {frame.attrs['summary']}"  # the text view's last line


# ---------------------------------------------------------------------------
# the deep profile: options, one rank's trace, the merge


@pytest.mark.parametrize("value, error, match", [
    ("yes", TypeError, r"takes True, False or a dict of \[.*'active'.*\], got str 'yes'"),
    ({"active": 0}, ValueError, r"profile=\{'active': 0\}\): active must be >= 1 \(the steps traced"),
    ({"wait": -1}, ValueError, r"wait must be >= 0"),
    ({"active": 2.5}, TypeError, r"'active': \.\.\.\}\) must be a whole number of steps, got float 2.5"),
    ({"activ": 3}, ValueError, r"unknown key\(s\) \['activ'\]; the keys are"),
    ({"with_stack": "on"}, TypeError, r"'with_stack': \.\.\.\}\) must be True or False, got str 'on'"),
    ({"dir": 3}, TypeError, r"'dir': \.\.\.\}\) must be a folder path \(str\), got int 3"),
])
def test_bad_profile_options_say_what_to_give(value, error, match):
    with pytest.raises(error, match=match):
        profile_spec(value)


def test_profile_options_default_and_count_their_steps():
    assert profile_spec(False) is None and profile_spec(None) is None
    assert profile_spec(True) == ProfileSpec()
    spec = profile_spec({"wait": 0, "warmup": 1, "active": 2, "repeat": 2, "record_shapes": True})
    assert spec.steps == 6 and spec.record_shapes


def _traced(agreed_us: float, steps: int = 4) -> dict:
    model = nn.Linear(8, 2)
    prof = StepProfiler(ProfileSpec(wait=1, warmup=1, active=2), torch.device("cpu"), agreed_us)
    for _ in range(steps):
        model(torch.randn(4, 8)).sum().backward()
        prof.step()
    assert prof.prof is None  # stopped by itself after wait + warmup + active steps
    return prof.close()


def test_a_rank_traces_its_steps_and_maps_its_clock_to_the_wall_clock():
    before = time.time_ns() / 1000
    trace = _traced(agreed_us=before)
    # the busiest rows are operators; on a loaded machine an autograd engine row may lead (its self time is
    # scheduling), so the check is that aten operators are among them, not which one is first
    assert trace["steps"] == 4 and any(row["name"].startswith("aten::") for row in trace["top"])
    ops = [e for e in trace["events"] if e.get("ph") == "X" and e["name"].startswith("aten::")]
    assert ops and not any(e["name"] == CLOCK_MARK for e in trace["events"])
    first = min(e["ts"] for e in ops) + trace["clock_us"]  # on the wall clock
    assert before < first < time.time_ns() / 1000


def test_traces_merge_into_one_lane_per_rank_on_one_clock(tmp_path):
    t0 = _traced(agreed_us=1000.0)
    t1 = dict(t0, agreed_us=1000.0 + 5e6, host="elsewhere")  # the same trace, from a host whose clock is 5 s ahead
    path = write_trace({0: t0, 1: t1}, str(tmp_path / "traces"))
    assert os.stat(path).st_mode & 0o777 == 0o600 and os.stat(tmp_path / "traces").st_mode & 0o777 == 0o700
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    lanes = {r: sorted(e["ts"] for e in events if e["pid"] == r and e.get("name", "").startswith("aten::"))
             for r in (0, 1)}
    assert lanes[0] and lanes[0] == pytest.approx([ts + 5e6 for ts in lanes[1]])  # rank 1's clock set back 5 s
    assert min(lanes[1]) >= 0
    same_host = merge_traces({0: t0, 1: dict(t0, agreed_us=1000.0 + 5e6)})  # one host, one clock: no correction
    assert sorted(e["ts"] for e in same_host if e["pid"] == 0 and "ts" in e) == \
        sorted(e["ts"] for e in same_host if e["pid"] == 1 and "ts" in e)
    fig = timeline_figure(path)
    assert fig._repr_png_()[:4] == b"\x89PNG"  # an image as a cell's value in a plain kernel, no pyplot needed
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["rank 0", "rank 1"]
    assert "forward and other operators" in [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    summary = profile_summary(path, {0: t0}, expected=2)
    assert summary["path"] == path and summary["ranks"] == [0]
    assert "no trace from rank(s) [1]" in summary["summary"]


def test_a_profile_of_5_steps_gives_one_chrome_trace_with_a_lane_per_rank(workers, tmp_path):
    h = nbddp.dist_fit(Small(), _data(), epochs=1, max_steps=8, batch_size=4, lr=0.01, optimizer=torch.optim.SGD,
                       live=False, profile={"wait": 1, "warmup": 1, "active": 5, "dir": str(tmp_path)})
    assert h.status == "completed" and h.profile["ranks"] == [0, 1]
    with open(h.profile["path"]) as f:
        events = json.load(f)["traceEvents"]
    assert {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"} == {0: "rank 0",
                                                                                                1: "rank 1"}
    for rank in (0, 1):
        lane = [e for e in events if e["pid"] == rank and e.get("ph") == "X"]
        assert any(e["name"].startswith("aten::") for e in lane)
        assert len({e["name"] for e in lane if e["name"].startswith("ProfilerStep#")}) == 5
        assert h.profile["top_ops"][rank]
        # the gradient all-reduce runs on gloo's threads as "gloo:all_reduce", launched by "c10d::allreduce_"
        assert any(e["name"] == "gloo:all_reduce" for e in lane) and any(e["name"] == "c10d::allreduce_" for e in lane)
        b = h.profile["breakdown"][rank]
        assert b["basis"] == "cpu operators" and b["steps"] == 5
        assert b["compute_s"] > 0 and b["communication_total_s"] > 0 and 0 <= b["overlap"] <= 1
        assert sum(b[f"{k}_share"] for k in ("compute", "communication", "memory", "idle")) == pytest.approx(1)
        assert f"rank {rank} over 5 traced steps (cpu operators): compute " in h.profile["summary"]
    assert h.profile["path"] in h.profile["summary"]


def _x(name: str, ts: float, dur: float, tid: int = 1, cat: str = "cpu_op", pid: int = 0) -> dict:
    return {"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": tid, "ts": ts, "dur": dur}


def test_the_trace_breakdown_counts_compute_communication_and_idle_as_hta_would():
    events = [
        _x("ProfilerStep#1", 0, 100, cat="user_annotation"),
        _x("aten::addmm", 0, 40), _x("aten::empty", 1, 2),  # nested: counted once
        _x("gloo:all_reduce", 30, 30, tid=2, cat="user_annotation"),  # 10 µs of it under the addmm
        _x("c10d::allreduce_", 60, 10), _x("aten::empty", 61, 2),  # an operator inside a collective: not compute
        _x("aten::mul", 80, 10),
        _x("aten::add", 150, 10),  # after the traced steps: not counted
        {"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "rank 0"}},
        _x("ProfilerStep#1", 0, 100, cat="user_annotation", pid=1), _x("aten::mm", 10, 50, pid=1),
    ]
    b = trace_breakdown(events)
    r0 = b[0]
    assert r0["basis"] == "cpu operators" and r0["steps"] == 1 and r0["window_s"] == pytest.approx(100e-6)
    # compute 0-40 and 80-90; communication 30-70 of which 30-40 is hidden; idle 70-80 and 90-100
    assert r0["compute_share"] == pytest.approx(0.5) and r0["communication_share"] == pytest.approx(0.3)
    assert r0["idle_share"] == pytest.approx(0.2) and r0["memory_share"] == 0
    assert r0["communication_total_s"] == pytest.approx(40e-6) and r0["overlap"] == pytest.approx(0.25)
    assert b[1]["compute_share"] == pytest.approx(0.5) and b[1]["overlap"] == 0 and b[1]["idle_share"] == 0.5
    assert breakdown_lines(b)[0] == ("rank 0 over 1 traced steps (cpu operators): compute 50 %, communication 30 % "
                                     "(plus 0.0 ms hidden under compute: 25 % of its communication), idle 20 %")
    assert trace_breakdown([_x("aten::mm", 0, 5)]) == {}  # no traced step: nothing to count over


def test_with_gpu_kernels_the_breakdown_reads_the_kernels():
    events = [
        _x("ProfilerStep#3", 0, 50, cat="user_annotation"),
        _x("aten::mm", 0, 50),  # host work: not what a GPU trace is judged by
        _x("sm80_xmma_gemm", 10, 40, tid=7, cat="kernel"),
        _x("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 40, 30, tid=8, cat="kernel"),  # 10 µs under the gemm
        _x("Memcpy HtoD (Pageable -> Device)", 0, 5, tid=7, cat="gpu_memcpy"),
        _x("Memset (Device)", 45, 5, tid=9, cat="gpu_memset"),  # under compute and communication: not memory
    ]
    b = trace_breakdown(events)[0]
    # the window runs to the last kernel's end (70): compute 10-50, communication 50-70 exposed, memory 0-5
    assert b["basis"] == "gpu kernels" and b["window_s"] == pytest.approx(70e-6)
    assert b["compute_s"] == pytest.approx(40e-6) and b["communication_s"] == pytest.approx(30e-6 - 10e-6)
    assert b["memory_s"] == pytest.approx(5e-6) and b["idle_s"] == pytest.approx(5e-6)
    assert b["overlap"] == pytest.approx(10 / 30)
    # ranks sharing a GPU under gloo communicate on the host: gloo's spans count as communication
    shared = trace_breakdown(events[:3] + [_x("gloo:all_reduce", 50, 10, tid=3, cat="user_annotation")])[0]
    assert shared["communication_s"] == pytest.approx(10e-6) and shared["overlap"] == 0


@pytest.mark.parametrize("bad", ["yes", {"active": 0}])
def test_dist_fit_refuses_a_bad_profile_before_training(workers, bad):
    with pytest.raises((TypeError, ValueError), match=r"dist_fit\(profile="):
        nbddp.dist_fit(Small(), _data(), epochs=1, batch_size=4, live=False, profile=bad)


def test_the_split_costs_under_1_percent_of_a_small_step():
    """A step of 4 ms: the tiny models of these tests take several ms a step on the 2 CPU workers here."""
    from benchmarks.bench_latency import time_split_cost

    cost = time_split_cost(reps=3000, step_s=0.004)
    assert cost["share_of_step"] < 0.01, cost
    assert cost["sync_us"] < 1000, cost  # once per record, about once a second


def test_the_scaling_report_says_where_the_lost_efficiency_went():
    from nbddp.measure.scaling import ScalingReport, lost_shares

    shares_ = lost_shares(split_ranks([_raw(data=1.0, forward=1.0, collective=2.0), _raw(data=1.0, forward=3.0)]))
    assert shares_ == pytest.approx({"data_share": 0.25, "communication_share": 0.0, "wait_share": 0.25})
    assert lost_shares([]) == {}
    row = {"world_size": 1, "samples_per_s": 100.0, "speedup": 1.0, "efficiency": 1.0, "step_s": 0.1,
           "comm_share": 0.0, "peak_mem": 1}
    two = {**row, "world_size": 2, "speedup": 1.2, "efficiency": 0.6, "comm_share": 0.1, **shares_}
    report = ScalingReport(rows=[row, two], batch_size=4, device="cpu")
    assert "10% of a step waits on gradient communication, 25% loads data and 25% waits for a slower rank" \
        in report.recommendation
    assert "waiting for a rank" in repr(report)


# ---------------------------------------------------------------------------
# handle.profile: the request, the traces as they arrive


def _requests():
    from nbddp.profiling.requests import ProfileRequests

    session = SimpleNamespace(file_prefix=f"nbddp-test-{os.getpid()}-req",
                              placements=[SimpleNamespace(rank=0, host="far-away", local=True)])
    return ProfileRequests(session)


def test_a_request_is_an_owner_only_file_that_goes_when_the_traces_are_in():
    requests = _requests()
    try:
        first = requests.ask(3)
        assert os.stat(requests.path).st_mode & 0o777 == 0o600
        with open(requests.path) as f:
            assert json.load(f) == {"id": first, "steps": 3}
        trace = _traced(agreed_us=0.0)
        ars = {0: SimpleNamespace(data={"nbddp-profile": (first, trace)}), 1: SimpleNamespace(data={})}
        requests.collect(ars)
        assert requests.wait(first, timeout=0.01) is None  # rank 1's trace is missing
        ars[1].data["nbddp-profile"] = (first, dict(trace))
        requests.collect(ars)
        result = requests.wait(first, timeout=0.01)
        assert result["ranks"] == [0, 1] and not os.path.exists(requests.path)
        assert sorted(os.listdir(result["rank_traces"])) == ["rank-0.json", "rank-1.json"]  # as HTA reads them
        shutil.rmtree(os.path.dirname(result["path"]))
    finally:
        requests.close()
    assert requests.wait(first + 1, timeout=None) is None  # the fit ended: a waiting call returns


@pytest.mark.parametrize("steps, match", [(0, r"must be a whole number of steps >= 1, got 0"),
                                          (2.5, r"got 2.5")])
def test_a_request_needs_a_whole_number_of_steps(steps, match):
    with pytest.raises(ValueError, match=match):
        _requests().ask(steps)


def test_a_running_fit_traces_10_steps_on_request_and_goes_on(workers, tmp_path):
    handle = nbddp.dist_fit(Small(), _data(4000), epochs=1, batch_size=4, lr=0.01, optimizer=torch.optim.SGD,
                            live=False, block=False, log_every=1)
    try:
        profile = handle.profile(steps=10, dir=tmp_path / "traces")
        assert not handle.done(), "the fit stopped for the profile"
    finally:
        history = handle.stop()
    assert history.status == "interrupted" and profile["ranks"] == [0, 1]
    with open(profile["path"]) as f:
        events = json.load(f)["traceEvents"]
    assert os.path.dirname(profile["path"]) == str(tmp_path / "traces")
    assert os.stat(tmp_path / "traces").st_mode & 0o777 == 0o700
    for rank in (0, 1):
        lane = [e for e in events if e["pid"] == rank and e.get("ph") == "X"]
        assert len({e["name"] for e in lane if e["name"].startswith("ProfilerStep#")}) == 10
        assert any(e["name"].startswith("aten::") for e in lane)
        assert profile["breakdown"][rank]["steps"] == 10
    with pytest.raises(nbddp.NbddpError, match=r"handle.profile\(steps=10\): this fit has ended \(interrupted\); "
                                               r"profile a running fit"):
        handle.profile(steps=10)


def test_a_fit_that_ends_before_any_traced_step_says_so():
    from nbddp.fit.handle import FitHandle

    requests = SimpleNamespace(ask=lambda steps, folder: 1, wait=lambda request, timeout: None)
    run = SimpleNamespace(finished=False, requests=requests, live_state=SimpleNamespace(status="completed"),
                          when_done=lambda fn: None)  # (a handle hears of the end through it)
    with pytest.raises(nbddp.NbddpError, match=r"handle.profile\(steps=5\): the fit ended \(completed\) before its "
                                               r"ranks traced a step"):
        FitHandle(run).profile(steps=5)


def test_the_dashboard_button_profiles_10_steps_and_shows_the_trace():
    from nbddp.live.widget import WidgetView

    asked = []

    def wait(request, timeout):
        return {"summary": f"merged trace of 2 rank(s): /tmp/trace-{request}.json", "path": "/tmp/x"}

    requests = SimpleNamespace(ask=lambda steps: asked.append(steps) or len(asked), wait=wait)
    view = WidgetView()
    run = _run()
    run.finished, run.requests = False, requests
    view.profile_button.run = run
    view.profile_button.button.click()
    view.profile_button.thread.join(10)
    assert asked == [10] and "merged trace of 2 rank(s): /tmp/trace-1.json" in view.profile_button.result.value
    assert not view.profile_button.button.disabled  # the fit goes on: it may be asked again

    def failing(steps):
        raise RuntimeError("rank 0 runs on far-away")

    run.requests = SimpleNamespace(ask=failing, wait=wait)
    view.profile_button.button.click()
    view.profile_button.thread.join(10)
    assert "profile failed: RuntimeError: rank 0 runs on far-away" in view.profile_button.result.value
    run.finished = True
    view.profile_button.button.click()  # an ended fit: nothing to profile
    assert "far-away" in view.profile_button.result.value
