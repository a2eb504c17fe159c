"""The time split in the views: a stacked bar per rank, and the sentence that names the straggler.

Live, from the seconds every rank sent in the last reduction
(``LiveState.ranks[r]["phase_s"]``); at the end, from ``History.ranks``
(every rank's own total, the time after the last reduction included).
"""

from __future__ import annotations

import html
from nbddp.live.state import ViewedFit
from nbddp.profiling.time_split import SPLIT_PHASES, WORDS, shares, split_ranks, summary

COLOURS = {"data": "#ff7f0e", "forward": "#1f77b4", "backward": "#2ca02c", "optimizer": "#17becf",
           "communication": "#9467bd", "wait": "#d62728", "validation": "#bcbd22", "checkpoint": "#8c564b",
           "other": "#7f7f7f"}
BAR_PX = 160


def rank_splits(run: ViewedFit) -> list[dict[str, float]]:
    """Each rank's split as far as known (rank order), or ``[]`` before the first reduction."""
    ranks = run.history.ranks
    final = [r["time_split"] for r in ranks if r.get("time_split") is not None]
    if final and len(final) == len(ranks):
        return final
    live = run.live_state.ranks or []
    if not live or not all("phase_s" in r for r in live):
        return []
    return split_ranks([r["phase_s"] for r in sorted(live, key=lambda r: r["rank"])])


def split_sentence(run: ViewedFit) -> str:
    """``rank 1 is 18 % slower (data loading); rank 0 waits 15 % of each step for it; ...`` ("" before data)."""
    return summary(rank_splits(run))


def bar_html(split: dict[str, float] | None) -> str:
    """A stacked bar, one segment per phase, its width the phase's share; the title says the seconds."""
    if not split or sum(split.values()) <= 0:
        return "-"
    share = shares(split)
    segments = "".join(
        f"<span title='{html.escape(WORDS[p])}: {split[p]:.2f} s ({share[p] * 100:.0f} %)' "
        f"style='display:inline-block;height:10px;width:{share[p] * BAR_PX:.1f}px;background:{COLOURS[p]}'></span>"
        for p in SPLIT_PHASES if share[p] > 0.005)
    return f"<span class='nbddp-split' style='display:inline-block;width:{BAR_PX}px;white-space:nowrap'>{segments}</span>"


def legend_html() -> str:
    return " ".join(f"<span style='color:{COLOURS[p]}'>&#9632;</span> {p}" for p in SPLIT_PHASES)


def split_html(run: ViewedFit) -> str:
    """The legend and the sentence, under the rank table."""
    sentence = split_sentence(run)
    if not sentence:
        return ""
    return (f"<div class='nbddp-time-split' style='font-size:12px'>{legend_html()}<br/>"
            f"{html.escape(sentence)}</div>")
