"""A fit found running (or ended) by ``nbddp.attach``: its handle, its live view, its History and its weights.

The fit task still runs on the ranks (or has ended and left its result on
them, ``worker/training/journal.py``). The kernel sends each rank
``take_fit_result``: it waits behind the fit task and returns the moment the
fit ends, so ``RankTasks`` watches it as it watches any fit (a rank that
dies or stalls is named). Meanwhile rank 0's journal in /dev/shm gives the
records: the History and the live view start with the whole curve so far
and follow the fit. ``handle.stop()`` is the same SIGINT every fit's stop
is. The weights come back into a model the person passes
(``handle.result(into=model)``), or stay on the ranks under the fit's
``keep=`` name.

A fit launched with ``max_restarts`` left its relaunch spec beside the
record (``nbddp/detached/care_spec.py``): then a lost rank is replaced and
the fit relaunched from its newest snapshot here too, through the same
``Recovery`` a ``FitRun`` uses (``nbddp/elastic/recovery.py``), whether the
driver is a kernel that attached or, while none is, the session's caretaker
(``nbddp/detached/caretaker.py``: ``caretaker=True``, which leaves the
result on the ranks for the next kernel). Each driver hands the next its
restarts and the records before the last resume (the spec's ledger).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import threading
import time
from typing import Any

from nbddp.callbacks.fit_hooks import FitHooks
from nbddp.detached import care_spec, fit_loggers
from nbddp.detached.care_spec import Ledger
from nbddp.elastic import fit_scope
from nbddp.elastic.recovery import Recovery
from nbddp.execution.policy import FailurePolicy
from nbddp.execution.rank_tasks import RankTasks
from nbddp.execution.send import to_ranks
from nbddp.execution.work import Work
from nbddp.fit.fit_result import load_weights, rank_rows
from nbddp.fit.history import History
from nbddp.live import View
from nbddp.live.state import LiveState
from nbddp.profiling.requests import ProfileRequests
from nbddp.protocol.errors import NbddpError, SlurmError, WorkerError
from nbddp.protocol.fit_options import FitConfig
from nbddp.protocol.messages import RankInfo
from nbddp.protocol.session_record import journal_path
from nbddp.session.session import Session

JOURNAL_POLL_S = 0.2


class LetGo(Exception):
    """The caretaker was asked to stop driving the fit: a kernel attaches (``caretaker.py``)."""


class ResumedFit(Work):
    """The kernel's side of a fit that ran on while no kernel was attached (see the module docstring)."""

    session: Session  # the whole session (its last History, the record), not only SessionLike's parts

    def __init__(self, session: Session, entry: dict[str, Any], view: View, caretaker: bool = False):
        super().__init__(session, "a dist_fit (found running when this kernel attached)")
        self.entry, self.view, self.fit_id = entry, view, str(entry["fit_id"])
        self.caretaker = caretaker  # drives the fit while no kernel is attached; leaves its result on the ranks
        path = session.record_path
        # max_restarts: the relaunch spec and the restarts so far, as the last driver left them
        self.spec = care_spec.load(path, self.fit_id) if path and entry.get("care") else None
        self.ledger = care_spec.load_ledger(path, self.fit_id) if path else Ledger()
        self.policy = self.spec.policy if self.spec is not None else FailurePolicy()
        self.recovery = Recovery(self.policy)
        self.recovery.restarts = self.ledger.restarts  # History.restarts: the same list
        if self.ledger.pending and self.recovery.restarts:  # relaunched, not yet resumed: its resume ends the event
            self.recovery.pending = (self.recovery.restarts[-1], time.monotonic())
        else:  # (the records before the current launch's, whose journal holds the rest)
            self.recovery.before_resume = list(self.ledger.records)
        self.letting_go = False  # (the caretaker's) a kernel attaches: hand the fit over at the next tick
        self.relaunches = 0  # launches made here: their tasks are fit tasks whose results are this driver's
        self._plan_seen = False
        self.history = self.new_history(list(self.ledger.records))
        world = session.world_size
        self.live_state = LiveState(world_size=world, backend=session.backend, epochs=int(entry.get("epochs") or 0),
                                    placements=[RankInfo(p.rank, p.host, p.device, p.pid) for p in session.placements],
                                    batch_size=int(entry.get("batch_size") or 0),
                                    global_batch=int(entry.get("global_batch") or 0), status="training")
        # its loggers, as the launching kernel handed them over (nbddp/detached/fit_loggers.py); its callbacks
        # lived in that kernel and are gone with it
        # (the caretaker leaves them to the kernel that attaches: loading them takes them)
        saved = fit_loggers.load(session.record_path, entry) if session.record_path and not caretaker else None
        self.hooks = FitHooks(list(saved["loggers"]), [], dict(saved["described"])) if saved else FitHooks([], [], {})
        self.hooks.saved_runs = dict(entry.get("runs") or {})
        self.hooks.bind(self)
        self.logged_cfg: Any = saved["cfg"] if saved else None  # (a fit whose loggers were handed over)
        self.handle: Any = None  # the ResumedFitHandle (resume())
        self.stop_reason: str | None = None
        self.requests = ProfileRequests(session)
        self.error: BaseException | None = None
        self.weights: Any = None  # the trained state dict (or module) once the fit ended
        self.started_at = time.perf_counter()
        self.stop_requested = False
        self.end_notices: list[str] = []
        self._seen = 0
        self.tasks: RankTasks | None = None

    def launch(self) -> None:
        """Ask every rank for the fit's result (answered when it ends), then watch; the view replays the journal.

        The caretaker asks how it ended instead (``fit_outcome``), leaving the result for the next kernel.
        """
        from nbddp.worker.tasks.journal import fit_outcome, take_fit_result

        s = self.session
        if self.ledger.failed:  # it failed while no kernel was attached: said at once, nothing to wait for
            self.error = self.ledger.error or NbddpError(self.ledger.failed)
            self.history.status = self.live_state.status = "failed"
            self._ended(False)
            self.set_done()
            return
        ars = to_ranks(s.client, s.placements, fit_outcome if self.caretaker else take_fit_result,
                       lambda p: (self.fit_id,))
        self.tasks = RankTasks(s, ars, "dist_fit", fit=True, policy=self.policy)
        s.running = self
        self._read_journal()
        self.view.start(self)
        threading.Thread(target=self._watch, name="nbddp-fit-watch", daemon=True).start()

    def _read_journal(self) -> None:
        """The records rank 0 wrote since the last look (all of them the first time): into the History."""
        try:
            with open(journal_path(self.session.file_prefix), "rb") as f:
                journal = pickle.load(f)
        except (OSError, EOFError, pickle.UnpicklingError):
            return  # none yet (rank 0 writes it at its next record), or rank 0 is on another host
        if journal.get("fit_id") != self.fit_id:
            return
        plan = journal.get("plan")
        if plan is not None and not self._plan_seen:  # after a relaunch: where it resumed (ends the restart)
            self._plan_seen = True
            pending = self.recovery.pending is not None
            self.recovery.fit_resumed(self, plan.start_step)
            if pending:
                self._save_ledger()
        self.live_state.plan = plan or self.live_state.plan
        if self.live_state.plan is not None and self.logged_cfg is not None:
            self.hooks.start(self.live_state.plan)  # (once) the loggers open the same runs again
        self.live_state.ranks = journal.get("ranks") or self.live_state.ranks
        if not self.stop_requested and journal.get("status") and not journal.get("ended"):
            self.live_state.status = journal["status"]
        for seq, kind, record in journal.get("records", [])[self._seen:]:
            self.history.add(kind, record)
            self.hooks.record(seq, kind, record)
            self._seen = seq + 1
        self.hooks.tick(self.history.last_step)

    def _tick(self) -> None:
        if self.letting_go:
            raise LetGo
        self._read_journal()
        assert self.tasks is not None, "launch() set the tasks before the watcher started"
        # (no stall checks: the ranks' heartbeats are the fit task's, and this kernel's tasks wait behind it)
        self.live_state.positions = self.tasks.positions()
        self.view.update(self)

    def _watch(self) -> None:
        try:
            results = self._wait_through_restarts()
            if self.caretaker:  # the result stays on the ranks for the kernel that attaches
                self._save_ledger()
            else:
                self._finish(results)
        except LetGo:
            self._save_ledger()
        except BaseException as exc:  # noqa: BLE001 - handed to the handle (or, the caretaker's, to the ledger)
            self.error = exc
            self.history.status = self.live_state.status = "failed"
            self.hooks.close(self.history)
            if self.caretaker:
                self._save_ledger(failed=f"{type(exc).__name__}: {exc}", error=exc)
            else:
                self._ended(False)
        finally:
            self.release_workers()
            workers = self.session.workers
            if workers is not None and not self.caretaker:  # (held back at attach: the ranks were busy with the fit)
                self.session.debugger.announce(workers.client, list(self.session.placements), workers.controller_host)
            try:
                self.view.finish(self)
            except Exception:  # noqa: BLE001 - a display problem must not hide the result
                pass
            self.set_done()

    def _wait_through_restarts(self) -> dict[int, Any]:
        """Every rank's answer; a lost rank, with the spec's ``max_restarts``, is replaced and the fit relaunched."""
        while True:
            try:
                return self.launched.wait(on_tick=self._tick, tick_s=JOURNAL_POLL_S)
            except (WorkerError, SlurmError) as exc:  # a lost rank (FailurePolicy() without a spec: never retried)
                if not self.recovery.should_retry(self, exc):
                    raise
                self.recovery.relaunch(self, exc)
                self._save_ledger()

    def _finish(self, results: dict[int, Any]) -> None:
        head = results[0]
        history = self.new_history(self.recovery.before_resume + [(kind, r) for _, kind, r in head.records])
        history.status = "interrupted" if any(r.status == "interrupted" for r in results.values()) else "completed"
        history.ranks = rank_rows(head, results, self.live_state.placements)
        history.stop_reason = head.stop_reason
        parcel = head.weights
        if parcel is not None:
            try:
                self.weights = load_weights(None, None, parcel)  # a state dict (or the module): into= takes it
            finally:
                parcel.discard()
        history.model = self.weights
        self.live_state.plan = self.live_state.plan or head.plan
        plan = self.live_state.plan if self.logged_cfg is not None else None
        self.stop_reason = head.stop_reason
        self.hooks.finish(history, head.records, plan, head.restored)  # the records not handed over, then close
        history.timings = {k: v for k, v in head.timings.items() if k.startswith(("answer_", "callback_"))}
        self.end_notices = list(head.notices)  # (callback points skipped once the launching kernel died, ...)
        self.history = self.session.last_history = history
        self.live_state.status = history.status
        self._ended(True)

    def _ended(self, succeeded: bool) -> None:
        """The record no longer names the fit; its snapshots, relaunch spec and ledger go."""
        from nbddp.detached.journal import fit_ended

        if self.spec is not None:
            fit_scope.end(self.session, self.spec.cfg)
        fit_ended(self.session, self.entry, succeeded)

    def _save_ledger(self, failed: str = "", error: BaseException | None = None) -> None:
        """What the next driver needs: the restarts, the records before this launch's, whether one is pending."""
        path = self.session.record_path
        if path is None or self.spec is None:
            return
        pending = self.recovery.pending is not None
        records = self.history.records() if pending else self.recovery.before_resume
        care_spec.save_ledger(path, self.fit_id, Ledger(self.recovery.restarts, list(records), pending, failed, error))

    # ---- what a relaunch needs of the fit (elastic.contracts.Relaunchable) --------------------------
    @property
    def launched(self) -> RankTasks:
        assert self.tasks is not None, "launch() set the tasks before the watcher started"
        return self.tasks

    @property
    def stopping(self) -> bool:
        return self.stop_requested  # (a caretaker letting go still relaunches: the kernel attaching takes that up)

    @property
    def config(self) -> FitConfig:
        """The fit's configuration: its relaunch spec's (elastic), else the one handed over with its loggers."""
        return self.spec.cfg if self.spec is not None else self.logged_cfg

    def reconfigure(self, cfg: FitConfig, world_size: int) -> None:
        assert self.spec is not None, "only a fit with a relaunch spec is retried"
        self.spec.cfg = cfg
        self.live_state.world_size = world_size

    def steps_reached(self) -> list[int]:
        seen = self.tasks.positions() if self.tasks is not None else []
        return [p.get("step") or 0 for p in seen + self.live_state.positions] + [self.history.last_step]

    def show_restart(self, line: str, replace_last: bool = False, status: str | None = None) -> None:
        if replace_last and self.live_state.restarts:
            self.live_state.restarts[-1] = line
        else:
            self.live_state.restarts.append(line)
        if status is not None:
            self.live_state.status = status
        self.view.update(self)

    def records(self) -> list[tuple[str, dict[str, Any]]]:
        return self.history.records()

    def keep_records(self, records: list[tuple[str, dict[str, Any]]]) -> None:
        self.history = self.new_history(records)

    def new_history(self, records: list[tuple[str, dict[str, Any]]]) -> History:
        entry = self.entry
        history = History(world_size=self.session.world_size, batch_size=int(entry.get("batch_size") or 0),
                          global_batch_size=int(entry.get("global_batch") or 0), restarts=self.recovery.restarts)
        for kind, record in records:
            history.add(kind, record)
        return history

    def relaunch(self, resume: bool | str | None = None) -> None:
        """The same fit task again on the healed group, from the newest snapshot, as ``FitRun.relaunch`` sends it."""
        from nbddp.worker.tasks.entry import fit_task

        s, spec = self.session, self.spec
        assert spec is not None, "only a fit with a relaunch spec is retried"
        try:  # the lost launch's journal: the new rank 0 writes its own, counting its records from 0
            os.unlink(journal_path(s.file_prefix))
        except FileNotFoundError:
            pass
        self._seen, self._plan_seen, self.relaunches = 0, False, self.relaunches + 1
        self.live_state.placements = [RankInfo(p.rank, p.host, p.device, p.pid) for p in s.placements]
        self.hooks.relaunched()
        cfg = dataclasses.replace(spec.cfg, from_snapshot=True) if resume is None else \
            dataclasses.replace(spec.cfg, resume=resume)
        launch = dataclasses.replace(spec.launch, generation=s.generation, resident=())
        ars = to_ranks(s.client, s.placements, fit_task,
                       lambda p: (spec.parcels[p.local], cfg, launch, spec.model_parcels.get(p.local)))
        self.tasks = RankTasks(s, ars, "dist_fit", fit=True, policy=self.policy)
        from nbddp.detached import records

        records.refresh(s, keep_owner=self.caretaker)  # the healed group, for the next attach

    # ---- what the handle and the view act on --------------------------------------------------------
    def request_stop(self, reason: str | None = None) -> None:
        """The fit's own coordinated stop: SIGINT to every rank (their handler turns it into the stop flag)."""
        if self.finished or self.stop_requested:
            return
        self.stop_requested = True
        self.live_state.status = "stopping"
        workers = self.session.workers
        if workers is not None:
            import signal

            workers.signal([p.engine_id for p in self.session.placements], signal.SIGINT)

    def hard_stop(self, reason: str = "a second interrupt") -> None:
        if not self.finished:
            self.session.supervisor.kill_ranks([p.rank for p in self.session.placements])
            self.done_event.wait(30.0)

    def outcome(self) -> History:
        if self.error is not None:
            raise self.error
        return self.history

    def notices_once(self) -> None:
        """Rank 0's notices at the end (callback points skipped once the launching kernel died, ...), once."""
        from nbddp.protocol.notices import notify

        notices, self.end_notices = self.end_notices, []
        for text in notices:
            notify(text, stacklevel=5)

    def into(self, model: Any) -> Any:
        """Load the trained weights into ``model`` (an ``nn.Module`` of the fit's architecture); it, loaded."""
        weights = self.weights
        if weights is None:
            from nbddp.protocol.errors import NbddpError

            raise NbddpError("this fit brought no weights back: it kept its model on the ranks "
                             f"(dist_fit(keep={self.entry.get('keep')!r}): predict with nbddp.predict(name, ...)), "
                             "or it returned none (return_weights=False)")
        state = weights.state_dict() if hasattr(weights, "state_dict") else weights
        model.load_state_dict(state)
        self.history.model = model
        return model
