"""A cell, ``nbddp.run`` call or script that reports: the live view, the History, the hooks, the agreed stop.

``watch_reports`` waits for a ``RankCall`` as ``cells/rank_output.py`` does
(the ranks' output printed at every tick) and, at the same ticks, takes
every rank's ``ReportBatch`` into a ``ReportCollector``. Nothing shows until
the first reduced record: a cell that reports nothing prints as before.
Then the dist_fit view (``live/``) appears under the cell, the loggers and
callbacks get each record from their own thread (``callbacks/fit_hooks.py``),
and the call's History is ``nbddp.last_history()``.

The stop (the Stop button, Kernel > Interrupt, a callback): when every rank
asks ``should_stop()`` and runs on the kernel's host, the kernel picks a step
``STOP_LEAD_S`` of steps past the furthest rank it has seen, and leaves each
rank a note (``protocol/reports.stop_note``); each answers True at that step.
Otherwise, or if the ranks have not ended ``STOP_GRACE_S`` later, the stop
is the call's interrupt (``execution/calls.py``), as for any cell.
"""

from __future__ import annotations

import math
import os
import time
import traceback
from collections.abc import Collection
from typing import Any

from nbddp.callbacks.fit_hooks import FitHooks
from nbddp.cells.live_lines import Drawing
from nbddp.cells.rank_output import RankOutput, call_with_output
from nbddp.execution.calls import RankCall
from nbddp.fit.history import History
from nbddp.live import NullView, View, choose_view
from nbddp.live.choice import LiveChoice
from nbddp.live.state import LiveState
from nbddp.protocol.fit_options import FitConfig
from nbddp.profiling.time_split import split_ranks
from nbddp.protocol.messages import TIMED_PHASES, FitPlanInfo, RankInfo
from nbddp.protocol.notes import write_note
from nbddp.protocol.notices import notify, report
from nbddp.protocol.reports import stop_note
from nbddp.reports.collector import ReportCollector
from nbddp.reports.inbox import ReportInbox
from nbddp.session.session import Session

PHASE_PREFIX = "time_"  # report(time_forward=s, ...): seconds of a phase, for History.time_split()
STOP_LEAD_S = 1.0  # the agreed stop step lies this many seconds of steps past the furthest rank seen
STOP_GRACE_S = 10.0  # then, if the ranks have not ended, the call is interrupted as any cell is
PERSON_STOP = "stopped from the notebook (Kernel > Interrupt or the Stop button)"
OUTPUT_WAIT_S = 2.0  # at the end, how long an ended rank's last published data is waited for


def output_done(ar: Any, timeout: float) -> bool:
    """Whether everything the task of ``ar`` published has arrived (waiting up to ``timeout`` s)."""
    try:
        return bool(ar.wait_for_output(timeout))
    except Exception:  # noqa: BLE001 - a dead engine's task: nothing more will come
        return True


class ReportedRun:
    """One call's reports (see the module docstring); what a view reads of it (``live.state.ViewedFit``)."""

    def __init__(self, session: Session, call: RankCall, reports: ReportInbox, live: LiveChoice,
                 hooks: FitHooks | None):
        self.session, self.call, self.reports, self.live = session, call, reports, live
        self.hooks = hooks if hooks else None
        self.collector = ReportCollector(sorted(call.tasks.ars))
        self.history = History(world_size=len(call.tasks.ars))
        self.history.status = "running"
        placements = [RankInfo(p.rank, p.host, p.device, p.pid) for p in session.placements
                      if p.rank in call.tasks.ars]
        self.live_state = LiveState(status="training", world_size=len(call.tasks.ars), backend=session.backend,
                                    placements=placements, kind="report")
        self.view: View | None = None
        self.started_at = time.perf_counter()
        self.error: BaseException | None = None
        self.stop_reason: str | None = None
        self.stop_at: int | None = None
        self.stop_sent_at: float | None = None
        self.notes: list[str] = []
        self.requests: Any = None  # no profile requests: the view hides its Profile button
        self._spent: dict[int, dict[str, float]] = {}  # rank -> phase -> seconds reported (time_<phase>=s)
        self._seq = 0
        self._ended = False
        self.config = FitConfig()  # what the loggers read of a fit: its defaults (no checkpoint folder)
        self.handle = self  # what callbacks act through: stop()
        if self.hooks is not None:
            self.hooks.bind(self)
        call.soft_stop = self.soft_stop

    # ---- what views and hooks read ---------------------------------------------------
    @property
    def finished(self) -> bool:
        return self._ended

    def stop(self) -> None:
        """Stop on every rank at one step (what a callback's ``handle.stop()`` and the Stop button ask)."""
        self.request_stop()

    def request_stop(self, reason: str | None = None) -> None:
        if self._ended or self.stop_reason is not None:
            return
        self.stop_reason = reason or PERSON_STOP
        self.live_state.status = "stopping"
        if not self.soft_stop():
            self.call.soft_stop = None
            self.call.request_stop()

    def soft_stop(self) -> bool:
        """Agree a stop step through the reports (True), or say that only an interrupt can stop the call."""
        if self.stop_at is not None:
            return True
        ranks = sorted(self.call.tasks.pending)
        by_rank = self.session.group.by_rank() if self.session.group is not None else {}
        local = all(r in by_rank and by_rank[r].local for r in ranks)
        if not ranks or not local or not set(ranks) <= self.collector.checks_stop or not self.session.file_prefix:
            return False
        self.stop_reason = self.stop_reason or PERSON_STOP
        self.live_state.status = "stopping"
        self.stop_at = self._stop_step()
        for r in ranks:
            path = stop_note(f"{self.session.file_prefix}-w{r}")
            write_note(path, {"stop_at": self.stop_at})
            self.notes.append(path)
        self.stop_sent_at = time.monotonic()
        return True

    def _stop_step(self) -> int:
        furthest = max([*self.collector.last_steps().values(), *self.collector.positions.values(), 0])
        steps = self.history.steps[-20:]
        rate = 0.0
        if len(steps) >= 2 and steps[-1]["time"] > steps[0]["time"]:
            rate = (steps[-1]["step"] - steps[0]["step"]) / (steps[-1]["time"] - steps[0]["time"])
        return furthest + max(2, math.ceil(rate * STOP_LEAD_S))

    # ---- every tick of the call's wait -----------------------------------------------
    def tick(self) -> None:
        # a task's result can come before the last data it published (another socket): a rank is done
        # reporting once its output is complete too (that idle message follows all its data), so whether it
        # ended is read before its batches are drained
        tasks = self.call.tasks
        ended = [rank for rank, ar in tasks.ars.items()
                 if (rank in tasks.results or rank in tasks.failures) and output_done(ar, 0)]
        batches = self.reports.drain()
        for batch in batches:
            self.collector.take(batch)
        for rank in ended:
            self.collector.ended(rank)
        reduced, per_rank = self.collector.ready()
        self._take(reduced, per_rank)
        if self.stop_sent_at is not None and time.monotonic() - self.stop_sent_at > STOP_GRACE_S:
            self.stop_sent_at = None
            self.call.soft_stop = None
            self.call.request_stop()  # the ranks did not end at the agreed step: interrupt them
        if self.view is not None:
            if reduced:  # the ranks' figures change only with new steps (most ticks bring none)
                self.live_state.ranks = self._rank_figures()
            self.view.update(self)

    def _take(self, reduced: list[dict[str, Any]], per_rank: list[dict[str, Any]]) -> None:
        if not reduced:
            return
        if self.view is None:
            self._begin()
        for record in reduced:
            self.history.add("step", record)
            for name in record:
                if name not in self.history.metrics and name not in ("step", "time", "samples_per_s"):
                    self.history.metrics.append(name)
            if self.hooks is not None:
                self.hooks.record(self._seq, "step", record)
            self._seq += 1
        self.history.rank_steps.extend(per_rank)
        for row in per_rank:  # phase seconds the loop reported (time_<phase>=s), summed per rank
            for key, value in row.items():
                if key.startswith(PHASE_PREFIX) and key[len(PHASE_PREFIX):] in TIMED_PHASES:
                    mine = self._spent.setdefault(row["rank"], {})
                    mine[key[len(PHASE_PREFIX):]] = mine.get(key[len(PHASE_PREFIX):], 0.0) + value
        if self.hooks is not None:
            self.hooks.tick(self.history.last_step)

    def _begin(self) -> None:
        self.view = choose_view(self.live) if self.live is not False else NullView()
        self.view.start(self)
        if self.hooks is not None:
            self.hooks.start(FitPlanInfo(None, None, 0, 0, model_class=self.call.what))

    def _rank_rows(self) -> list[dict[str, Any]]:
        """``History.ranks``: where each rank ran, its last samples/s, and its time split when the loop reported
        phase seconds (``time_<phase>=s``, summed over its steps: ``History.time_split()``)."""
        spent = {p.rank: self._spent.get(p.rank, {}) for p in self.live_state.placements}
        timed = any(spent.values())
        splits = split_ranks([spent[p.rank] for p in self.live_state.placements]) if timed else []
        figures = {f["rank"]: f for f in self._rank_figures()}
        rows = []
        for i, p in enumerate(self.live_state.placements):
            row: dict[str, Any] = {"rank": p.rank, "host": p.host, "device": p.device,
                                   "samples_per_s": figures.get(p.rank, {}).get("samples_per_s")}
            if timed:
                row["time_split"] = splits[i]
            rows.append(row)
        return rows

    def _rank_figures(self) -> list[dict[str, Any]]:
        last: dict[int, dict[str, Any]] = {}
        for row in self.history.rank_steps[-4 * max(1, self.live_state.world_size):]:
            last[row["rank"]] = row
        bars = bool(self._spent) and len(last) == len(self.live_state.placements)  # the view's time-split bars
        return [{"rank": r, "samples_per_s": row.get("samples_per_s"),
                 **({"phase_s": dict(self._spent.get(r, {}))} if bars else {})} for r, row in sorted(last.items())]

    # ---- the end ---------------------------------------------------------------------
    def finish(self, error: BaseException | None) -> History | None:
        """After the call: the last records, the view's last frame, the hooks closed; the History (if any)."""
        deadline = time.monotonic() + OUTPUT_WAIT_S
        for ar in self.call.tasks.ars.values():
            output_done(ar, max(0.0, deadline - time.monotonic()))
        try:
            self.tick()
            for rank in self.call.tasks.ars:  # whatever has not come by now will not
                self.collector.ended(rank)
            self.tick()
        finally:
            self.reports.close()
            for path in self.notes:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
        if not self.collector.reported:
            return None
        self.error = error
        stopped = self.stop_reason is not None
        self.history.status = "failed" if error is not None and not stopped else (
            "interrupted" if stopped else "completed")
        self.history.stop_reason = self.stop_reason
        self.history.timings["total_s"] = time.perf_counter() - self.started_at
        self.history.ranks = self._rank_rows()
        self.live_state.status = self.history.status
        self._warn_uneven_stop()
        if self.hooks is not None:
            self.hooks.finish(self.history, [], None, None)
        self._ended = True
        if self.view is not None:
            self.view.finish(self)
        self.session.last_history = self.history
        return self.history

    def _warn_uneven_stop(self) -> None:
        stops = self.collector.stopped_at
        if len(set(stops.values())) > 1:
            notify(f"nbddp: the ranks stopped at different steps {dict(sorted(stops.items()))} (the stop step "
                   f"{self.stop_at} reached some ranks after they passed it): the steps are too short for "
                   f"STOP_LEAD_S={STOP_LEAD_S} s of lead", stacklevel=2)


def watch_reports(session: Session, call: RankCall, reports: ReportInbox, printer: RankOutput | None,
                  live: LiveChoice, hooks: FitHooks | None) -> tuple[dict[int, Any], History | None]:
    """Wait for ``call`` (its output shown by ``printer``, as ``run_on_ranks`` does; None: not shown); its results
    and the History it reported (``reports``: listening to its tasks since before they were sent)."""
    run = ReportedRun(session, call, reports, live, hooks)

    broken: list[str] = []

    def tick() -> None:
        if printer is not None:
            printer.tick()
        if broken:
            return
        try:
            run.tick()
        except Exception:  # noqa: BLE001 - the view or a hook failed: told once; the call itself goes on
            broken.append(traceback.format_exc())
            report("nbddp: showing what the ranks report failed; the call goes on without its view",
                   broken[0])

    error: BaseException | None = None
    try:
        results = call.wait(on_tick=tick)
    except BaseException as exc:
        error = exc
        raise
    finally:
        if printer is not None:
            printer.finish(call.tasks)
        history = run.finish(error)
        if error is not None and history is not None:
            error.history = history  # type: ignore[attr-defined]
    if run.stop_reason is not None and call.person_interrupts:
        raise interrupted_with(history)
    return results, history


def interrupted_with(history: History | None) -> KeyboardInterrupt:
    """Kernel > Interrupt stopped the ranks at one step: the cell still raises, so Run All stops (History on it)."""
    exc = KeyboardInterrupt("stopped on every rank at the same step; the History is nbddp.last_history()")
    exc.history = history  # type: ignore[attr-defined]
    return exc


class RankResults(list[Any]):
    """``nbddp.run``'s and ``run_script``'s list of the ranks' values, in rank order, with the call's ``History``.

    A list still (``results[0]``, ``==``, unpacking work as before); ``.history``
    is what the call reported (``nbddp.report``), None when it reported nothing.
    """

    history: History | None = None


def run_reporting(session: Session, what: str, fn: Any, args_for: Any, ranks: Any = None, output: bool | None = True,
                  live: LiveChoice = None, hooks: FitHooks | None = None, shown: Collection[int] | None = (),
                  drawing: Drawing | None = None) -> tuple[dict[int, Any], History | None]:
    """``run_on_ranks`` (``cells/rank_output.py``) that also shows what the ranks report: results, History."""
    reports = ReportInbox()
    call, printer = call_with_output(session, what, fn, args_for, ranks, output, shown, drawing, also=reports)
    return watch_reports(session, call, reports, printer, live, hooks)


def hooks_for(loggers: Any, callbacks: Any) -> FitHooks | None:
    """The loggers and callbacks of a call that reports, checked now (None: there are none)."""
    if not loggers and not callbacks:
        return None
    return FitHooks.for_reports(loggers, callbacks)


def split_hooks(name: str, value: object) -> tuple[list[Any], list[Any]]:
    """``%%ddp --hooks NAME``: ``value`` (a dict with ``loggers``/``callbacks``, or one list of both) split."""
    from nbddp.loggers import Logger

    if isinstance(value, dict):
        unknown = set(value) - {"loggers", "callbacks"}
        if unknown:
            raise ValueError(f"%%ddp --hooks {name}: the dict's keys are 'loggers' and 'callbacks'; got "
                             f"{sorted(map(str, unknown))}")
        return list(value.get("loggers") or []), list(value.get("callbacks") or [])
    if isinstance(value, (Logger, str)) or not isinstance(value, (list, tuple)):
        value = [value]
    loggers = [v for v in value if isinstance(v, (Logger, str))]
    return loggers, [v for v in value if not isinstance(v, (Logger, str))]
