"""A fit's time split: seconds per phase per rank, with the wait for the slowest rank told apart.

Each rank sends its seconds per marked phase (``messages.TIMED_PHASES``).
The loop meets its peers in two kinds of phase: ``collective`` (the
per-record reduction, agreements) and ``backward`` (where DDP all-reduces the
gradients). Between two meetings a rank does its own work, the rest of the
phases; the rank with the most of it arrives last, and every other rank waits
for it, inside a meeting, for the difference. So a rank's *wait* is how much
less own work it did than the slowest rank, and at most how much longer it
spent in the meeting phases than the rank that spent least there (the latter
keeps a rank whose backward computes longer from counting as waiting). The
wait comes out of ``collective`` first, then out of ``backward``; what stays
of ``collective`` is *communication*.

Compute is forward, backward and the optimizer step; the efficiency is its
share of the time.
"""

from __future__ import annotations

from typing import Any, Sequence

from nbddp.protocol.messages import TIMED_PHASES, timed_phases

SPLIT_PHASES = ("data", "forward", "backward", "optimizer", "communication", "wait", "validation", "checkpoint",
                "other")
COMPUTE = ("forward", "backward", "optimizer")
WORDS = {"data": "data loading", "forward": "the forward pass", "backward": "the backward pass",
         "optimizer": "the optimizer step", "communication": "communication", "wait": "waiting for a slower rank",
         "validation": "validation", "checkpoint": "checkpointing", "other": "other work"}
STRAGGLER_MIN = 0.1  # a rank this much slower than the fastest is named (less is noise on a busy host)


def split_ranks(raw: Sequence[dict[str, float]]) -> list[dict[str, float]]:
    """Every rank's seconds per ``SPLIT_PHASES``, from its seconds per marked phase (rank order)."""
    raw = [timed_phases(r) for r in raw]
    if not raw:
        return []
    own = [sum(r.values()) - r["backward"] - r["collective"] for r in raw]
    least_c = min(r["collective"] for r in raw)
    least_b = min(r["backward"] for r in raw)
    out = []
    for r, work in zip(raw, own):
        extra_c, extra_b = r["collective"] - least_c, r["backward"] - least_b
        wait = max(0.0, min(max(own) - work, extra_c + extra_b))
        from_c = min(wait, extra_c)
        split = {p: r[p] for p in SPLIT_PHASES if p in TIMED_PHASES}
        split.update(backward=r["backward"] - (wait - from_c), communication=r["collective"] - from_c, wait=wait)
        out.append({p: split[p] for p in SPLIT_PHASES})
    return out


def shares(split: dict[str, float]) -> dict[str, float]:
    total = sum(split.values())
    return {p: (s / total if total > 0 else 0.0) for p, s in split.items()}


def efficiency(split: dict[str, float]) -> float:
    """The compute share of a rank's time (forward, backward, optimizer)."""
    s = shares(split)
    return sum(s[p] for p in COMPUTE)


def pct(share: float) -> str:
    return f"{share * 100:.0f} %"


def summary(splits: Sequence[dict[str, float]]) -> str:
    """One sentence: the straggler and why, who waits for it, and the largest share that is not compute."""
    if not splits or sum(sum(s.values()) for s in splits) <= 0:
        return ""
    mean = {p: sum(shares(s)[p] for s in splits) / len(splits) for p in SPLIT_PHASES}
    largest = max((p for p in SPLIT_PHASES if p not in COMPUTE), key=lambda p: mean[p])
    compute = sum(mean[p] for p in COMPUTE)
    where = " on average over the ranks" if len(splits) > 1 else ""
    parts = [_straggler(splits),
             f"{WORDS[largest]} takes {pct(mean[largest])} of the time{where}, the largest share besides compute "
             f"({pct(compute)})"]
    return "; ".join(p for p in parts if p)


def _straggler(splits: Sequence[dict[str, float]]) -> str:
    """``rank 1 is 18 % slower (data loading); rank 0 waits 15 % of each step for it``, or "" if none stands out."""
    busy = [sum(s.values()) - s["wait"] for s in splits]
    slow = max(range(len(busy)), key=busy.__getitem__)
    fastest = min(busy)
    if len(splits) < 2 or fastest <= 0 or busy[slow] / fastest - 1 < STRAGGLER_MIN:
        return ""
    others = [s for r, s in enumerate(splits) if r != slow]
    gap = {p: splits[slow][p] - sum(o[p] for o in others) / len(others) for p in SPLIT_PHASES if p != "wait"}
    why = max(gap, key=gap.__getitem__)
    waiter = max((r for r in range(len(splits)) if r != slow), key=lambda r: shares(splits[r])["wait"])
    return (f"rank {slow} is {pct(busy[slow] / fastest - 1)} slower ({WORDS[why]}); "
            f"rank {waiter} waits {pct(shares(splits[waiter])['wait'])} of each step for it")


def split_frame(ranks: Sequence[dict[str, Any]]) -> Any:
    """``History.time_split()``: a DataFrame, one row per rank (seconds per phase, shares, efficiency)."""
    try:
        import pandas as pd
    except ImportError:
        raise ModuleNotFoundError("History.time_split() needs pandas: pip install pandas", name="pandas") from None
    rows = []
    for r in ranks:
        split = r.get("time_split")
        if split is None:
            continue
        share = shares(split)
        rows.append({"rank": r["rank"], **split, "total": sum(split.values()),
                     **{f"{p}_share": share[p] for p in SPLIT_PHASES}, "efficiency": efficiency(split)})
    columns = ["rank", *SPLIT_PHASES, "total", *(f"{p}_share" for p in SPLIT_PHASES), "efficiency"]
    frame = pd.DataFrame(rows, columns=columns).set_index("rank")
    frame.attrs["summary"] = summary([r["time_split"] for r in ranks if r.get("time_split") is not None])
    return frame
