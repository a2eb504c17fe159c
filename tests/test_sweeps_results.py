"""How a sweep settles a trial and draws its results, without workers: the trial's tasks and the study are stand-ins
or built in memory."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from nbddp.sweeps.outcome import settle
from nbddp.sweeps.result import SweepResult, TrialRow

optuna = pytest.importorskip("optuna")

LR = optuna.distributions.FloatDistribution(1e-4, 1e-1, log=True)
WIDTH = optuna.distributions.CategoricalDistribution([4, 8])


class Task:
    """An ipyparallel AsyncResult that ended: the error ``get`` raises."""

    def __init__(self, error: BaseException):
        self.error = error
        self.metadata = {}

    def ready(self) -> bool:
        return True

    def get(self, timeout: float = 0) -> None:
        raise self.error


def interrupted_trial(stopping: bool):
    """A trial whose only rank raised KeyboardInterrupt: the stop's SIGINT came before the trial's own handler."""
    from ipyparallel.error import RemoteError

    from nbddp.execution.policy import FailurePolicy
    from nbddp.execution.rank_tasks import RankTasks
    from nbddp.sweeps.trial_run import TrialRun

    study = optuna.create_study()
    trial = study.ask({"lr": LR})
    placement = SimpleNamespace(rank=0, pid=4242, host="here", engine_id=0)
    session = SimpleNamespace(placements=[placement], workers=None, debugger=SimpleNamespace(paused=lambda: []),
                              group=SimpleNamespace(by_rank=lambda: {0: placement}, placements=[placement]),
                              supervisor=SimpleNamespace(kill_ranks=lambda ranks: [], recover=lambda ids: None))
    sweep = SimpleNamespace(session=session, study=study, stopping=stopping, sampler_done=False, groups=[[0]],
                            policy=FailurePolicy(max_restarts=1, retry_stalls=False), wake=lambda: None)
    error = RemoteError("KeyboardInterrupt", "", "Traceback (most recent call last):\n  in loop.fit\nKeyboardInterrupt")
    run = TrialRun(sweep, trial, TrialRow(trial.number, dict(trial.params), group=0), cfg=None, bind={}, walls={})
    tasks = RankTasks(session, {0: Task(error)}, run.describe(), fit=True, policy=sweep.policy, lose=lambda ids: None)
    run.begin(tasks, [0], cfg=None)
    assert tasks.poll()  # decided: the outcome is settled from here
    return sweep, run


def test_a_stop_signal_that_lands_before_the_trial_starts_is_a_stop_not_a_failure():
    sweep, run = interrupted_trial(stopping=True)
    settle(sweep, run)
    assert run.row.state == "stopped" and run.row.error == "" and run.row.rank is None
    assert sweep.study.trials[0].state.name == "FAIL"  # told as failed, so that a resumed study runs it again


def test_the_same_interrupt_without_a_stop_is_the_trials_failure():
    """A KeyboardInterrupt nobody asked for (the person's code raised it) is recorded as the rank's failure."""
    sweep, run = interrupted_trial(stopping=False)
    settle(sweep, run)
    assert run.row.state == "failed" and run.row.rank == 0
    assert run.row.error.startswith("KeyboardInterrupt: \nTraceback") and sweep.study.trials[0].state.name == "FAIL"


def finished_study(values: dict[tuple[float, int], float | None]):
    study = optuna.create_study()
    for (lr, width), value in values.items():
        state = optuna.trial.TrialState.COMPLETE if value is not None else optuna.trial.TrialState.PRUNED
        study.add_trial(optuna.trial.create_trial(params={"lr": lr, "width": width},
                                                  distributions={"lr": LR, "width": WIDTH}, value=value, state=state))
    rows = [TrialRow(t.number, t.params, "complete" if t.value is not None else "pruned", t.value) for t in study.trials]
    return SweepResult(rows=rows, metric="val_loss", mode="min", study=study)


def test_parallel_coordinates_draw_every_parameter_against_the_metric():
    import matplotlib.pyplot as plt
    from matplotlib.figure import Figure

    result = finished_study({(1e-3, 4): 0.5, (1e-2, 8): 0.2, (1e-1, 4): 0.9, (1e-4, 8): None})
    fig = result.plot(kind="parallel")
    assert isinstance(fig, Figure) and fig not in map(plt.figure, plt.get_fignums())  # not left open in pyplot
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["val_loss", "lr", "width"]
    assert len(ax.collections[0].get_segments()) == 3  # one line per completed trial; the pruned one is left out
    only_lr = result.plot(kind="parallel", params=["lr"])
    assert [t.get_text() for t in only_lr.axes[0].get_xticklabels()] == ["val_loss", "lr"]
    curves = result.plot()  # the curves, as before: an image as a cell's value in a plain kernel, no pyplot needed
    assert isinstance(curves, Figure) and curves._repr_png_()[:4] == b"\x89PNG"


def test_a_plot_that_cannot_be_drawn_says_why():
    with pytest.raises(ValueError, match=r"kind='bars'\) must be 'curves' \(every trial's val_loss by step\) or"):
        finished_study({(1e-3, 4): 0.5}).plot(kind="bars")
    with pytest.raises(ValueError, match=r"needs at least one completed trial.*states here: \['pruned'\]"):
        finished_study({(1e-3, 4): None}).plot(kind="parallel")


def test_the_live_views_stop_button_stops_the_sweep_and_goes_when_it_ends(monkeypatch):
    import ipywidgets as w

    from nbddp.sweeps.view import SweepView

    shown, updates = [], []

    class Handle:
        def __init__(self, obj):
            self.obj = obj

        def update(self, obj):
            updates.append((self.obj, obj))

    monkeypatch.setattr("IPython.display.display", lambda obj, display_id=False: shown.append(obj) or Handle(obj))
    stops = []
    run = SimpleNamespace(rows=[TrialRow(0, {"lr": 0.1}, "running", 0.5, 1, 0.2)], curves={0: [(4, 0.5)]}, changed=1,
                          lines=[], metric="val_loss", mode="min")
    view = SweepView("html", stop=lambda: stops.append("stop"))
    view.tick(run)
    button = shown[1]
    assert len(shown) == 2 and isinstance(button, w.Button) and button.description == "Stop"
    assert "Kernel > Interrupt" in button.tooltip
    button.click()  # what the browser's click does: the handler on_click registered
    assert stops == ["stop"] and button.disabled and button.description == "Stopping..."
    view.close()
    assert [(before, after.data) for before, after in updates] == [(button, "")]  # a saved notebook keeps no button
    assert view.stop_button is None
    view.close()  # a second close (the handle's thread and a failing cell both close) does nothing
    without = SweepView("html")
    shown.clear()
    without.tick(run, final=True)
    assert len(shown) == 1  # no stop to call: no button


def test_a_pruned_trials_group_waits_for_its_signal_to_be_sent_not_a_fixed_time(monkeypatch):
    """The group of a pruned trial takes the next trial once the nannies confirm the SIGINT was sent (a later signal
    could stop that next trial), at once when its trial was not signalled, and after ``LANDING_S`` without a reply."""
    from concurrent.futures import Future

    from nbddp.sweeps import scheduler

    sweep = scheduler.SweepRun(SimpleNamespace(), None, None, optuna.create_study(), 1, [[0], [1]], "val_loss", "t",
                               "min")
    sent = Future()
    sweep.landing = {0: (sent, scheduler.time.perf_counter() + scheduler.LANDING_S), 1: (None, 0.0)}
    assert not sweep._landed(0) and sweep._landed(1)
    sent.set_result([{"status": "ok"}])
    assert sweep._landed(0)
    lost = Future()  # a nanny that never answers: the group is not held past the deadline
    sweep.landing[0] = (lost, scheduler.time.perf_counter() - 0.001)
    assert sweep._landed(0)


def test_a_trials_published_records_wake_the_schedule_and_are_read_without_polling_the_task():
    """The first rank's published data (ipyparallel's own ``Metadata``, updated in place by the client's IO thread)
    sets the schedule's event as it lands, keeps what had landed before the swap, and is read with a dict lookup."""
    import threading

    from ipyparallel.client.client import Metadata

    from nbddp.protocol.messages import PUBLISH_KEYS
    from nbddp.sweeps.published import latest, wake_on_publish

    client = SimpleNamespace(metadata={"m1": Metadata()})
    client.metadata["m1"]["data"][PUBLISH_KEYS["plan"]] = "the plan"  # landed before the swap
    ar, wake = SimpleNamespace(msg_ids=["m1"]), threading.Event()
    wake_on_publish(client, ar, wake)
    assert latest(client, ar, "progress") is None and latest(client, ar, "plan") == "the plan" and not wake.is_set()
    io = threading.Thread(target=lambda: client.metadata["m1"]["data"].update({PUBLISH_KEYS["progress"]: "records"}))
    io.start()  # what Client._dispatch_iopub does with a data_message
    assert wake.wait(5.0)
    io.join()
    assert latest(client, ar, "progress") == "records"
    assert latest(client, SimpleNamespace(msg_ids=["gone"]), "progress") is None  # a task the client forgot


def test_a_trial_not_yet_sent_says_so_and_a_lost_job_ends_the_sweep_rather_than_the_trial():
    """A trial's tasks exist once it is sent; when its ranks were lost with the whole Slurm job (or the controller),
    settling it raises that error, which ends the sweep (a new trial on those workers could not run either)."""
    from nbddp.protocol.errors import SlurmError

    sweep, run = interrupted_trial(stopping=False)
    fresh = type(run)(sweep, run.trial, TrialRow(99, {}, group=0), cfg=None, bind={}, walls={})
    with pytest.raises(RuntimeError, match=r"trial 99 of an nbddp.sweep was not sent"):
        fresh.attempt
    lost = SlurmError("Slurm job 42 was cancelled", "42", "CANCELLED")
    sweep.session.workers = SimpleNamespace(job_problem=lambda: "CANCELLED")
    sweep.session.supervisor.job_lost = lambda job, what: lost
    with pytest.raises(SlurmError, match="Slurm job 42 was cancelled"):
        settle(sweep, run)
