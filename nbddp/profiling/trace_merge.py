"""The ranks' profiler traces merged into one Chrome/Perfetto trace file: one process lane per rank.

Each rank sends its trace events (``worker/training/profiler.py``) with
``clock_us`` (its wall clock minus its profiler clock) and ``agreed_us``
(the wall time it left the set-up agreement, which all ranks leave
together). An event of rank ``r`` at profiler time ``ts`` happened at
``ts + clock_us[r] - (agreed_us[r] - agreed_us[0])`` on rank 0's wall
clock, or ``ts + clock_us[r]`` when it ran on rank 0's host (one wall
clock: the agreement's exit times differ only by scheduling, which on a
busy machine is milliseconds); the merged file counts from its first event.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Any

from nbddp.protocol.messages import FitResult
from nbddp.protocol.profile_spec import ProfileSpec

from nbddp.profiling.hta_analysis import (has_gpu_kernels, hta_analyses, hta_lines, rank_trace_path,
                                           write_rank_traces)
from nbddp.profiling.trace_analysis import breakdown_lines, trace_breakdown

PROCESS_META = ("process_name", "process_labels", "process_sort_index")
FLOW_PHASES = ("s", "t", "f")
TID_STRIDE = 1_000_000  # a rank's second process (a GPU's lanes) keeps its threads apart from the first's


def clock_shifts(traces: dict[int, dict[str, Any]]) -> dict[int, float]:
    """What to add to each rank's profiler timestamps to put them on rank 0's wall clock, counted from the
    first event of all ranks (the merged file's zero; the per-rank files HTA reads use the same)."""
    ranks = sorted(traces)
    first = traces[ranks[0]]
    # ranks on rank 0's host share its wall clock: only another host's clock is set by the agreement
    shift = {r: t["clock_us"] - (t["agreed_us"] - first["agreed_us"] if t.get("host") != first.get("host") else 0.0)
             for r, t in traces.items()}
    start = min((e["ts"] + shift[r] for r in ranks for e in traces[r]["events"] if "ts" in e and e.get("ph") != "M"),
                default=0.0)
    return {r: s - start for r, s in shift.items()}


def merge_traces(traces: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """Every rank's events on one clock, each rank one process (``pid`` = rank, named ``rank N``)."""
    shifts = clock_shifts(traces)
    merged: list[dict[str, Any]] = []
    for r in sorted(traces):
        merged += [{"ph": "M", "name": "process_name", "pid": r, "tid": 0, "args": {"name": f"rank {r}"}},
                   {"ph": "M", "name": "process_sort_index", "pid": r, "tid": 0, "args": {"sort_index": r}}]
        merged += _rank_events(traces[r]["events"], r, len(traces), shifts[r])
    return merged


def _rank_events(events: list[dict[str, Any]], rank: int, world: int, shift: float) -> list[dict[str, Any]]:
    pids = {e.get("pid") for e in events}
    host = next((e["pid"] for e in events if e.get("ph") == "X" and e.get("name", "").startswith("aten::")), None)
    order = {pid: i for i, pid in enumerate(sorted(pids, key=lambda p: (p != host, str(p))))}
    out = []
    for e in events:
        if e.get("ph") == "M" and e.get("name") in PROCESS_META:
            continue
        e = dict(e)
        tid = e.get("tid", 0)
        e["tid"] = tid + order[e.get("pid")] * TID_STRIDE if isinstance(tid, int) else f"{order[e.get('pid')]}:{tid}"
        e["pid"] = rank
        if "ts" in e:
            e["ts"] = e["ts"] + shift
        if e.get("ph") in FLOW_PHASES and isinstance(e.get("id"), int):
            e["id"] = e["id"] * world + rank  # flows (CPU launch -> GPU kernel) stay within their rank
        out.append(e)
    return out


def write_trace(traces: dict[int, dict[str, Any]], folder: str | None) -> str:
    """Merge and write the trace, owner-only; return its path (in ``folder``, or a new private temporary one).

    Each rank's own trace goes next to it, in ``<trace>-ranks/`` (``rank_traces_of``), as HTA reads them."""
    if folder is None:
        folder = tempfile.mkdtemp(prefix="nbddp-profile-")  # 0700
    else:
        os.makedirs(folder, mode=0o700, exist_ok=True)
    path = os.path.join(folder, time.strftime("nbddp-trace-%Y%m%d-%H%M%S.json"))
    doc = {"traceEvents": merge_traces(traces), "displayTimeUnit": "ms",
           "otherData": {"nbddp": {"ranks": sorted(traces), "steps": {r: t["steps"] for r, t in traces.items()}}}}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f)
    write_rank_traces(traces, clock_shifts(traces), rank_traces_of(path))
    return path


def rank_traces_of(path: str) -> str:
    """The folder of the per-rank traces written with the merged trace at ``path``."""
    return os.path.splitext(path)[0] + "-ranks"


def profile_summary(path: str, traces: dict[int, dict[str, Any]], expected: int) -> dict[str, Any]:
    """``History.profile``: the file, the ranks it holds, each rank's top operators by self time, and its
    compute, communication and idle shares over the traced steps (``trace_analysis.py``)."""
    missing = [r for r in range(expected) if r not in traces]
    top = {r: t["top"] for r, t in sorted(traces.items())}
    with open(path) as f:
        breakdown = trace_breakdown(json.load(f)["traceEvents"])
    lines = [f"merged trace of {len(traces)} rank(s): {path} (open it in https://ui.perfetto.dev or chrome://tracing)"]
    for r, ops in top.items():
        shown = ", ".join(f"{o['name']} {o['self_cpu_us'] / 1000:.1f} ms" for o in ops[:3])
        lines.append(f"rank {r}: {shown}")
    lines += breakdown_lines(breakdown)
    folder = rank_traces_of(path)
    hta = hta_analyses({r: rank_trace_path(folder, r) for r in sorted(traces)},
                       [r for r, t in sorted(traces.items()) if has_gpu_kernels(t)])
    lines += hta_lines(hta)
    if missing:
        lines.append(f"no trace from rank(s) {missing}: the fit ended before their first traced step")
    return {"path": path, "ranks": sorted(traces), "top_ops": top, "breakdown": breakdown, "hta": hta,
            "rank_traces": folder, "summary": "\n".join(lines)}


def gathered_profile(results: dict[int, FitResult], spec: ProfileSpec, world: int) -> dict[str, Any]:
    """From every rank's fit result, the merged trace written and summarised (``History.profile``)."""
    traces: dict[int, dict[str, Any]] = {r: trace for r, res in results.items()
                                         if (trace := getattr(res, "profile", None))}
    if not traces:
        return {"path": None, "ranks": [], "top_ops": {}, "breakdown": {}, "hta": None, "rank_traces": None,
                "summary": f"no trace: the fit ended before the profile's first traced step (step "
                           f"{spec.wait + spec.warmup + 1}); train longer or lower wait/warmup"}
    return profile_summary(write_trace(traces, spec.dir), traces, world)
