"""nbddp.sweep: independent trials on groups of the warm workers, sampled and pruned by Optuna (2 CPU workers)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn

import nbddp
from nbddp.sweeps import space as spaces
from nbddp.sweeps.result import fmt

optuna = pytest.importorskip("optuna")
pytestmark = pytest.mark.timeout(300)


def make_net(width: int = 8, explode: bool = False) -> nn.Module:
    """A tiny classifier; ``explode=True`` builds one whose forward raises (a trial that fails)."""
    return Exploding(width) if explode else nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 2))


class Exploding(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        raise ValueError("boom: this trial's model cannot run")


def tensors(n: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return x, (x.sum(1) > 0).long()


class PruneTinyLr(optuna.pruners.BasePruner):
    """Prunes a trial whose lr is below 1e-3 at its first report: which trials are pruned is known in advance."""

    def prune(self, study, trial):
        return trial.params["lr"] < 1e-3


def grid(**values):
    return optuna.samplers.GridSampler({k: list(v) for k, v in values.items()}, seed=0)


# ---- checks before any trial (no worker involved) ------------------------------------------------
def test_the_simple_forms_become_optuna_distributions():
    d = optuna.distributions
    assert spaces.distribution("lr", (1e-4, 1e-1, "log")) == d.FloatDistribution(1e-4, 1e-1, log=True)
    assert spaces.distribution("width", (8, 64)) == d.IntDistribution(8, 64)
    assert spaces.distribution("width", [64, 128]) == d.CategoricalDistribution([64, 128])
    own = d.FloatDistribution(0.0, 0.5)
    assert spaces.distribution("dropout", own) is own


@pytest.mark.parametrize("value, error, match", [
    ((1e-1, 1e-4), ValueError, r"space=\{'lr': \(0.1, 0.0001\)\}\): `low <= high` must hold"),
    ((0.0, 1.0, "log"), ValueError, r"space=\{'lr': \(0.0, 1.0, 'log'\)\}\): `low > 0` must hold for `log=True`"),
    ((1e-4, 1e-1, "cubic"), ValueError, r"the third entry is the scale, 'log' or 'linear', not 'cubic'"),
    ([], TypeError, r"must be an Optuna distribution, \(low, high\).*non-empty list"),
    ("0.1", TypeError, r"space=\{'lr': '0.1'\}\) must be an Optuna distribution"),
])
def test_a_bad_range_is_named_with_its_value(value, error, match):
    with pytest.raises(error, match=match):
        spaces.distribution("lr", value)


def test_names_go_to_the_fit_the_factory_or_step_fn():
    def step(model, batch, alpha=1.0):
        return model(batch[0]).sum() * alpha

    sp = spaces.build_space({"lr": [0.1], "width": [4], "alpha": (0.1, 1.0)}, make_net, step, {})
    assert sp.where == {"lr": "fit", "width": "model", "alpha": "step_fn"}
    assert sp.split({"lr": 0.1, "width": 4, "alpha": 0.5}) == ({"lr": 0.1},
                                                               {"model": {"width": 4}, "step_fn": {"alpha": 0.5}})


def test_a_name_given_twice_is_refused():
    with pytest.raises(ValueError, match=r"'lr' is both in space and given as lr=0.1; keep one of them"):
        spaces.build_space({"lr": [0.1]}, make_net, None, {"lr": 0.1})


def test_a_model_object_has_no_arguments_to_sweep():
    with pytest.raises(ValueError, match=r"names 'width'.*model is an nn.Module object: pass a factory"):
        spaces.build_space({"width": [4]}, make_net(), None, {})


@pytest.mark.parametrize("mesh, per_trial", [({"dp": 1, "pp": 2}, 1), ({"dp": 2, "tp": 2}, 2)])
def test_a_sweeps_mesh_must_span_one_trial_group(mesh, per_trial):
    with pytest.raises(ValueError, match=re.escape(f"nbddp.sweep(mesh={mesh}) spans {mesh['dp'] * max(mesh.get('pp', 1), mesh.get('tp', 1))} ranks, but each trial trains on its own group of workers_per_trial={per_trial}")
                       + r".*Pass workers_per_trial="):
        spaces.check_strategy({"mesh": mesh}, per_trial)


def test_a_sweep_takes_every_strategy_of_dist_fit():
    for strategy in ("ddp", "fsdp", nbddp.DDP(find_unused_parameters=True), nbddp.FSDP(), nbddp.Pipeline(stages=2),
                     nbddp.TensorParallel()):
        spaces.check_strategy({"strategy": strategy}, 2)  # raises nothing: the fit's own checks follow
    spaces.check_strategy({"mesh": {"dp": 1, "tp": 2}}, 2)


def test_a_study_that_goes_the_other_way_is_refused():
    from nbddp.sweeps.call import make_study

    with pytest.raises(ValueError, match=r"mode='min'\) disagrees with the study, which is created to maximize; pass mode='max'"):
        make_study(optuna.create_study(direction="maximize"), "min", None, None)
    with pytest.raises(TypeError, match=r"study=...\) must be an optuna.Study, got dict"):
        make_study({}, "min", None, None)


def test_the_live_view_is_the_leaderboard_best_first_and_the_curves(monkeypatch, capsys):
    from types import SimpleNamespace

    from nbddp.sweeps.result import TrialRow
    from nbddp.live.choice import live_choice
    from nbddp.sweeps.view import SweepView, leaderboard_html

    rows = [TrialRow(0, {"lr": 0.1}, "complete", 0.5, 2, 1.0), TrialRow(1, {"lr": 0.01}, "complete", 0.2, 2, 1.2),
            TrialRow(2, {"lr": 1e-6}, "pruned", 0.9, 0, 0.3), TrialRow(3, {"lr": 0.05}, "running", 0.7, 1, 0.8)]
    table = leaderboard_html(rows, "val_loss", "min")
    assert [int(t) for t in re.findall(r"<tr[^>]*><td>(\d+)</td>", table)] == [1, 0, 2, 3]
    assert "<td>lr=0.01</td><td>0.2</td><td>2</td><td>complete</td><td>1.2 s</td>" in table
    shown, updated = [], []
    handle = SimpleNamespace(update=updated.append)
    monkeypatch.setattr("IPython.display.display", lambda obj, display_id=False: shown.append(obj) or handle)
    run = SimpleNamespace(rows=rows, curves={0: [(4, 0.6), (8, 0.5)], 1: [(4, 0.3), (8, 0.2)], 2: [(4, 0.9)]},
                          changed=3, lines=["trial 0 ..."], metric="val_loss", mode="min")
    view = SweepView("html")
    view.tick(run, final=True)
    assert len(shown) == 1 and "<img src='data:image/png;base64," in shown[0].data and run.lines == []
    view.tick(run, final=True)  # nothing changed: nothing drawn
    run.changed = 4
    view.tick(run, final=True)
    assert len(shown) == 1 and len(updated) == 1  # the same output, updated in place
    text = SweepView("text")
    run.lines.append("trial 3 line")
    text.tick(run)
    assert capsys.readouterr().out == "trial 3 line\n" and run.lines == []
    with pytest.raises(ValueError, match=r"sweep\(live=\.\.\.\) must be True, False, None \(automatic\), 'widget' or 'text'; got 'x'"):
        live_choice("x", "nbddp.sweep")
    with pytest.deprecated_call(match=r"nbddp.sweep\(live='html'\) is now live='widget'"):
        assert live_choice("html", "nbddp.sweep") == "widget"  # the old spelling works


@pytest.mark.parametrize("kwargs, match", [
    ({"space": {"nope": [1, 2]}}, r"names 'nope', which is none of: the dist_fit options"),
    ({"space": {}}, r"space=...\) must be a non-empty dict"),
    ({"n_trials": 0}, r"n_trials=0\) must be an int >= 1"),
    ({"workers_per_trial": 3}, r"workers_per_trial=3\) must divide the 2 running workers.*\[1, 2\]"),
    ({"metric": "val_acc", "val_data": None}, r"metric='val_acc'\) is not reported.*need val_data.*\['loss'\]"),
    ({"mode": "up"}, r"mode='up'\) must be 'min' or 'max'"),
])
def test_bad_input_is_refused_before_any_trial(workers, kwargs, match):
    """The issue's six cases, through nbddp.sweep on the running workers: an error, no trial, workers free."""
    args = dict(space={"lr": [0.1]}, n_trials=2, val_data=tensors(16, 1))
    args.update(kwargs)
    generation = workers.generation
    with pytest.raises(ValueError, match=match):
        nbddp.sweep(make_net, tensors(), **args)
    assert not workers.busy and workers.generation == generation


# ---- sweeps on the workers --------------------------------------------------------------------
def _leaderboard_rows(text: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(0) for m in re.finditer(r"trial\s+(\d+) .*", text)}


EPOCHS = 12


def paced_step(model, batch):
    """A step of at least 4 ms: a whole trial lasts about 0.4 s, so the pruner's stop (polled every 10 ms, then a
    signal) lands before a tiny-lr trial could finish its 12 epochs, even on a loaded machine."""
    import time

    import torch.nn.functional as F

    time.sleep(0.004)
    x, y = batch
    return F.cross_entropy(model(x), y)


def test_six_trials_with_a_pruner_complete_and_the_pruned_stop_early(workers, capsys):
    study = optuna.create_study(sampler=grid(lr=[1e-6, 0.05], width=[4, 8, 16]), pruner=PruneTinyLr())
    # publish_interval_s: each validation reaches the kernel at once, so the pruner decides while the trial runs
    result = nbddp.sweep(make_net, tensors(128), val_data=tensors(32, 1), n_trials=6, study=study, epochs=EPOCHS,
                         space={"lr": [1e-6, 0.05], "width": [4, 8, 16]}, batch_size=16, publish_interval_s=0.02,
                         step_fn=paced_step)
    trials = result.trials
    assert len(trials) == 6 and result.status == "completed"
    assert sorted(trials["state"]) == ["complete"] * 3 + ["pruned"] * 3
    for _, row in trials.iterrows():
        epochs = result.histories[row["trial"]].epochs
        if row["state"] == "pruned":
            assert row["params_lr"] == 1e-6 and len(epochs) < EPOCHS  # stopped on its workers, not run to the end
        else:
            assert row["params_lr"] == 0.05 and len(epochs) == EPOCHS and row["value"] == epochs[-1]["val_loss"]
    states = [t.state.name for t in study.trials]
    assert sorted(states) == ["COMPLETE"] * 3 + ["PRUNED"] * 3
    assert result.best_value == min(trials["value"][trials["state"] == "complete"])
    assert set(result.best_params) == {"lr", "width"}
    # the leaderboard, live and final, says what SweepResult.trials holds
    printed = _leaderboard_rows(capsys.readouterr().out)
    shown = _leaderboard_rows(result.leaderboard())
    assert set(printed) == set(shown) == set(trials["trial"])
    for _, row in trials.iterrows():
        for text in (printed[row["trial"]], shown[row["trial"]]):
            assert f"  {row['state']}  " in text and f"val_loss {fmt(row['value'])}" in text
            assert f"lr={fmt(row['params_lr'])} width={row['params_width']}" in text
    best = result.best_model
    assert isinstance(best, nn.Sequential) and best[0].out_features == result.best_params["width"]


def test_a_trial_that_raises_is_failed_and_the_others_complete(workers):
    model = make_net(4)
    before = [p.detach().clone() for p in model.parameters()]
    factory_result = nbddp.sweep(make_net, tensors(), val_data=tensors(32, 1), space={"explode": [False, True], "width": [4, 8]},
                                 n_trials=4, sampler=grid(explode=[False, True], width=[4, 8]), epochs=1, batch_size=16,
                                 live=False)
    rows = factory_result.trials
    failed = rows[rows["state"] == "failed"]
    assert list(rows["state"].value_counts().sort_index().items()) == [("complete", 2), ("failed", 2)]
    assert all(failed["params_explode"]) and not any(rows[rows["state"] == "complete"]["params_explode"])
    for _, row in failed.iterrows():
        assert row["rank"] in (0, 1) and "ValueError: boom: this trial's model cannot run" in row["error"]
        assert "Traceback" in row["error"] or "forward" in row["error"]
    # a model object: the best weights land in it; the session's own group trains on afterwards
    result = nbddp.sweep(model, tensors(), val_data=tensors(32, 1), space={"lr": [0.01, 0.1]}, n_trials=2,
                         sampler=grid(lr=[0.01, 0.1]), epochs=1, batch_size=16, live=False)
    assert result.best_model is model
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert nbddp.dist_fit(make_net, tensors(), epochs=1, batch_size=16, live=False).status == "completed"


def test_the_best_model_equals_a_dist_fit_alone_with_the_best_parameters(workers):
    """Two workers per trial: each trial is DDP on a group of both ranks, so dist_fit on the same two compares."""
    data, val = tensors(), tensors(32, 1)
    result = nbddp.sweep(make_net, data, val_data=val, space={"lr": [0.01, 0.3], "width": [6]}, n_trials=2,
                         sampler=grid(lr=[0.01, 0.3], width=[6]), workers_per_trial=2, epochs=2, batch_size=8,
                         seed=3, live=False)
    assert set(result.trials["group"]) == {0} and len(result.trials) == 2
    best = result.best_params
    history = nbddp.dist_fit(lambda: make_net(best["width"]), data, val_data=val, lr=best["lr"], epochs=2,
                             batch_size=8, seed=3, live=False)
    for (name, mine), theirs in zip(result.best_model.state_dict().items(), history.model.state_dict().values()):
        assert torch.equal(mine, theirs), name
    assert result.best_value == history.epochs[-1]["val_loss"]


@pytest.mark.parametrize("strategy", ["fsdp", nbddp.FSDP(reshard_after_forward=False), nbddp.TensorParallel(),
                                      nbddp.Pipeline(stages=2, microbatches=2)])
def test_a_trial_trains_sharded_over_its_group_and_equals_a_dist_fit_alone(workers, strategy):
    """FSDP, tensor parallel or a pipeline in a trial's group of two (its mesh made of the group's ranks): the best
    weights gathered whole equal those of the same fit run alone."""
    data = tensors()
    result = nbddp.sweep(make_net, data, space={"lr": [0.05]}, sampler=grid(lr=[0.05]), metric="loss", n_trials=1,
                         workers_per_trial=2, strategy=strategy, epochs=1, batch_size=8, seed=2, live=False)
    assert list(result.trials["state"]) == ["complete"]
    history = nbddp.dist_fit(make_net, data, lr=0.05, strategy=strategy, epochs=1, batch_size=8, seed=2, live=False)
    for (name, mine), theirs in zip(result.best_model.state_dict().items(), history.model.state_dict().values()):
        assert torch.equal(mine, theirs), name
    if not isinstance(strategy, (str, nbddp.FSDP)):  # the trial did lay the model out: DDP's weights differ
        ddp = nbddp.dist_fit(make_net, data, lr=0.05, epochs=1, batch_size=8, seed=2, live=False).model
        assert any(not torch.equal(a, b) for a, b in zip(result.best_model.state_dict().values(),
                                                          ddp.state_dict().values()))


def test_an_interrupted_sweep_returns_what_it_has(workers):
    from interrupts import interrupt_when

    from nbddp.session.session import get_session

    def one_done() -> bool:
        rows = getattr(get_session().running, "rows", [])
        return any(r.state == "complete" for r in rows)

    with interrupt_when(one_done):
        result = nbddp.sweep(make_net, tensors(), val_data=tensors(32, 1), space={"lr": (1e-3, 1e-1, "log")},
                             n_trials=40, epochs=3, batch_size=16, live=False)
    assert result.status == "interrupted"
    assert 1 <= len(result.trials) < 40 and "complete" in set(result.trials["state"])
    assert set(result.trials["state"]) <= {"complete", "stopped"}
    assert result.best_value is not None and not workers.busy


class DiesOnce(nn.Module):
    """The first ``times`` runs die (SIGKILL) in their first forward; every later run trains normally."""

    def __init__(self, flag: str, times: int = 1):
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.flag, self.times = flag, times

    def forward(self, x):
        import os
        import signal

        for i in range(self.times):
            try:
                os.close(os.open(f"{self.flag}.{i}", os.O_CREAT | os.O_EXCL))  # one winner, even if both ranks start
            except FileExistsError:
                continue
            os.kill(os.getpid(), signal.SIGKILL)
        return self.lin(x)


@pytest.mark.faults
def test_a_killed_workers_trial_is_retried_and_the_sweep_goes_on(workers, tmp_path):
    flag = str(tmp_path / "died")
    generation = workers.generation
    result = nbddp.sweep(lambda: DiesOnce(flag), tensors(), val_data=tensors(32, 1), space={"lr": [0.01, 0.1]},
                         n_trials=2, sampler=grid(lr=[0.01, 0.1]), epochs=1, batch_size=16, live=False)
    rows = result.trials
    died = rows[rows["state"] == "failed"]
    assert len(died) == 1 and len(rows) == 3, rows
    assert "WorkerDied" in died.iloc[0]["error"] and "run again as a new trial, retry 1 of max_restarts=1" in died.iloc[0]["error"]
    done = rows[rows["state"] == "complete"]
    assert sorted(done["params_lr"]) == [0.01, 0.1] and died.iloc[0]["params_lr"] in list(done["params_lr"])
    assert workers.generation > generation  # the dead worker was replaced, and the next call runs as usual
    assert nbddp.dist_fit(make_net, tensors(), epochs=1, batch_size=16, live=False).status == "completed"


@pytest.mark.faults
def test_a_dead_workers_trial_is_retried_up_to_max_restarts_and_then_says_so(workers, tmp_path):
    """max_restarts=1 and a model whose first two runs die: one retry, then a row that says the limit is spent."""
    flag = str(tmp_path / "died")
    result = nbddp.sweep(lambda: DiesOnce(flag, times=2), tensors(), space={"lr": [0.01]}, metric="loss", n_trials=1,
                         sampler=grid(lr=[0.01]), epochs=1, batch_size=16, live=False, max_restarts=1)
    rows = result.trials
    assert list(rows["state"]) == ["failed", "failed"] and list(rows["params_lr"]) == [0.01, 0.01], rows
    assert "retry 1 of max_restarts=1" in rows.iloc[0]["error"]
    last = rows.iloc[1]["error"]
    assert last.startswith("WorkerDied") and "max_restarts=1 is spent: this trial's parameters ran 2 time(s)" in last
    assert "nbddp.sweep(..., max_restarts=2) or more" in last
    assert [t.user_attrs for t in result.study.trials] == [{}, {"nbddp_retry_of": 0, "nbddp_attempt": 1}]
    workers.wait_healed()
    assert nbddp.dist_fit(make_net, tensors(), epochs=1, batch_size=16, live=False).status == "completed"


class DiesMidway(nn.Module):
    """Its first run dies (SIGKILL) in its 7th training forward, after the snapshot of step 6 (snapshot_every=2);
    every later run, the resumed one included, trains normally. The 0.5 s before the kill lets the records
    published with that snapshot reach the kernel, as they would from a worker that dies at any later moment."""

    def __init__(self, flag: str):
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.flag, self.calls = flag, 0

    def forward(self, x):
        import os
        import signal
        import time

        self.calls += self.training
        if self.calls == 7:
            try:
                os.close(os.open(self.flag, os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                return self.lin(x)
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)
        return self.lin(x)


@pytest.mark.faults
@pytest.mark.parametrize("per_trial", [1, 2])
def test_with_snapshot_every_a_dead_workers_trial_resumes_from_its_snapshot_and_equals_an_unbroken_one(workers,
                                                                                                     tmp_path,
                                                                                                     per_trial):
    """The issue's "with max_restarts ... the trial resumes instead": the same trial goes on from step 6 on the
    healed worker (not a new trial from step 0), and ends with the weights and records of a trial never broken.
    In a group of two the dead rank's peer, stuck in the group's gradient reduction, is killed too, and the group
    resumes whole."""
    flag = str(tmp_path / "died")
    generation = workers.generation

    def sweep():
        # each rank trains 4 steps an epoch in either group size (its 7th forward is after the step-6 snapshot)
        return nbddp.sweep(lambda: DiesMidway(flag), tensors(64 * per_trial), val_data=tensors(32, 1), space={"lr": [0.05]},
                           n_trials=1, sampler=grid(lr=[0.05]), epochs=3, batch_size=16, seed=3, live=False,
                           max_restarts=1, snapshot_every=2, workers_per_trial=per_trial)

    broken = sweep()
    assert workers.generation > generation  # the dead worker was replaced
    unbroken = sweep()  # the flag is there now: nothing dies
    for result in (broken, unbroken):
        assert list(result.trials["state"]) == ["complete"] and result.status == "completed", result.trials
        assert [t.state.name for t in result.study.trials] == ["COMPLETE"]  # the same trial, not a retry
    (restart,) = broken.histories[0].restarts
    assert restart["step_resumed_from"] == 6 and restart["step_lost_at"] >= 6, restart
    assert restart["cause"].startswith("WorkerDied") and restart["rank"] in (0, 1)
    assert unbroken.histories[0].restarts == []
    epochs = [[(e["epoch"], e["loss"], e["val_loss"]) for e in r.histories[0].epochs] for r in (broken, unbroken)]
    assert epochs[0] == epochs[1] and len(epochs[0]) == 3
    assert broken.best_value == unbroken.best_value
    for (name, mine), theirs in zip(broken.best_model.state_dict().items(), unbroken.best_model.state_dict().values()):
        assert torch.equal(mine, theirs), name
    assert nbddp.dist_fit(make_net, tensors(), epochs=1, batch_size=16, live=False).status == "completed"


@pytest.mark.parametrize("kwargs, match", [
    ({"max_restarts": -1}, r"max_restarts=-1\) must be an int >= 0: how many times a trial whose worker died"),
    ({"max_restarts": True}, r"max_restarts=True\) must be an int >= 0"),
    ({"retry_on": [ValueError]}, r"retry_on=...\) is not supported: a trial that raises is recorded as failed"),
    ({"min_workers": 1}, r"min_workers=...\) is not supported: a trial keeps the workers_per_trial workers"),
    ({"max_restarts": 0, "snapshot_every": 10}, r"snapshot_every=10\) takes effect only when a trial whose worker "
                                                r"died goes on; pass max_restarts=N"),
    ({"snapshot_every": "sometimes"}, r"^nbddp.sweep\(snapshot_every='sometimes'\) must be an int of optimizer steps"),
    ({"snapshot_every": 0}, r"^nbddp.sweep\(snapshot_every=0\): a snapshot interval must be above 0"),
])
def test_a_sweeps_restart_options_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        spaces.pop_restarts(dict(kwargs))


def test_max_restarts_defaults_to_one_retry_and_snapshot_every_takes_dist_fits_forms():
    options = {"max_restarts": 3, "lr": 0.1}
    assert spaces.pop_restarts(options) == (3, None) and options == {"lr": 0.1}
    assert spaces.pop_restarts({}) == (1, None)
    assert spaces.pop_restarts({"snapshot_every": 4}) == (1, 4)
    assert spaces.pop_restarts({"snapshot_every": "2min"}) == (1, 120.0)


class FailsOnRank1(nn.Module):
    """``fail=True``: rank 1 raises in its first forward, while rank 0 goes on into DDP's gradient reduction."""

    def __init__(self, fail: bool):
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.fail = fail

    def forward(self, x):
        import torch.distributed as dist

        if self.fail and dist.get_rank() == 1:
            raise ValueError("rank 1 fails in forward")
        return self.lin(x)


@pytest.mark.faults
def test_in_a_group_of_two_a_failing_rank_fails_its_trial_and_the_stuck_peer_is_replaced(workers):
    """Rank 0 waits in the group's collective for a peer that raised: it is killed after a grace, not retried."""
    generation = workers.generation
    result = nbddp.sweep(lambda fail=False: FailsOnRank1(fail), tensors(), space={"fail": [True, False]},
                         metric="loss", n_trials=2, sampler=grid(fail=[True, False]), workers_per_trial=2, epochs=1,
                         batch_size=8, live=False)
    rows = result.trials
    assert len(rows) == 2, rows
    failed = rows[rows["params_fail"]].iloc[0]
    assert failed["state"] == "failed" and failed["rank"] == 1
    assert failed["error"].startswith("ValueError: rank 1 fails in forward")
    assert rows[~rows["params_fail"]].iloc[0]["state"] == "complete"
    workers.wait_healed()
    assert workers.generation > generation
    assert nbddp.dist_fit(make_net, tensors(), epochs=1, batch_size=16, live=False).status == "completed"


class Hangs(nn.Module):
    """``hang=True``: the first forward never returns (a rank stuck in the person's code)."""

    def __init__(self, hang: bool):
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.hang = hang

    def forward(self, x):
        import time

        while self.hang:  # the stalled work itself, ended by the kill
            time.sleep(0.2)
        return self.lin(x)


@pytest.mark.faults
def test_a_trial_that_stalls_is_killed_after_stall_timeout_and_the_sweep_goes_on(workers):
    result = nbddp.sweep(lambda hang=False: Hangs(hang), tensors(), space={"hang": [False, True]}, metric="loss",
                         n_trials=2, sampler=grid(hang=[False, True]), epochs=1, batch_size=16, stall_timeout=3,
                         live=False)
    rows = result.trials
    assert len(rows) == 2, rows  # a stall is not retried: the same values would stall again
    stalled = rows[rows["params_hang"]].iloc[0]
    assert stalled["state"] == "failed" and "WorkerStalled: rank" in stalled["error"]
    assert "stall_timeout=3" in stalled["error"] and "forward" in stalled["error"]
    assert rows[~rows["params_hang"]].iloc[0]["state"] == "complete"
    assert nbddp.dist_fit(make_net, tensors(), epochs=1, batch_size=16, live=False).status == "completed"


def test_without_optuna_the_error_says_what_to_install(monkeypatch):
    import sys

    from nbddp.sweeps.call import optuna_module

    monkeypatch.setitem(sys.modules, "optuna", None)
    with pytest.raises(ImportError, match=r'pip install "nbddp\[sweep\]"'):
        optuna_module()


class BrokenPruner(optuna.pruners.BasePruner):
    def prune(self, study, trial):
        raise ValueError("a pruner bug")


class BrokenSampler(optuna.samplers.RandomSampler):
    def after_trial(self, study, trial, state, values):
        raise RuntimeError("a sampler bug")


@pytest.mark.parametrize("kwargs, error, match", [({"pruner": BrokenPruner()}, ValueError, "a pruner bug"),
                                                  ({"sampler": BrokenSampler()}, RuntimeError, "a sampler bug")])
def test_an_error_in_the_kernels_optuna_code_ends_the_sweep_and_frees_the_workers(workers, kwargs, error, match):
    """The pruner runs only on a validation seen while its trial runs: paced steps and a short publish interval make
    the trial outlast its first validation's trip to the kernel (a 4-step trial could end unseen, under load)."""
    with pytest.raises(error, match=match):
        nbddp.sweep(make_net, tensors(), val_data=tensors(32, 1), space={"lr": [0.01]}, n_trials=2, epochs=EPOCHS,
                    batch_size=16, live=False, step_fn=paced_step, publish_interval_s=0.02, **kwargs)
    assert not workers.busy and nbddp.run(held_groups) == [[], []]  # the trial groups were closed on every rank


def held_groups() -> list[str]:
    """On a worker: the sweeps whose trial groups it holds."""
    from nbddp.worker.tasks import sweep

    return list(sweep.GROUPS)


def test_a_trial_sent_for_groups_the_worker_does_not_hold_is_refused(workers):
    from nbddp.worker.tasks.sweep import trial_task

    engine = workers.placements[0].engine_id
    with pytest.raises(Exception, match=r"holds no process group 0 of sweep sweep-gone: the workers were replaced"):
        workers.client[engine].apply_async(trial_task, "sweep-gone", 0, None, None, None, None, {}).get(60)


def test_a_study_that_has_its_trials_already_runs_none(workers):
    d = optuna.distributions.CategoricalDistribution([4, 8])
    study = optuna.create_study()
    for width, value in ((4, 0.5), (8, 0.25)):
        study.add_trial(optuna.trial.create_trial(params={"width": width}, distributions={"width": d}, value=value))
    result = nbddp.sweep(make_net, tensors(), space={"width": [4, 8]}, metric="loss", n_trials=2, study=study,
                         live=False)
    assert result.trials.empty and result.best_params == {"width": 8} and result.best_value == 0.25
    assert result.best_model is None and not workers.busy
    handle = nbddp.sweep(make_net, tensors(), space={"width": [4, 8]}, metric="loss", n_trials=2, study=study,
                         live=False, block=False)  # block=False is a handle whatever there is to run
    assert handle.wait().best_value == 0.25 and handle.done() and handle.trials.empty
    assert repr(handle) == "<SweepHandle done: the study had its trials already>" and handle.stop() is not None


def test_a_sweep_that_does_not_block_is_stopped_by_its_handle(workers):
    """block=False: the cell returns a handle at once; stop() (the Stop button's call) returns what finished."""
    import time

    handle = nbddp.sweep(make_net, tensors(), val_data=tensors(32, 1), space={"lr": (1e-3, 1e-1, "log")},
                         n_trials=40, epochs=2, batch_size=16, live=False, block=False)
    assert workers.busy and "SweepHandle running" in repr(handle)
    deadline = time.monotonic() + 120
    while "complete" not in set(handle.trials.get("state", [])) and time.monotonic() < deadline:
        time.sleep(0.05)  # the poll of a wait for the first completed trial
    result = handle.stop()
    assert handle.done() and result.status == "interrupted" and "SweepHandle done" in repr(handle)
    assert 1 <= len(result.trials) < 40 and "complete" in set(result.trials["state"])
    assert set(result.trials["state"]) <= {"complete", "stopped"} and result.best_value is not None
    assert not workers.busy and nbddp.run(held_groups) == [[], []]
    with pytest.raises(TypeError, match=r"nbddp.sweep\(block=...\) must be True or False, got 'no'"):
        nbddp.sweep(make_net, tensors(), space={"lr": [0.1]}, n_trials=1, block="no")
