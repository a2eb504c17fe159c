"""A sweep in flight: trials handed to groups of workers as they free up, pruned, recorded.

One kernel thread (``nbddp-sweep``) runs the whole schedule, so Optuna is
only ever called from it. Every tick (``TICK_S``), or at once when a trial's
task returns (a done-callback wakes it) or its first rank publishes records
(``sweeps/published.py``), it:

1. looks at each running trial's first rank: new records (the same
   published window ``dist_fit`` streams) are reported to Optuna at their
   step, and when the pruner says so the trial's engines get SIGINT, the
   coordinated stop (every rank of the group stops at the same step);
2. finishes the trials whose tasks all returned: the value is told to the
   study, a failure is recorded with its rank and remote traceback, and the
   best trial's weights so far are copied out of the returned parcel;
3. hands the next trial (``study.ask``) to every group that is free.

A stop (Kernel > Interrupt, ``request_stop``) hands out nothing more and
stops the running trials the same way a pruner does; what finished is kept.
"""

from __future__ import annotations

import math
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from nbddp.execution.policy import FailurePolicy
from nbddp.execution.rank_tasks import RankTasks
from nbddp.execution.send import to_ranks
from nbddp.execution.work import Work
from nbddp.fit.history import History
from nbddp.protocol.fit_options import FitConfig
from nbddp.shipping import pickling as shipping
from nbddp.sweeps import resume
from nbddp.sweeps.published import latest, wake_on_publish
from nbddp.sweeps.result import TrialRow, line
from nbddp.sweeps.stale import Heartbeats, ask
from nbddp.sweeps.space import Space
from nbddp.sweeps.trial_run import TrialRun

if TYPE_CHECKING:
    import optuna

    from nbddp.fit.preflight import FitPlan
    from nbddp.session.session import Session

# the schedule's own pace, for what no event announces (stalls, storage heartbeats, a stuck peer's grace): a
# trial's published records (sweeps/published.py), a task's return, a stop and a prune signal's delivery wake it at
# once. It was a 10 ms, then a 50 ms poll of the records: on 2 cores, with a worker on each, that polling took CPU
# from the trials
TICK_S = 0.25
LANDING_S = 5.0  # the most a group waits for its prune signal's delivery to be confirmed (see ``_landed``)


class SweepRun(Work):
    """The schedule of one ``nbddp.sweep`` call (see the module docstring)."""

    session: Session  # its trials' parcels carry the session's source lines (SessionLike does not hold them)

    def __init__(self, session: Session, plan: FitPlan, space: Space, study: optuna.Study, n_trials: int,
                 groups: list[list[int]], metric: str, token: str, mode: str, policy: FailurePolicy | None = None):
        super().__init__(session, "an nbddp.sweep")
        self.plan, self.space, self.study = plan, space, study
        self.n_trials, self.groups, self.metric, self.token, self.mode = n_trials, groups, metric, token, mode
        self.rows: list[TrialRow] = []
        self.histories: dict[int, History] = {}
        self.running: dict[int, TrialRun] = {}  # group index -> its trial
        self.landing: dict[int, tuple[Any, float]] = {}  # group -> (its last prune signal's reply, deadline)
        self.handed = 0
        self.best: tuple[float, Any, dict[str, Any]] | None = None  # (value, state dict, params)
        self.stopping = False
        self.sampler_done = False  # the sampler has nothing more to try (a grid that is run)
        self.error: BaseException | None = None
        self.lines: list[str] = []  # leaderboard lines for the waiting cell to print
        self.curves: dict[int, list[tuple[int, float]]] = {}  # trial number -> (step, metric) as reported
        self.changed = 0  # counts what the live view should redraw for
        self.dead: list[int] = []  # engines lost (died, or killed stuck): replaced once the running trials end
        self.reship: Callable[[], FitPlan] | None = None  # a new FitPlan, after a worker was replaced
        # each trial's failure policy: max_restarts (default 1) for a trial whose worker died, snapshot_every (it
        # resumes from its snapshot), stall_timeout; a stall is not retried (the same values would stall again)
        self.policy = policy or FailurePolicy(max_restarts=1, retry_stalls=False)
        self.resuming: list[TrialRun] = []  # trials whose worker died, held until the heal (sweeps/resume.py)
        self.heartbeats = Heartbeats(study)  # a stored study's RUNNING trials show they live (sweeps/stale.py)
        self._wake = threading.Event()  # a trial's task returned: the schedule looks at once, not at its next tick
        self.thread = threading.Thread(target=self._run, name="nbddp-sweep", daemon=True)

    # ---- the work protocol (Session.running, nbddp.execution.work.wait_interruptibly) ----------
    def wake(self) -> None:
        """Look at the trials now, not at the next tick (a task returned, a signal was sent: any thread)."""
        self._wake.set()

    def lose(self, engine_ids: list[int]) -> None:
        """Engines of a trial died or were killed: replaced once no trial runs (``_heal``), not now."""
        self.dead += engine_ids

    def request_stop(self) -> None:
        """Hand out nothing more; the running trials stop at their next synchronisation."""
        self.stopping = True
        self._wake.set()  # the schedule signals the running trials now, not at its next tick

    def hard_stop(self, reason: str = "a second interrupt") -> None:
        """Kill the ranks of the running trials (the supervisor replaces them); what finished is kept."""
        ranks = [r for g in list(self.running) for r in self.groups[g]]
        self.session.supervisor.replace_ranks(ranks)
        self.done_event.wait(10.0)

    # ---- the schedule ---------------------------------------------------------------
    def _run(self) -> None:
        from nbddp.sweeps.outcome import drop_held

        try:
            while self.running or self._more() or self.resuming or (self.dead and not self.stopping):
                self._wake.clear()
                if self.stopping and self.resuming:
                    drop_held(self)
                self.heartbeats.beat([run.trial for run in [*self.running.values(), *self.resuming]])
                for g, run in list(self.running.items()):
                    self._watch(g, run)
                if self.dead and not self.running and not self.stopping:
                    self._heal()
                for g in range(len(self.groups)):
                    held = resume.held_for(self, g)
                    if g in self.running or not self._landed(g):
                        continue
                    if held is not None and not self.dead:
                        resume.relaunch(self, g, held)
                    elif held is None and self._more():
                        self._hand_out(g)
                self._wake.wait(TICK_S)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting cell
            self.error = exc
            self.stopping = True
            self._stop_all()
        finally:
            if self.dead:  # lost while stopping: nothing waits for them here, the supervisor replaces them
                self.session.supervisor.recover(list(dict.fromkeys(self.dead)))
                self.dead = []
            self.set_done()

    def _more(self) -> bool:
        if self.stopping or self.dead or self.handed >= self.n_trials:
            return False
        return not self.sampler_done or self._retries_waiting()

    def _retries_waiting(self) -> bool:
        """A trial queued to run again (a dead worker's) still runs when the sampler has nothing more to try."""
        from optuna.trial import TrialState

        return bool(self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))

    def _hand_out(self, g: int) -> None:
        from dataclasses import replace

        from optuna.trial import TrialState

        from nbddp.fit.option_checks import make_config
        from nbddp.sweeps.outcome import tell

        asked_wall = time.time()
        trial = ask(self.study, self.space.distributions)
        self.heartbeats.start(trial)
        fit_params, bind = self.space.split(trial.params)
        row = TrialRow(trial=trial.number, params=dict(trial.params), group=g)
        self.rows.append(row)
        self.handed += 1
        try:  # a sampled value the fit refuses (say batch_size=0) fails this trial, not the sweep
            checked = make_config(**fit_params)
        except (TypeError, ValueError) as exc:
            row.state, row.error = "failed", f"{type(exc).__name__}: {exc}"
            tell(self, trial, state=TrialState.FAIL)
            self.lines.append(line(row, self.metric))
            return
        cfg = resume.with_snapshots(self, replace(self.plan.cfg, **{k: getattr(checked, k) for k in fit_params}))
        run = TrialRun(self, trial, row, cfg, bind, walls={"ask_wall": asked_wall, "sent_wall": time.time()})
        self.send(g, run, cfg)
        self.running[g] = run

    def send(self, g: int, run: TrialRun, cfg: FitConfig) -> None:
        """One ``trial_task`` per rank of group ``g``: a new attempt of ``run``, watched by its own ``RankTasks``."""
        from nbddp.worker.tasks.sweep import trial_task

        s = self.session
        assert s.group is not None, "a sweep's trials are sent to a formed group"
        by_rank = s.group.by_rank()
        members = [by_rank[r] for r in self.groups[g]]
        ars = to_ranks(s.client, members, trial_task,
                       lambda p: (self.token, g, s.sources.attach(self.plan.parcels[p.local], p), cfg, self.plan.launch,
                                  s.sources.attach(self.plan.model_parcels.get(p.local), p), run.bind))
        for ar in ars.values():  # called on the client's IO thread: only an Event set, which cannot raise
            ar.add_done_callback(lambda _ar: self._wake.set())
        wake_on_publish(s.client, ars[self.groups[g][0]], self._wake)  # the first rank carries the records
        # a trial's stalls are not hinted (it is one of many, and the schedule's thread is no cell): stall_timeout
        # fails it; its lost engines are replaced once no trial runs
        tasks = RankTasks(s, ars, run.describe(), fit=True, policy=self.policy, lose=self.lose,
                          notify=lambda text: None)
        run.begin(tasks, [p.engine_id for p in members], cfg)

    def _watch(self, g: int, run: TrialRun) -> None:
        run.row.seconds = time.perf_counter() - run.started
        self._take_records(run)
        if self.stopping:
            run.request_stop()
        if run.watch():
            del self.running[g]
            self._end(g, run)

    def _take_records(self, run: TrialRun) -> None:
        msg = latest(self.session.client, run.first_rank_task(), "progress")
        for seq, kind, record in (msg.window if msg is not None else []):
            if seq >= run.seen:
                run.seen = seq + 1
                run.records.append((kind, record))
                self.consider(run, record)

    def consider(self, run: TrialRun, record: dict[str, Any], prune: bool = True) -> None:
        """A record of the trial: its metric reported to Optuna (once per step); the pruner may stop it."""
        value = record.get(self.metric)
        if "epoch" in record:
            run.row.epoch = record["epoch"]
        if value is None or record["step"] in run.reported or not math.isfinite(value):
            return
        run.reported.add(record["step"])
        run.row.value = value
        self.curves.setdefault(run.row.trial, []).append((record["step"], value))
        self.changed += 1
        run.trial.report(value, record["step"])
        if prune and not run.signalled and run.trial.should_prune():
            run.row.state = "pruning"
            run.request_stop()

    def _landed(self, g: int) -> bool:
        """Group ``g`` may take a trial: no prune signal of its last trial is still on its way.

        The signal travels kernel -> controller -> the engine's nanny, which
        replies once it has sent it. A signal that reached the engine after
        its trial ended is handled before the engine runs any further code
        (the idle handler ignores it), so once the reply is here it can no
        longer stop the next trial. Without a reply (a nanny gone: its engine
        is replaced anyway) the group waits ``LANDING_S`` at most. This
        replaced a fixed 0.5 s wait after every pruned trial.
        """
        sent, deadline = self.landing.get(g, (None, 0.0))
        return sent is None or sent.done() or time.perf_counter() >= deadline

    def _stop_all(self) -> None:
        for run in list(self.running.values()):
            run.request_stop()

    def _end(self, g: int, run: TrialRun) -> None:
        from nbddp.sweeps.outcome import settle

        self.landing[g] = (run.signal_sent, time.perf_counter() + LANDING_S)
        run.walls["seen_wall"] = time.time()
        settle(self, run)
        if run not in self.resuming:
            resume.release(run)
        if run.row.trial in self.histories:
            self.histories[run.row.trial].timings.update(run.walls, settled_wall=time.time())
        self.lines.append(line(run.row, self.metric))
        self.changed += 1
        run.set_done()

    def run_again(self, run: TrialRun, attempt: int) -> None:
        """``run``'s worker died and it had no snapshot: its parameters run again as a new trial (attempt
        ``attempt + 1``), in its place among the n_trials."""
        origin = run.trial.user_attrs.get("nbddp_retry_of", run.row.trial)
        self.study.enqueue_trial(dict(run.trial.params),
                                 user_attrs={"nbddp_retry_of": origin, "nbddp_attempt": attempt + 1})
        self.handed -= 1

    def _heal(self) -> None:
        """Replace the lost engines (a new process-group generation), ship again, open the trial groups again."""
        from nbddp.sweeps.groups import open_trial_groups

        s, reship = self.session, self.reship
        assert reship is not None, "the call sets how to ship again before the schedule runs (call._open)"
        dead, self.dead = list(dict.fromkeys(self.dead)), []
        s.supervisor.recover(dead)
        s.wait_healed()
        s.running = None  # the groups are opened as any other work is, on a free session
        try:
            with s.lock:
                plan, self.plan = self.plan, reship()
            plan.discard()
            self.token = open_trial_groups(s, self.groups)
        finally:
            s.running = self

    def keep_if_best(self, value: float, parcel: shipping.Parcel | None, params: dict[str, Any]) -> None:
        """Copy the weights out of the returned parcel when this trial is the best so far (before it is reused)."""
        better = self.best is None or (value < self.best[0] if self.mode == "min" else value > self.best[0])
        if better and parcel is not None:
            self.best = (value, shipping.unpack(parcel), params)
