"""A fit in flight, on the kernel's side: launch, watch, stop, bring the weights back.

``FitRun`` launches one task per rank (``nbddp.worker.tasks.entry.fit_task``) and
watches them in a background thread (``nbddp.execution.rank_tasks.RankTasks``), feeding rank 0's
stream of records to the ``History`` and the live view. The calling cell
either waits (``block=True``, where Kernel > Interrupt becomes a coordinated
stop) or gets a ``FitHandle`` at once.
"""

from __future__ import annotations

import dataclasses
import secrets
import signal
import threading
import time
from typing import Any

from nbddp.shipping import pickling as shipping
from nbddp.callbacks.fit_hooks import FitHooks
from nbddp.fit import compile_report
from nbddp.fit.handle import FitHandle
from nbddp.fit.fit_result import fit_timings, load_weights, rank_rows
from nbddp.fit.history import History
from nbddp.live import View
from nbddp.live.state import LiveState
from nbddp.protocol.fit_options import FitConfig
from nbddp.protocol.messages import FitLaunch, FitResult, RankInfo, published
from nbddp.protocol.notices import notify
from nbddp.fit.preflight import FitPlan
from nbddp.execution.policy import FailurePolicy
from nbddp.execution.rank_tasks import RankTasks
from nbddp.execution.send import to_ranks
from nbddp.execution.stalls import StuckStop
from nbddp.execution.work import Work
from nbddp.profiling.trace_merge import gathered_profile
from nbddp.profiling.requests import ProfileRequests
from nbddp.fit.rank0_store import Rank0Link
from nbddp.elastic import fit_scope
from nbddp.elastic.recovery import Recovery
from nbddp.protocol.errors import SlurmError, WorkerError
from nbddp.session.session import Session

HARD_STOP_WAIT_S = 30.0
SYNC_POLL_S = 0.01  # the watcher's tick in a fit with synchronous callbacks (benchmarks/epoch_round_trip.py)
PERSON_STOP = "stopped from the notebook (Kernel > Interrupt, the Stop button or FitHandle.stop())"


class FitRun(Work):
    """One fit in flight: tasks on every rank, a watcher thread, the live view."""

    session: Session  # the whole session (its sources, resident data, last History), not only SessionLike's parts

    def __init__(self, session: Session, plan: FitPlan, view: View, stall_timeout: float | None = None,
                 hooks: FitHooks | None = None):
        super().__init__(session, "a dist_fit")
        self.plan = plan
        self.view = view
        # the fit's failure policy: max_restarts and retry_on from the fit, stall_timeout from it or nbddp.start()
        self.policy: FailurePolicy = dataclasses.replace(plan.policy, stall_timeout=stall_timeout)
        self.recovery = Recovery(self.policy)  # max_restarts: a lost rank replaced, the same fit going on
        self.history = self.new_history([])
        self.error: BaseException | None = None
        self.stop_requested = False
        self.stop_reason: str | None = None  # who asked for the stop (History.stop_reason)
        self.hooks = hooks or FitHooks([], [], {})  # loggers and callbacks, in the kernel
        self.hooks.bind(self)
        self.handle = FitHandle(self)  # what the callbacks act through (info.handle, Callback.handle)
        self.link = Rank0Link.open(session)  # rank 0's file on one host, the group's TCPStore across hosts
        if self.link.remote:
            plan.launch = dataclasses.replace(plan.launch, channel=self.link.channel)
        # restore_best: what the workers monitor; the synchronous callbacks
        plan.launch = self.hooks.attach(plan.launch, session, self.link)
        plan.launch = dataclasses.replace(plan.launch, fit_id=secrets.token_hex(6))  # (a kernel attaching later)
        self._training_started = False
        self._stop_sent = False
        self.hard_stopped = False
        self.hard_stop_reason = ""
        self.tasks: RankTasks | None = None
        self._seen = 0
        self._plan_seen = False  # this launch's rank 0 sent its plan (a relaunch sends another)
        self.started_at = time.perf_counter() - plan.ship_s  # the call began when shipping began
        self.live_state = LiveState(world_size=session.world_size, backend=session.backend, epochs=plan.cfg.epochs,
                                    placements=[RankInfo(p.rank, p.host, p.device, p.pid) for p in session.placements],
                                    batch_size=plan.cfg.batch_size, global_batch=plan.cfg.global_batch_size(session.world_size))
        self.thread: threading.Thread | None = None
        self._warned = False
        self.poll_s = 0.05  # how often the watcher looks at rank 0's published records
        if self.hooks.answers is not None:  # the ranks wait at each epoch end until the watcher sees the record
            self.poll_s = SYNC_POLL_S
        self.watch_cpu_s: float | None = None
        self.noticed = False  # the workers' notices (FitPlanInfo.notices) were raised in the calling cell
        self.end_notices: list[str] = []  # rank 0's notices at the end (FitResult.notices)
        self.requests = ProfileRequests(session, self.link)  # handle.profile(steps): asked while the fit runs

    # ---- the work protocol (Session.running) -----------------------------------
    def launch(self) -> None:
        """Start every rank's task and the watcher; if that fails, the shipped files go and the session is free."""
        try:
            if self.policy.restarts:  # the snapshots' folder, owned by this fit, removed when it ends
                fit_scope.begin(self.session, self.plan.cfg)
            self.start_tasks(self.plan.cfg, self.plan.launch)
            self.session.running = self
            for told in list(self.session.on_launch):  # a detached session's record names the running fit
                told(self)
            self.view.start(self)
            self.thread = threading.Thread(target=self._watch, name="nbddp-fit-watch", daemon=True)
            self.thread.start()
        except BaseException:
            self.plan.discard()
            fit_scope.end(self.session, self.plan.cfg)
            self.release_workers()
            raise

    def start_tasks(self, cfg: FitConfig, launch: FitLaunch) -> None:
        """One ``fit_task`` per rank of the current group, watched by a new ``RankTasks``."""
        from nbddp.worker.tasks.entry import fit_task

        s = self.session
        plan = self.plan
        s.follow_kernel_paths()
        ars = to_ranks(s.client, s.placements, fit_task,
                       lambda p: (s.sources.attach(plan.parcels[p.local], p), cfg, launch,
                                  s.sources.attach(plan.model_parcels.get(p.local), p)))
        # with restarts, the policy's grace is longer: a survivor that raises on its own is kept, not replaced
        self.tasks = RankTasks(s, ars, "dist_fit", fit=True, policy=self.policy)

    def relaunch(self, resume: bool | str | None = None) -> None:
        """The same fit again on the healed group, from the newest snapshot (``elastic.recovery``).

        ``resume``: a checkpoint the kernel chose instead (a new Slurm job: ``elastic/job_loss.py``).
        """
        s = self.session
        self._seen, self._plan_seen, self._training_started = 0, False, False
        self.live_state.placements = [RankInfo(p.rank, p.host, p.device, p.pid) for p in s.placements]
        self.hooks.relaunched()
        cfg = self.plan.cfg
        self.start_tasks(dataclasses.replace(cfg, from_snapshot=True) if resume is None else
                         dataclasses.replace(cfg, resume=resume),
                         dataclasses.replace(self.plan.launch, generation=s.generation, resident=()))
        # a replaced engine's first set-up and step import and build for seconds: stall_timeout applies again
        # from the relaunch's first record (_take_records)
        self.launched.pause_stall_timeout()

    @property
    def launched(self) -> RankTasks:
        """The current launch's tasks (``start_tasks`` runs before the watcher thread and every relaunch's reads)."""
        assert self.tasks is not None, "FitRun.start_tasks comes before anything reads the tasks"
        return self.tasks

    # ---- what a relaunch needs of the fit (elastic.recovery.Relaunchable) -----------------------
    @property
    def stopping(self) -> bool:
        return self.stop_requested or self.hard_stopped

    @property
    def config(self) -> FitConfig:
        return self.plan.cfg

    def reconfigure(self, cfg: FitConfig, world_size: int) -> None:
        self.plan.cfg = cfg
        self.live_state.world_size = world_size

    def steps_reached(self) -> list[int]:
        # the ranks' last heartbeats, read once more as the failure was built (they come about once a second)
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
        """A History of this fit holding ``records`` (``(kind, record)``), its restarts listed."""
        cfg, world = self.plan.cfg, self.session.world_size
        history = History(world_size=world, batch_size=cfg.batch_size, global_batch_size=cfg.global_batch_size(world),
                          restarts=self.recovery.restarts)
        for kind, record in records:
            history.add(kind, record)
        return history

    def request_stop(self, reason: str | None = None) -> None:
        """The coordinated stop: every rank stops at the same step (``reason``: who asks, for History)."""
        if self.finished or self.stop_requested:
            return
        self.stop_requested = True
        self.stop_reason = reason or PERSON_STOP
        self.live_state.status = "stopping"
        self.session.debugger.let_go(self, "the fit is stopping")  # a paused rank could not take the stop
        if self._training_started:
            self._send_stop()
        # else: sent by _stream when rank 0 first reports. Before that a rank may not yet have
        # turned SIGINT into a stop flag, and the signal would kill its task instead.

    def _send_stop(self) -> None:
        if not self._stop_sent:
            self._stop_sent = True
            # a rank that stalled cannot take the stop: it is killed after a grace counted from here, not from
            # the request, since a stop asked during set-up is held until training starts (a slow set-up is no stall)
            if self.tasks is not None:
                self.tasks.stopping()
            if self.session.workers is not None:  # None once the workers were stopped: nothing left to signal
                self.session.workers.signal([p.engine_id for p in self.session.placements], signal.SIGINT)

    def hard_stop(self, reason: str = "a second interrupt") -> None:
        """Kill every rank now (they are replaced); the model keeps its old weights."""
        if self.finished:
            return
        self.hard_stopped = True
        self.hard_stop_reason = reason
        self.session.supervisor.kill_ranks([p.rank for p in self.session.placements])
        self.done_event.wait(HARD_STOP_WAIT_S)

    # ---- watcher thread --------------------------------------------------------
    def _stream(self) -> None:
        """Every tick: rank 0's new records, every rank's position and stalls, then the view."""
        self._take_records()
        self.requests.collect(self.launched.ars)
        if self.hooks.answering:  # the ranks wait for the kernel's on_epoch_end: that is no stall
            self.launched.hold_stalls()
        self.launched.check_stalls()
        self.live_state.stalled = self.launched.stalled()
        self.live_state.positions = self.launched.positions()
        self.live_state.paused = self.session.debugger.paused()
        if self._training_started or self.live_state.stalled or self.live_state.paused:
            self.view.update(self)

    def _take_records(self) -> None:
        """Take new records from rank 0's published data (seq + window)."""
        rank0 = self.launched.ars.get(0)
        plan, msg = published(rank0, "plan"), published(rank0, "progress")
        if plan is not None and not self._plan_seen:
            self._plan_seen = True
            self.live_state.plan = plan
            self.hooks.start(plan)
            self.recovery.fit_resumed(self, plan.start_step)  # after a relaunch: where it resumed
        if msg is None:
            return
        if not self._training_started:
            # rank 0 publishes only after every rank agreed on setup, so all have the stop handler now
            self._training_started = True
            if self.stop_requested:
                self._send_stop()
        self.live_state.ranks = msg.ranks or self.live_state.ranks
        if not self.stop_requested:
            self.live_state.status = msg.status
        window = msg.window
        if window and window[0][0] > self._seen:
            # fell behind the window (a very slow poll): skip ahead so the view goes on;
            # the final result (every record, from rank 0's return value) fills the gap
            self.live_state.missed += window[0][0] - self._seen
            self._seen = window[0][0]
        for seq, kind, record in window:
            if seq == self._seen:
                self.history.add(kind, record)
                self.hooks.record(seq, kind, record)
                self._seen = seq + 1
        if self._seen and self.launched.stall_timeout_paused:
            # a record: every rank took a step together, so a relaunch's set-up is over; that is progress for
            # every rank (a fresh engine's heartbeats may still say "setup")
            self.launched.restore_stall_timeout()
        self.hooks.tick(self.history.last_step)

    def _watch(self) -> None:
        try:
            self._finish(self._wait_through_restarts())
        except StuckStop as exc:  # stopped, but a stalled rank could not: its weights never came back
            self.session.resident.clear()
            self.history.status = self.live_state.status = "interrupted"
            self.launched.notify(f"nbddp: training stopped: {exc}. The model keeps the weights it had before "
                                 "this call; History.status is 'interrupted'.")
            self.hooks.close(self.history)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting cell / handle
            self.error = exc
            if self.hard_stopped:
                self.error = KeyboardInterrupt(f"training was killed ({self.hard_stop_reason}); the workers are being "
                                               "replaced and the model keeps the weights it had before the call")
            self.session.resident.clear()  # the workers' caches may have changed mid-way: ship afresh next time
            self.history.status = "failed"
            self.live_state.status = "failed" if not self.hard_stopped else "interrupted"
            self.hooks.close(self.history)
        finally:
            if self.tasks is not None:  # a trace published in the fit's last moments, then no more requests
                self.requests.collect(self.tasks.ars)
            self.requests.close()
            self.link.close()  # the kernel's client of rank 0's store, if any: the fit needs it no more
            self.release_workers()  # (a restart may have begun other work since)
            self.plan.discard()
            fit_scope.end(self.session, self.plan.cfg)  # snapshots removed on every host of the group
            try:  # before done_event: a blocking cell returns only once the final state is drawn
                self.view.finish(self)
            except Exception:  # noqa: BLE001 - a display problem must not hide the result
                pass
            self.watch_cpu_s = time.thread_time()  # this thread's CPU seconds, view included
            self.history.timings["watch_cpu_s"] = self.watch_cpu_s
            self.set_done()

    def _wait_through_restarts(self) -> dict[int, FitResult]:
        """Every rank's result; a lost rank, with ``max_restarts``, is replaced and the fit relaunched."""
        while True:
            try:
                return self.launched.wait(on_tick=self._stream, tick_s=self.poll_s)
            except (WorkerError, SlurmError) as exc:  # a lost rank, or a lost Slurm job: every rank
                if not self.recovery.should_retry(self, exc):
                    raise
                self.recovery.relaunch(self, exc)

    def _finish(self, results: dict[int, FitResult]) -> None:
        t0 = time.perf_counter()
        head = results[0]
        history = self.new_history(self.recovery.before_resume + [(kind, record) for _, kind, record in head.records])
        history.status = "interrupted" if any(r.status == "interrupted" for r in results.values()) else "completed"
        history.ranks = rank_rows(head, results, self.live_state.placements)
        history.compile_report = compile_report.gather(results)
        if self.plan.cfg.profile is not None:
            history.profile = gathered_profile(results, self.plan.cfg.profile, self.session.world_size)
        parcel: shipping.Parcel | None = head.weights
        if parcel is not None:
            try:
                history.model = load_weights(self.plan.model, self.plan.factory, parcel)
            finally:
                parcel.discard()
        loaded = time.perf_counter()
        history.timings = fit_timings(self.plan, head, t0, loaded, self.started_at,
                                      self.session.placements[0].local)
        history.transfers = {"shipped_bytes": max(p.nbytes for p in self.plan.parcels.values())
                             + max((p.nbytes for p in self.plan.model_parcels.values()), default=0),
                             "returned_bytes": parcel.nbytes if parcel is not None else 0}
        # the loggers' last records and closed runs, on_fit_end: before the cell gets the History
        # the plan rank 0 published may land after its result (a short fit on a busy machine): it is in the result too
        self.live_state.plan = self.live_state.plan or head.plan
        self.stop_reason = self.stop_reason or head.stop_reason
        self.end_notices = list(head.notices)
        self.hooks.finish(history, head.records, self.live_state.plan, head.restored)
        self.history = self.session.last_history = history
        self.live_state.status = history.status
        self.session.resident.mark(self.plan.data_keys)

    def result(self) -> History:
        """The History (or the fit's error), after the workers' notices, raised here in the calling cell."""
        self.notices_once()
        return self.outcome()

    def outcome(self) -> History:
        """The History, or the fit's error raised (once the fit ended; no notice)."""
        if self.error is not None:
            raise self.error
        return self.history

    def notices_once(self) -> None:
        """The workers' notices, then a successful fit's recompile warning, each once, in the calling thread."""
        if not self.noticed:  # once, however often the handle is waited on
            self.noticed = True
            for text in [*getattr(self.live_state.plan, "notices", ()), *self.end_notices]:
                notify(text, stacklevel=5)  # notify, notices_once, result, dist_fit or the handle, the cell
        if self.error is None and not self._warned:  # in the cell's thread: the warning shows under that cell
            self._warned = True
            compile_report.warn_once(self.history.compile_report)
