"""A fit's loggers and callbacks, fed by the kernel's watcher thread (``nbddp.fit.fit_run.FitRun``).

``FitHooks.build`` runs in ``dist_fit`` before any worker starts: every
logger name, callback and ``EarlyStopping`` monitor is checked, and every
logger's ``check`` runs (its package, its directory, its store). Then:

* ``start`` when the workers publish their plan (training began): the
  loggers open their runs (the same runs again when the fit resumes from a
  checkpoint: they are noted in ``checkpoint_dir/nbddp-runs.json``), then
  ``on_fit_start``;
* ``record`` for each of rank 0's records, strictly in order. Should the
  watcher ever fall behind the stream's window, delivery pauses and
  ``finish`` delivers the rest from rank 0's full list: no logger sees a
  record twice, out of order, or never;
* all of it runs in a thread of its own (``nbddp-fit-hooks``), fed by a
  queue: the watcher only hands records over, so a slow logger (a W&B run
  opening over the network) never makes it fall behind the workers' stream;
* ``finish`` (or ``close`` when the fit failed): the last records, the
  loggers' runs closed, ``on_fit_end``, and what the History keeps of it.

None of it travels to the workers except ``best`` (plain settings: what to
monitor, for ``restore_best``) and the record kinds the ranks wait after
when a callback defines ``on_epoch_end`` or ``on_validation_end``: each of
those records is answered (``epoch_answers.Answers``) once its hooks ran,
or at once when it is not handed over (a replay after a restart, a gap).
"""

from __future__ import annotations

import dataclasses
import os
import queue
import threading
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from nbddp.callbacks.base import Callback, CallbackSet, EndedFit, Record, check_callbacks
from nbddp.callbacks.epoch_answers import Answers, Rank0Reach, sync_kinds
from nbddp.callbacks.early_stopping import EarlyStopping
from nbddp.loggers.fit_info import FitInfo, callable_name, fit_info
from nbddp.protocol.data_forms import DataLike
from nbddp.protocol.fit_options import BestSpec, FitConfig
from nbddp.loggers import Logger, LoggerChoice, resolve
from nbddp.loggers.guard import LoggerSet, read_runs, runs_file, write_runs
from nbddp.protocol.messages import FitLaunch, FitPlanInfo
from nbddp.protocol.notices import notify, report
from nbddp.session.session import Session


class HookedFit(Protocol):
    """What the hooks read of their fit, and how they stop it: ``fit.fit_run.FitRun`` (``fit/`` imports this
    package, so it is named here by what is read)."""

    stop_reason: str | None

    @property
    def config(self) -> FitConfig: ...

    @property
    def session(self) -> Session: ...

    @property
    def handle(self) -> object: ...  # the fit's FitHandle, handed to the callbacks

    def request_stop(self, reason: str | None = None) -> None: ...


def _known_values(val_data: DataLike | None, metrics: Mapping[str, object] | None,
                  step_fn: Callable[..., Any] | None) -> set[str] | None:
    """Every value a check records (None: a step_fn may add its own ``val_*``)."""
    if step_fn is not None and val_data is not None:
        return None
    known = {"loss"}
    if val_data is not None:
        known |= {"val_loss", *(f"val_{name}" for name in (metrics or {}))}
    return known


JOIN_S = 300.0  # at the end, how long the fit waits for its loggers to close their runs (uploads included)


class FitHooks:
    def __init__(self, loggers: list[Logger], callbacks: list[object], described: dict[str, str | None],
                 best: BestSpec | None = None):
        self.loggers = LoggerSet(loggers)
        self.callbacks = CallbackSet(callbacks)
        self.described = described
        self.best = best
        self.stoppers = [cb for cb in callbacks if isinstance(cb, EarlyStopping)]
        self.run: HookedFit | None = None
        self.info: FitInfo | None = None
        self.next_seq = 0  # the next record to hand over (watcher thread)
        self.flushed = 0  # records handed over when the last flush was asked for
        self.planned = False
        self.handed_through = -1  # after an elastic fit's relaunch: replays of steps up to here are not handed over
        self.last_step = -1  # the step of the last record handed over
        self.finishing = False
        self.queue: queue.Queue[tuple[str, Any]] = queue.Queue()  # (what, its argument), for the hooks thread
        self.thread: threading.Thread | None = None
        self.answers: Answers | None = None  # the synchronous callbacks' answers (attach)
        # a detached session's fit (nbddp/detached/journal.py): told the run each logger opened, so that a kernel
        # attaching later goes on writing the same runs (saved_runs: what it was told, given back there)
        self.noted_runs: Callable[[str, dict[str, Any]], None] | None = None
        self.saved_runs: dict[str, Any] | None = None

    @classmethod
    def build(cls, loggers: LoggerChoice | Sequence[LoggerChoice] | None = None, callbacks: object = None, *,
              val_data: DataLike | None = None, metrics: Mapping[str, object] | None = None,
              step_fn: Callable[..., Any] | None = None, **described: object) -> FitHooks:
        """Check everything that can be checked before training (bad input raises here)."""
        chosen, cbs = resolve(loggers), check_callbacks(callbacks)
        known = _known_values(val_data, metrics, step_fn)
        restoring = []
        for es in (cb for cb in cbs if isinstance(cb, EarlyStopping)):
            es.check_fit(known, val_data is not None)
            restoring += [es] if es.restore_best else []
        if len(restoring) > 1:
            raise ValueError(f"dist_fit(callbacks=[...]) has {len(restoring)} EarlyStopping(restore_best=True); the "
                             "model can end with one best check's weights only: keep restore_best on one of them")
        for logger in chosen:
            logger.check()
        names = {k: callable_name(v) for k, v in described.items()}
        names["metrics"] = ",".join(sorted(metrics)) if metrics else None
        names["step_fn"] = callable_name(step_fn)
        return cls(chosen, cbs, names, restoring[0].spec if restoring else None)

    @classmethod
    def for_reports(cls, loggers: LoggerChoice | Sequence[LoggerChoice] | None = None,
                    callbacks: object = None) -> FitHooks:
        """The hooks of a call that reports (``nbddp.report``): checked now; an ``EarlyStopping`` checks its
        monitor at every reported step that holds it, and stops the call (``cells/reported_call.py``)."""
        chosen, cbs = resolve(loggers), check_callbacks(callbacks)
        for es in (cb for cb in cbs if isinstance(cb, EarlyStopping)):
            es.each_report = True
        for logger in chosen:
            logger.check()
        return cls(chosen, cbs, {"call": "nbddp.report"})

    def __bool__(self) -> bool:
        return bool(self.loggers) or bool(self.callbacks)

    def attach(self, launch: FitLaunch, session: Session | None = None, link: Rank0Reach | None = None) -> FitLaunch:
        """``launch`` telling the workers what each EarlyStopping monitors, which check's weights to end with
        (plain settings), and after which records they wait for the synchronous callbacks (``link``: how rank 0 is
        reached, ``fit/rank0_store.Rank0Link``)."""
        kinds = sync_kinds(self.callbacks.callbacks)
        if kinds and session is not None:
            if link is None or link.reachable:
                self.answers = Answers(f"{session.file_prefix}-w0", kinds, link)
                # answers_pid: once this kernel died (a detached session), the ranks skip the points, never waiting
                launch = dataclasses.replace(launch, answers=kinds, answers_pid=os.getpid())
            else:
                notify(f"nbddp: rank 0 runs on {session.placements[0].host}, and the callbacks' answers could not "
                       f"reach it: {link.reason}. on_epoch_end/on_validation_end run asynchronously in this fit (the "
                       "ranks train on; a stop lands a little later, handle.set_lr and handle.save_checkpoint are "
                       "refused). Check that this machine can reach rank 0's host on the group's port (a "
                       "firewall?), or start the workers with rank 0 on the kernel's host")
        if self.best is not None:
            launch = dataclasses.replace(launch, best=self.best)
        if self.stoppers:
            launch = dataclasses.replace(launch, stoppers=tuple(es.spec for es in self.stoppers))
        return launch

    def bind(self, run: HookedFit) -> None:
        self.run = run

    def running(self) -> HookedFit:
        """The fit these hooks serve (``FitRun`` binds them as it is made, before any record comes)."""
        assert self.run is not None, "FitRun binds its hooks before training starts"
        return self.run

    def _stop(self, reason: str) -> None:
        if not self.finishing and self.run is not None:  # a stop asked while the fit ends has nothing left to stop
            self.run.request_stop(reason)

    # ---- the watcher thread's side: hand over, in order --------------------------
    def start(self, plan: FitPlanInfo) -> None:
        """The workers' plan arrived (``messages.FitPlanInfo``): training began."""
        if self.planned or not self:
            return
        self.planned = True
        self.thread = threading.Thread(target=self._serve, name="nbddp-fit-hooks", daemon=True)
        self.thread.start()
        self.queue.put(("start", plan))

    def record(self, seq: int, kind: str, record: dict[str, Any]) -> None:
        answers = self.answers if self.answers is not None and self.answers.waits_after(kind) else None
        if seq != self.next_seq or not self.planned:  # a gap (or no plan yet): finish() hands over from here
            if answers is not None and (seq > self.next_seq or not self.planned):
                answers.answer(seq)  # never handed over in time: no wait for it
            return
        self.next_seq += 1
        step = record.get("step", self.handed_through + 1)
        if step <= self.handed_through:
            if answers is not None:
                answers.answer(seq)
            return  # a replayed step after a restart: the loggers have its record already (the same values)
        self.last_step = max(self.last_step, step)
        if answers is not None:
            answers.due.add(seq)
        self.queue.put(("record", (seq, kind, record, answers.launch if answers is not None else None)))

    @property
    def answering(self) -> bool:
        """The ranks wait now for the synchronous hooks of a record (their quiet time is no stall)."""
        return self.answers is not None and bool(self.answers.due)

    def relaunched(self) -> None:
        """An elastic fit starts again on new ranks: their records count from 0; replays of handed steps are skipped."""
        self.next_seq = self.flushed = 0
        self.handed_through = self.last_step
        if self.answers is not None:  # the new ranks count their records from 0 again: no old answer is theirs
            self.answers.close()

    def tick(self, step: int | None) -> None:
        """After each look at the stream: the loggers write what they buffered (once per new batch of records)."""
        if self.loggers and self.next_seq > self.flushed:
            self.flushed = self.next_seq
            self.queue.put(("flush", step))

    def finish(self, history: EndedFit, records: list[tuple[int, str, dict[str, Any]]], plan: FitPlanInfo | None,
               restored: dict[str, Any] | None) -> None:
        """The fit ended on the workers: the records not handed over yet, then ``close``; wait for all of it."""
        self.finishing = True
        if plan is not None:
            self.start(plan)
        for seq, kind, record in records[self.next_seq:] if self.planned else ():
            self.record(seq, kind, record)
        self.close(history, restored)

    def close(self, history: EndedFit, restored: dict[str, Any] | None = None) -> None:
        """Close the runs, call ``on_fit_end``, and keep in ``history`` what happened (also after a failure)."""
        self.finishing = True
        history.stop_reason = getattr(self.run, "stop_reason", None)
        if self.answers is not None:
            self.answers.close()
        if self.thread is None:
            self._best(history, restored)
            return
        self.queue.put(("close", (history, restored)))
        self.thread.join(JOIN_S)
        if self.thread.is_alive():
            notify(f"nbddp: the loggers were still closing their runs after {JOIN_S:.0f} s; the fit returns "
                   "without waiting for them")

    # ---- the hooks thread: loggers and callbacks ---------------------------------
    def _serve(self) -> None:
        while True:
            what, arg = self.queue.get()
            serve: dict[str, Callable[[Any], None]] = {"start": self._started, "record": self._deliver,
                                                       "flush": self.loggers.flush, "close": self._closed}
            try:
                serve[what](arg)
            except Exception:  # noqa: BLE001 - the guards catch the loggers' and callbacks' own errors
                report(f"nbddp: internal error in the fit's loggers/callbacks ({what})", traceback.format_exc())
            if what == "close":
                return

    def _started(self, plan: FitPlanInfo) -> None:
        run = self.running()
        cfg = run.config
        path = runs_file(cfg)
        saved = read_runs(path) if cfg.resume and plan.start_step > 0 else {}
        if self.saved_runs is not None:  # the same runs, opened again by the kernel that attached
            saved = self.saved_runs
        self.info = fit_info(cfg, run.session, plan, self.described, saved.get("run_name"))
        self.info.handle = run.handle
        for cb in self.callbacks.callbacks:
            if isinstance(cb, Callback):
                cb.handle = run.handle
        if self.loggers:
            states = self.loggers.start(self.info, saved.get("loggers", {}))
            if cfg.checkpoint_dir:
                write_runs(path, self.info.run_name, states)
            if self.noted_runs is not None:
                self.noted_runs(self.info.run_name, states)
        self.callbacks.call("on_fit_start", self.info, self._stop)

    def _deliver(self, item: tuple[int, str, dict[str, Any], int | None]) -> None:
        seq, kind, record, launch = item
        answers = self.answers if self.answers is not None and self.answers.waits_after(kind) else None
        try:
            if self.loggers:
                self.loggers.log(kind, record)
            if self.callbacks:
                # at a point the ranks wait at, a stop is in the answer: the fit ends there, a normal end
                stop = answers.stop if answers is not None else self._stop
                copy = Record(kind, record)
                self.callbacks.call("on_record", copy, stop)
                if kind == "val":
                    self.callbacks.call("on_validation_end", copy, stop)
                if kind == "epoch":
                    self.callbacks.call("on_epoch_end", copy, stop)
        finally:
            if answers is not None:  # whatever the hooks (or loggers) did: the ranks wait for this (unless relaunched)
                answers.answer(seq, launch)

    def _best(self, history: EndedFit, restored: dict[str, Any] | None) -> None:
        if self.stoppers:
            es = next((e for e in self.stoppers if e.restore_best), self.stoppers[0])
            history.best = {**es.summary(), "restored": restored is not None and es.restore_best}

    def _closed(self, item: tuple[EndedFit, dict[str, Any] | None]) -> None:
        history, restored = item
        self._best(history, restored)
        if self.loggers:
            history.loggers = self.loggers.finish(history.status, history.last_step)
        self.callbacks.call("on_fit_end", history, self._stop)
        history.errors = [*({"source": f"logger {g.key}", "error": g.error, "traceback": g.traceback}
                            for g in self.loggers.guards if g.error), *self.callbacks.errors]
