"""Every rank's reports, reduced per step in the kernel, in step order.

A rank's record of step ``s`` is final once that rank reported a later step
or ended (a step can be reported again to add metrics). Step ``s`` is
reduced once every rank's record of it is final; a rank that has reported
nothing ``SILENT_S`` after the first report of the call is taken to report
nothing (code that reports from rank 0 only: accelerate's trackers), until
it does. Each metric is reduced over the ranks that reported it at that
step, as the lowest of them asked (``protocol/reports.py``); the ranks' own
values are kept (``rank_steps``). Two ranks reporting different names at one
step are told once, naming both ranks and the metrics.
"""

from __future__ import annotations

import math
import time
from typing import Any

from nbddp.protocol.notices import notify
from nbddp.protocol.reports import SAMPLES, ReportBatch, ReportRecord, how_reduced, reduce_values

SILENT_S = 2.0


class ReportCollector:
    """Takes ``ReportBatch``es of ``ranks``; ``ready()`` gives the reduced records not given yet."""

    def __init__(self, ranks: list[int], clock: Any = time.monotonic):
        self.ranks = list(ranks)
        self.clock = clock
        # rank -> seq -> record not given out yet (a given-out one is dropped: a later batch repeating it is ignored)
        self.records: dict[int, dict[int, ReportRecord]] = {r: {} for r in ranks}
        self.floor = dict.fromkeys(ranks, 0)  # rank -> the first seq not given out
        self.last_step: dict[int, int] = {}  # rank -> its latest reported step
        self.final: set[int] = set()  # ranks whose last batch came (or whose task ended)
        self.checks_stop: set[int] = set()
        self.stopped_at: dict[int, int] = {}
        self.positions: dict[int, int] = {}  # rank -> the furthest step its should_stop(step) was told
        self.first_seen: float | None = None
        self.done_through = -1  # the last step given out
        self.t0: float | None = None  # the first record's time on the ranks
        self.last_time: dict[int, float] = {}  # rank -> time of its last step given out (samples/s)
        self.told: set[tuple[int, int, frozenset[str]]] = set()
        self.mismatches = 0

    @property
    def reported(self) -> bool:
        return bool(self.last_step)

    def take(self, batch: ReportBatch) -> None:
        if batch.rank not in self.records:
            return
        if self.first_seen is None and batch.window:
            self.first_seen = self.clock()
        mine, floor = self.records[batch.rank], self.floor[batch.rank]
        for seq, raw in batch.window:
            if seq >= floor:
                record = mine[seq] = ReportRecord._make(raw)
                self.last_step[batch.rank] = max(record.step, self.last_step.get(batch.rank, record.step))
        if batch.final:
            self.final.add(batch.rank)
        if batch.checks_stop:
            self.checks_stop.add(batch.rank)
        self.positions[batch.rank] = batch.position
        if batch.stopped_at is not None:
            self.stopped_at[batch.rank] = batch.stopped_at

    def ended(self, rank: int) -> None:
        """``rank``'s task ended: whatever it reported is final."""
        self.final.add(rank)

    def last_steps(self) -> dict[int, int]:
        """Each rank's latest reported step (ranks that reported)."""
        return dict(self.last_step)

    def _frontier(self) -> float:
        """The last step every reporting rank is done with."""
        silent_ok = self.first_seen is not None and self.clock() - self.first_seen >= SILENT_S
        edges = []
        for r in self.records:
            if r in self.final:
                continue
            if r not in self.last_step:
                if not silent_ok:
                    return -math.inf
                continue
            edges.append(self.last_step[r] - 1)
        return min(edges, default=math.inf)

    def ready(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Reduced records and per-rank rows of the steps completed since the last call, in step order."""
        frontier = self._frontier()
        by_step: dict[int, dict[int, ReportRecord]] = {}
        for r, recs in self.records.items():
            for seq in [seq for seq, record in recs.items() if record.step <= frontier]:
                record = recs.pop(seq)
                self.floor[r] = max(self.floor[r], seq + 1)
                if record.step > self.done_through:
                    by_step.setdefault(record.step, {})[r] = record
        reduced, per_rank = [], []
        for step in sorted(by_step):
            row, ranks_rows = self._reduce(step, by_step[step])
            reduced.append(row)
            per_rank += ranks_rows
            self.done_through = step
        return reduced, per_rank

    def _reduce(self, step: int, at: dict[int, ReportRecord]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """One step over the ranks: the reduced row and each rank's own. It runs for every step of every call
        in the kernel's thread, beside ranks that fill the machine's cores: the usual case, every rank
        reporting the same names, is one pass."""
        ranks = sorted(at)
        recs = [at[r] for r in ranks]
        first = recs[0]
        same = all(rec.values.keys() == first.values.keys() for rec in recs[1:])
        if not same:
            self._check_names(step, at)
        if self.t0 is None:
            self.t0 = min(rec.time for rec in recs)
        row: dict[str, Any] = {"step": step}
        names = first.values if same else dict.fromkeys(k for rec in recs for k in rec.values)
        for name in names:
            having = recs if same else [rec for rec in recs if name in rec.values]
            how = "sum" if name == SAMPLES else how_reduced(having[0], name)
            row[name] = reduce_values([float(rec.values[name]) for rec in having], how)
        rows = []
        speed = 0.0
        for r, rec in zip(ranks, recs):
            own: dict[str, Any] = {"step": step, "rank": r, **rec.values}
            before = self.last_time.get(r)
            if SAMPLES in rec.values and before is not None and rec.time > before:
                own["samples_per_s"] = float(rec.values[SAMPLES]) / (rec.time - before)
                speed += own["samples_per_s"]
            self.last_time[r] = rec.time
            rows.append(own)
        if speed:
            row["samples_per_s"] = speed
        row["time"] = max(rec.time for rec in recs) - self.t0
        return row, rows

    def _check_names(self, step: int, at: dict[int, ReportRecord]) -> None:
        ranks = sorted(at)
        first = ranks[0]
        names = set(at[first].values)
        for r in ranks[1:]:
            other = set(at[r].values)
            if other == names:
                continue
            self.mismatches += 1
            key = (first, r, frozenset(names ^ other))
            if key in self.told:
                continue
            self.told.add(key)
            only_first, only_other = sorted(names - other), sorted(other - names)
            notify(f"nbddp.report: at step {step}, rank {first} reported {sorted(names)} and rank {r} reported "
                   f"{sorted(other)} (only on rank {first}: {only_first or 'none'}; only on rank {r}: "
                   f"{only_other or 'none'}). Each metric is reduced over the ranks that reported it; report the "
                   "same names on every rank at a step (reduce=None keeps rank 0's value)", stacklevel=2)
