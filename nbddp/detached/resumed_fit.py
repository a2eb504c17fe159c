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
"""

from __future__ import annotations

import pickle
import threading
import time
from typing import Any

from nbddp.callbacks.fit_hooks import FitHooks
from nbddp.detached import fit_loggers
from nbddp.execution.policy import FailurePolicy
from nbddp.execution.rank_tasks import RankTasks
from nbddp.execution.send import to_ranks
from nbddp.execution.work import Work
from nbddp.fit.fit_result import load_weights, rank_rows
from nbddp.fit.handle import FitHandle
from nbddp.fit.history import History
from nbddp.live import View
from nbddp.live.state import LiveState
from nbddp.profiling.requests import ProfileRequests
from nbddp.protocol.messages import RankInfo
from nbddp.protocol.session_record import journal_path
from nbddp.session.session import Session

JOURNAL_POLL_S = 0.2


class ResumedFit(Work):
    """The kernel's side of a fit that ran on while no kernel was attached (see the module docstring)."""

    session: Session  # the whole session (its last History, the record), not only SessionLike's parts

    def __init__(self, session: Session, entry: dict[str, Any], view: View):
        super().__init__(session, "a dist_fit (found running when this kernel attached)")
        self.entry, self.view, self.fit_id = entry, view, str(entry["fit_id"])
        world = session.world_size
        self.history = History(world_size=world, batch_size=int(entry.get("batch_size") or 0),
                               global_batch_size=int(entry.get("global_batch") or 0))
        self.live_state = LiveState(world_size=world, backend=session.backend, epochs=int(entry.get("epochs") or 0),
                                    placements=[RankInfo(p.rank, p.host, p.device, p.pid) for p in session.placements],
                                    batch_size=int(entry.get("batch_size") or 0),
                                    global_batch=int(entry.get("global_batch") or 0), status="training")
        # its loggers, as the launching kernel handed them over (nbddp/detached/fit_loggers.py); its callbacks
        # lived in that kernel and are gone with it
        saved = fit_loggers.load(session.record_path, entry) if session.record_path else None
        self.hooks = FitHooks(list(saved["loggers"]), [], dict(saved["described"])) if saved else FitHooks([], [], {})
        self.hooks.saved_runs = dict(entry.get("runs") or {})
        self.hooks.bind(self)
        self.config: Any = saved["cfg"] if saved else None
        self.handle: Any = None  # the ResumedFitHandle (resume())
        self.stop_reason: str | None = None
        self.requests = ProfileRequests(session)
        self.error: BaseException | None = None
        self.weights: Any = None  # the trained state dict (or module) once the fit ended
        self.started_at = time.perf_counter()
        self.stop_requested = False
        self._seen = 0
        self.tasks: RankTasks | None = None

    def launch(self) -> None:
        """Ask every rank for the fit's result (answered when it ends), then watch; the view replays the journal."""
        from nbddp.worker.tasks.journal import take_fit_result

        s = self.session
        ars = to_ranks(s.client, s.placements, take_fit_result, lambda p: (self.fit_id,))
        self.tasks = RankTasks(s, ars, "dist_fit", fit=True, policy=FailurePolicy())
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
        self.live_state.plan = journal.get("plan") or self.live_state.plan
        if self.live_state.plan is not None and self.config is not None:
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
        self._read_journal()
        assert self.tasks is not None, "launch() set the tasks before the watcher started"
        # (no stall checks: the ranks' heartbeats are the fit task's, and this kernel's tasks wait behind it)
        self.live_state.positions = self.tasks.positions()
        self.view.update(self)

    def _watch(self) -> None:
        assert self.tasks is not None, "launch() set the tasks before the watcher started"
        try:
            results = self.tasks.wait(on_tick=self._tick, tick_s=JOURNAL_POLL_S)
            self._finish(results)
        except BaseException as exc:  # noqa: BLE001 - handed to the handle
            self.error = exc
            self.history.status = self.live_state.status = "failed"
            self.hooks.close(self.history)
        finally:
            self.release_workers()
            workers = self.session.workers
            if workers is not None:  # (held back at attach: the ranks were busy with the fit)
                self.session.debugger.announce(workers.client, list(self.session.placements), workers.controller_host)
            try:
                self.view.finish(self)
            except Exception:  # noqa: BLE001 - a display problem must not hide the result
                pass
            self.set_done()

    def _finish(self, results: dict[int, Any]) -> None:
        head = results[0]
        history = History(world_size=self.history.world_size, batch_size=self.history.batch_size,
                          global_batch_size=self.history.global_batch_size)
        for _, kind, record in head.records:
            history.add(kind, record)
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
        plan = self.live_state.plan if self.config is not None else None
        self.stop_reason = head.stop_reason
        self.hooks.finish(history, head.records, plan, head.restored)  # the records not handed over, then close
        self.history = self.session.last_history = history
        self.live_state.status = history.status
        from nbddp.detached.journal import fit_ended

        fit_ended(self.session, self.entry, True)

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
        """The workers' notices were raised in the kernel that launched the fit (or nowhere): none here."""

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


class ResumedFitHandle(FitHandle):
    """``nbddp.running()`` after ``attach()``: a ``FitHandle`` whose weights come back on request.

    The kernel that launched the fit held the person's model; this one does
    not, so ``result(into=model)`` (or ``wait(into=model)``) loads the
    trained weights into the model given; without ``into`` the History's
    ``model`` is the trained state dict.
    """

    def __init__(self, run: ResumedFit):
        super().__init__(run)
        self._resumed = run

    @property
    def work(self) -> ResumedFit:
        return self._resumed

    def result(self, timeout: float | None = None, into: Any = None) -> History:
        history = super().result(timeout)
        if into is not None:
            self._resumed.into(into)
        return history

    def wait(self, timeout: float | None = None, into: Any = None) -> History:
        return self.result(timeout, into)

    def profile(self, steps: int = 10, dir: Any = None) -> dict[str, Any]:
        """Not for a fit found running at attach: its ranks answer profile requests to the kernel that launched it.

        Raises:
            NbddpError: always, saying so.
        """
        from nbddp.protocol.errors import NbddpError

        raise NbddpError("handle.profile() is not available for a fit this kernel found running when it attached: "
                         "the ranks send traces to the kernel that launched the fit. Profile the next fit "
                         "(dist_fit(..., profile=True), or handle.profile() on its handle)")


def resume(session: Session, entry: dict[str, Any], live: Any = None) -> ResumedFitHandle:
    """Take the fit named in the record up in this kernel: its handle, its view started in the calling cell."""
    from nbddp.live import choose_view

    run = ResumedFit(session, entry, choose_view(live))
    handle = run.handle = ResumedFitHandle(run)
    session.resumed = handle
    run.launch()
    return handle


def running_handle(session: Session) -> FitHandle | None:
    """The handle of the fit running on this kernel's workers, or of the one ``attach()`` found; None otherwise."""
    run = session.running
    if run is not None and not run.finished and isinstance(getattr(run, "handle", None), FitHandle):
        return run.handle
    resumed = session.resumed
    if resumed is not None and (run is None or run is resumed.work):
        return resumed
    return None
