"""``dist_fit(profile=...)`` on one rank: torch.profiler over the steps every rank traces, and its trace.

Every rank runs the same ``torch.profiler.schedule`` from its first
optimizer step, so the traces cover the same steps. The trace goes back
in the rank's result (no collective); the kernel merges the ranks' traces
into one file (``nbddp/profiling/trace_merge.py``).

The profiler's clock is not the wall clock (on this machine they differ by
seconds), so each traced step starts with a tiny ``nbddp::clock`` range
taken together with ``time.time_ns()``: their difference maps the trace onto
the wall clock. The wall time at which this rank left the set-up agreement
(a collective that every rank leaves together) lets the kernel take out
the difference between the hosts' wall clocks.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import tempfile
import time
from typing import Any

import torch

from nbddp.protocol.profile_spec import ProfileSpec

CLOCK_MARK = "nbddp::clock"
TOP_OPS = 10
# the export's own clock and name: they no longer hold once the kernel moves the events onto rank 0's clock
DROPPED_META = ("traceEvents", "traceName", "baseTimeNanoseconds")


class StepProfiler:
    """torch.profiler on this rank, stepped after each optimizer step; it stops itself after the schedule."""

    def __init__(self, spec: ProfileSpec, device: torch.device, agreed_us: float):
        from torch.profiler import ProfilerActivity, profile, schedule

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.spec, self.agreed_us = spec, agreed_us
        self.walls: list[float] = []  # wall time (µs) of every step's clock mark
        self.events: list[dict[str, Any]] = []
        self.meta: dict[str, Any] = {}  # the export's top level (deviceProperties, distributedInfo): HTA reads it
        self.offsets: list[float] = []  # wall µs minus profiler µs, one per traced step
        self.top: list[dict[str, Any]] = []
        self.steps = 0
        self.prof: Any = profile(activities=activities, on_trace_ready=self._ready,
                                 schedule=schedule(wait=spec.wait, warmup=spec.warmup, active=spec.active,
                                                   repeat=spec.repeat),
                                 record_shapes=spec.record_shapes, profile_memory=spec.profile_memory,
                                 with_stack=spec.with_stack)
        self.prof.start()

    def step(self) -> None:
        """After an optimizer step: a clock mark, then the profiler's step; closed after the last traced step."""
        if self.prof is None:
            return
        with torch.profiler.record_function(CLOCK_MARK):
            self.walls.append(time.time_ns() / 1000)
        self.prof.step()
        self.steps += 1
        if self.steps >= self.spec.steps:
            self.close()

    def close(self) -> dict[str, Any] | None:
        """Stop (a fit that ended early keeps what was traced); the trace for the kernel, or None if none."""
        if self.prof is not None:
            prof, self.prof = self.prof, None
            prof.stop()
        if not self.events:
            return None
        return {"events": self.events, "clock_us": statistics.median(self.offsets) if self.offsets else 0.0,
                "agreed_us": self.agreed_us, "host": socket.gethostname(), "top": self.top, "steps": self.steps, "meta": self.meta}

    def _ready(self, prof: Any) -> None:
        """One cycle of the schedule is traced: keep its events, its clock offsets and its top operators."""
        fd, path = tempfile.mkstemp(prefix="nbddp-trace-", suffix=".json")  # 0600
        os.close(fd)
        try:
            prof.export_chrome_trace(path)
            with open(path) as f:
                doc = json.load(f)
        finally:
            os.remove(path)
        events = doc["traceEvents"]
        self.meta = {k: v for k, v in doc.items() if k not in DROPPED_META}
        marks = sorted((e for e in events if e.get("name") == CLOCK_MARK and e.get("ph") == "X"),
                       key=lambda e: e["ts"])
        walls = self.walls[len(self.walls) - len(marks):] if marks else []
        self.offsets += [w - (e["ts"] + e.get("dur", 0) / 2) for w, e in zip(walls, marks)]
        self.events += [e for e in events if e.get("name") != CLOCK_MARK]
        self.top = top_operators(prof)


def top_operators(prof: Any, n: int = TOP_OPS) -> list[dict[str, Any]]:
    """The operators with the most self time (CPU, and CUDA where traced), as torch's ``key_averages`` counts them."""
    rows = []
    for e in prof.key_averages():
        if e.key.startswith("ProfilerStep") or e.key == CLOCK_MARK:
            continue
        cuda = getattr(e, "self_device_time_total", 0.0) or 0.0
        rows.append({"name": e.key, "calls": e.count, "self_cpu_us": e.self_cpu_time_total, "self_cuda_us": cuda})
    rows.sort(key=lambda r: r["self_cpu_us"] + r["self_cuda_us"], reverse=True)
    return rows[:n]
