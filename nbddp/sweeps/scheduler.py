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
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from nbddp.fit.history import History
from nbddp.protocol.messages import published
from nbddp.shipping import pickling as shipping
from nbddp.sweeps import resume
from nbddp.sweeps.published import latest, wake_on_publish
from nbddp.sweeps.result import TrialRow, line
from nbddp.sweeps.stale import Heartbeats, ask

# the schedule's own pace, for what no event announces (stalls, storage heartbeats, a stuck peer's grace): a
# trial's published records (sweeps/published.py), a task's return, a stop and a prune signal's delivery wake it at
# once. It was a 10 ms, then a 50 ms poll of the records: on 2 cores, with a worker on each, that polling took CPU
# from the trials
TICK_S = 0.25
LANDING_S = 5.0  # the most a group waits for its prune signal's delivery to be confirmed (see ``_landed``)
GRACE_S = 2.0  # a trial rank failed: its group's other ranks, stuck in a collective after that long, are killed


@dataclass
class Running:
    """One trial on its group: Optuna's trial, its tasks by rank, what the kernel has seen of it."""

    trial: Any
    row: TrialRow
    ars: dict[int, Any]
    engines: list[int]
    cfg: Any
    started: float = field(default_factory=time.perf_counter)
    seen: int = 0
    reported: set[int] = field(default_factory=set)
    signalled: bool = False
    signal_sent: Any = None  # the signal request's reply: done once the engines' nannies have sent the SIGINT
    failed_at: float | None = None  # when the first of its ranks failed
    stalled: str = ""  # which rank made no progress for stall_timeout, and where it was
    walls: dict[str, float] = field(default_factory=dict)  # the kernel's moments of this trial (History.timings)
    bind: dict[str, dict[str, Any]] = field(default_factory=dict)  # its values for the factory and step_fn
    records: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # (kind, record) seen of this attempt
    pending: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # a lost attempt's: cut at the resume
    kept: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # records before the last resume
    restarts: list[dict[str, Any]] = field(default_factory=list)  # History.restarts (sweeps/resume.py)


class SweepRun:
    """The schedule of one ``nbddp.sweep`` call (see the module docstring)."""

    def __init__(self, session: Any, plan: Any, space: Any, study: Any, n_trials: int, groups: list[list[int]],
                 metric: str, token: str, mode: str):
        self.session, self.plan, self.space, self.study = session, plan, space, study
        self.n_trials, self.groups, self.metric, self.token, self.mode = n_trials, groups, metric, token, mode
        self.rows: list[TrialRow] = []
        self.histories: dict[int, History] = {}
        self.running: dict[int, Running] = {}  # group index -> its trial
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
        self.reship: Any = None  # () -> a new FitPlan, after a worker was replaced
        self.stall_timeout: float | None = None  # seconds a trial's rank may make no progress before it is killed
        self.max_restarts = 1  # how many times a trial whose worker died is run again (sweep(max_restarts=...))
        self.snapshot_every: Any = None  # sweep(snapshot_every=...): trials snapshot, and resume after a death
        self.resuming: list[Running] = []  # trials whose worker died, held until the heal (sweeps/resume.py)
        self.heartbeats = Heartbeats(study)  # a stored study's RUNNING trials show they live (sweeps/stale.py)
        self._done = threading.Event()
        self._wake = threading.Event()  # a trial's task returned: the schedule looks at once, not at its next tick
        self.thread = threading.Thread(target=self._run, name="nbddp-sweep", daemon=True)

    # ---- the work protocol (Session.running, waiting.wait_interruptibly) ----------
    @property
    def finished(self) -> bool:
        return self._done.is_set()

    def wait_done(self, timeout: float) -> bool:
        return self._done.wait(timeout)

    def describe(self) -> str:
        return "an nbddp.sweep"

    def request_stop(self) -> None:
        """Hand out nothing more; the running trials stop at their next synchronisation."""
        self.stopping = True
        self._wake.set()  # the schedule signals the running trials now, not at its next tick

    def hard_stop(self, reason: str = "a second interrupt") -> None:
        """Kill the ranks of the running trials (the supervisor replaces them); what finished is kept."""
        ranks = [r for g in list(self.running) for r in self.groups[g]]
        self.session.supervisor.replace_ranks(ranks)
        self._done.wait(10.0)

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
            self._done.set()

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
        ars, engines = self.send(g, cfg, bind)
        self.running[g] = Running(trial, row, ars, engines, cfg, bind=bind,
                                  walls={"ask_wall": asked_wall, "sent_wall": time.time()})

    def send(self, g: int, cfg: Any, bind: dict[str, dict[str, Any]]) -> tuple[dict[int, Any], list[int]]:
        """One ``trial_task`` per rank of group ``g``: the tasks by rank, and their engines."""
        from nbddp.worker.tasks.sweep import trial_task

        s = self.session
        by_rank = s.group.by_rank()
        members = [by_rank[r] for r in self.groups[g]]
        ars = {p.rank: s.client[p.engine_id].apply_async(
            trial_task, self.token, g, s.sources.attach(self.plan.parcels[p.local], p), cfg, self.plan.launch,
            s.sources.attach(self.plan.model_parcels.get(p.local), p), bind) for p in members}
        for ar in ars.values():  # called on the client's IO thread: only an Event set, which cannot raise
            ar.add_done_callback(lambda _ar: self._wake.set())
        wake_on_publish(s.client, ars[self.groups[g][0]], self._wake)  # the first rank carries the records
        return ars, [p.engine_id for p in members]

    def _watch(self, g: int, run: Running) -> None:
        run.row.seconds = time.perf_counter() - run.started
        self._take_records(run)
        if self.stopping:
            self._signal(run)
        ready = [r for r, ar in run.ars.items() if ar.ready()]
        if self.stall_timeout is not None and not run.stalled:
            self._check_stall(run, [r for r in run.ars if r not in ready])
        if len(ready) == len(run.ars):
            del self.running[g]
            self._end(g, run)
        elif any(not run.ars[r].successful() for r in ready):
            self._kill_stuck(run, [r for r in run.ars if r not in ready])

    def _kill_stuck(self, run: Running, pending: list[int]) -> None:
        """A rank of the trial failed: its peers wait in the group's collective, where no signal reaches them."""
        now = time.perf_counter()
        run.failed_at = run.failed_at or now
        if now - run.failed_at > GRACE_S:
            self.dead += self.session.supervisor.kill_ranks(pending)
            run.failed_at = math.inf  # killed once

    def _check_stall(self, run: Running, pending: list[int]) -> None:
        """A rank whose heartbeat says it made no progress for ``stall_timeout``: the trial's ranks are killed."""
        for r in pending:
            beat = published(run.ars[r], "beat")
            if beat is not None and beat.idle_s > self.stall_timeout:
                run.stalled = (f"WorkerStalled: rank {r} made no progress for {beat.idle_s:.0f} s (stall_timeout="
                               f"{self.stall_timeout:g}), in phase {beat.phase!r}; its ranks were killed and "
                               f"replaced\n{beat.stack}")
                self.dead += self.session.supervisor.kill_ranks(pending)
                return

    def _take_records(self, run: Running) -> None:
        msg = latest(self.session.client, run.ars[self.groups[run.row.group][0]], "progress")
        for seq, kind, record in (msg.window if msg is not None else []):
            if seq >= run.seen:
                run.seen = seq + 1
                run.records.append((kind, record))
                self.consider(run, record)

    def consider(self, run: Running, record: dict[str, Any], prune: bool = True) -> None:
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
            self._signal(run)

    def _signal(self, run: Running) -> None:
        if not run.signalled:
            run.signalled = True
            run.signal_sent = self.session.workers.signal(run.engines, signal.SIGINT)
            if run.signal_sent is not None:
                run.signal_sent.add_done_callback(lambda _f: self._wake.set())

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
            self._signal(run)

    def _end(self, g: int, run: Running) -> None:
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

    def lost(self, run: Running, ranks: list[int], retry: bool) -> None:
        """Ranks of ``run`` are gone: their engines are replaced once no trial runs; ``retry``: its worker died (not
        when it raised and its peers were killed stuck), so it runs again as a new trial, up to ``max_restarts``."""
        by_rank = self.session.group.by_rank()
        self.dead += [by_rank[r].engine_id for r in ranks if r in by_rank]
        if not retry or self.stopping:
            return
        attempt = run.trial.user_attrs.get("nbddp_attempt", 0)
        if attempt >= self.max_restarts:
            run.row.error += (f"\n(its worker died, and max_restarts={self.max_restarts} is spent: this trial's "
                              f"parameters ran {attempt + 1} time(s) and are not run again; pass "
                              f"nbddp.sweep(..., max_restarts={self.max_restarts + 1}) or more to retry further)")
            return
        origin = run.trial.user_attrs.get("nbddp_retry_of", run.row.trial)
        self.study.enqueue_trial(dict(run.trial.params),
                                 user_attrs={"nbddp_retry_of": origin, "nbddp_attempt": attempt + 1})
        self.handed -= 1  # the retry takes this trial's place among the n_trials
        run.row.error += (f"\n(its worker died: the trial is run again as a new trial, retry {attempt + 1} of "
                          f"max_restarts={self.max_restarts})")

    def _heal(self) -> None:
        """Replace the lost engines (a new process-group generation), ship again, open the trial groups again."""
        from nbddp.sweeps.groups import open_trial_groups

        s = self.session
        dead, self.dead = list(dict.fromkeys(self.dead)), []
        s.supervisor.recover(dead)
        s.wait_healed()
        s.running = None  # the groups are opened as any other work is, on a free session
        try:
            with s.lock:
                plan, self.plan = self.plan, self.reship()
            plan.discard()
            self.token = open_trial_groups(s, self.groups)
        finally:
            s.running = self

    def keep_if_best(self, value: float, parcel: Any, params: dict[str, Any]) -> None:
        """Copy the weights out of the returned parcel when this trial is the best so far (before it is reused)."""
        better = self.best is None or (value < self.best[0] if self.mode == "min" else value > self.best[0])
        if better and parcel is not None:
            self.best = (value, shipping.unpack(parcel), params)
