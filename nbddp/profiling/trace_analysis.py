"""What the merged trace says about each rank, as Holistic Trace Analysis (HTA) would: compute, communication, idle.

HTA's temporal breakdown and its communication/computation overlap read the
GPU kernels of per-rank traces; on CPU traces (gloo) they fail or give NaN
(HTA 0.5.0, tried on this project's traces). So nbddp computes the same
figures from the Chrome trace events itself, on whichever side does the work:

* with GPU kernels in a rank's lane: the kernels. NCCL kernels are
  communication, memory copies and sets are memory, every other kernel is
  compute (HTA's categories); so are gloo's collectives on the host (ranks
  sharing a GPU under gloo communicate through host memory);
* on CPU: the operators (``cpu_op``) on the rank's threads. The collectives
  are ``c10d::``/``gloo:``/``nccl:``/``record_param_comms`` events, the
  gloo ones on gloo's own threads; an operator inside a collective on the
  same thread (an ``aten::empty`` of the all-reduce) is part of it, not compute.

Over the traced steps of a rank (its ``ProfilerStep#`` ranges), every
instant is counted once, in the first of compute, communication, memory
that is busy then, or as idle: the shares add up to 1. ``overlap`` is the
share of communication time with compute running at the same time
(HTA's ``get_comm_comp_overlap``): communication hidden under compute.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

Span = tuple[float, float]

COMM_PREFIXES = ("c10d::", "gloo:", "nccl:", "record_param_comms")
GPU_KINDS = ("kernel", "gpu_memcpy", "gpu_memset")
SHARES = ("compute", "communication", "memory", "idle")


def union(spans: Iterable[Span]) -> list[Span]:
    """The spans merged: sorted, disjoint."""
    out: list[Span] = []
    for a, b in sorted(s for s in spans if s[1] > s[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def length(spans: Sequence[Span]) -> float:
    return sum(b - a for a, b in spans)


def intersect(xs: Sequence[Span], ys: Sequence[Span]) -> list[Span]:
    """Where both sets of disjoint sorted spans cover."""
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if a < b:
            out.append((a, b))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def minus(xs: Sequence[Span], ys: Sequence[Span]) -> list[Span]:
    """What of ``xs`` ``ys`` does not cover (both disjoint and sorted); one pass over each."""
    out: list[Span] = []
    j = 0
    for a, b in xs:
        while j < len(ys) and ys[j][1] <= a:
            j += 1
        k = j
        while k < len(ys) and ys[k][0] < b:
            if ys[k][0] > a:
                out.append((a, ys[k][0]))
            a = max(a, ys[k][1])
            k += 1
        if a < b:
            out.append((a, b))
    return out


def is_comm(name: str) -> bool:
    return name.startswith(COMM_PREFIXES) or "nccl" in name.lower()


def _span(e: dict[str, Any]) -> Span:
    return (float(e["ts"]), float(e["ts"]) + float(e["dur"]))


def rank_busy(events: Sequence[dict[str, Any]]) -> tuple[str, dict[str, list[Span]]]:
    """The basis (``"gpu kernels"`` or ``"cpu operators"``) and the busy spans of one rank, by kind."""
    kernels = [e for e in events if e.get("cat") in GPU_KINDS]
    if kernels:
        return "gpu kernels", {
            "compute": union(_span(e) for e in kernels if e["cat"] == "kernel" and not is_comm(e["name"])),
            "communication": union([_span(e) for e in kernels if e["cat"] == "kernel" and is_comm(e["name"])]
                                   + [_span(e) for e in events if e.get("name", "").startswith("gloo:")]),
            "memory": union(_span(e) for e in kernels if e["cat"] != "kernel")}
    comm, compute = [], []
    for tid in {e.get("tid") for e in events}:
        mine = [e for e in events if e.get("tid") == tid]
        c = union(_span(e) for e in mine if is_comm(e["name"]))
        comm += c
        compute += minus(union(_span(e) for e in mine if e.get("cat") == "cpu_op" and not is_comm(e["name"])), c)
    return "cpu operators", {"compute": union(compute), "communication": union(comm), "memory": []}


def rank_breakdown(events: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """One rank's shares over its traced steps, or None when its lane holds no step."""
    timed = [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e]
    steps = [_span(e) for e in timed if e.get("name", "").startswith("ProfilerStep#")]
    if not steps:
        return None
    basis, busy = rank_busy(timed)
    start = min(a for a, _ in steps)
    end = max([b for _, b in steps] + ([b for _, b in busy["compute"] + busy["communication"] + busy["memory"]]
                                       if basis == "gpu kernels" else []))  # kernels finish after their launch
    window = [(start, end)]
    compute = intersect(busy["compute"], window)
    comm = intersect(busy["communication"], window)
    memory = intersect(busy["memory"], window)
    exposed_comm = minus(comm, compute)
    exposed_mem = minus(minus(memory, compute), comm)
    total = end - start
    seconds = {"compute": length(compute), "communication": length(exposed_comm), "memory": length(exposed_mem)}
    seconds["idle"] = max(0.0, total - sum(seconds.values()))
    overlap = length(intersect(comm, compute))
    return {"basis": basis, "steps": len(steps), "window_s": total / 1e6,
            **{f"{k}_s": v / 1e6 for k, v in seconds.items()},
            **{f"{k}_share": (v / total if total > 0 else 0.0) for k, v in seconds.items()},
            "communication_total_s": length(comm) / 1e6, "overlap_s": overlap / 1e6,
            "overlap": overlap / length(comm) if comm else 0.0}


def trace_breakdown(events: Sequence[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Every rank's breakdown from a merged trace's events (``pid`` = rank)."""
    ranks = sorted({e["pid"] for e in events if isinstance(e.get("pid"), int)})
    out = {}
    for r in ranks:
        b = rank_breakdown([e for e in events if e.get("pid") == r])
        if b is not None:
            out[r] = b
    return out


def breakdown_lines(breakdown: dict[int, dict[str, Any]]) -> list[str]:
    """One line a rank: ``rank 0: compute 41 %, communication 12 % (30 % of it hidden under compute), idle 47 %``."""
    lines = []
    for r, b in sorted(breakdown.items()):
        memory = f", memory copies {b['memory_share'] * 100:.0f} %" if b["memory_s"] > 0 else ""
        hidden = (f" (plus {b['overlap_s'] * 1000:.1f} ms hidden under compute: {b['overlap'] * 100:.0f} % of "
                  f"its communication)" if b["communication_total_s"] > 0 else "")
        lines.append(f"rank {r} over {b['steps']} traced steps ({b['basis']}): compute "
                     f"{b['compute_share'] * 100:.0f} %, communication {b['communication_share'] * 100:.0f} %"
                     f"{hidden}{memory}, idle {b['idle_share'] * 100:.0f} %")
    return lines
