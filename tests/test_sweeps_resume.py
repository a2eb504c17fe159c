"""A sweep's study kept in SQLite: the trials done are skipped, and trials a dead process left RUNNING are failed
through Optuna's heartbeat and run again (``nbddp/sweeps/stale.py``)."""

from __future__ import annotations

import sqlite3

import pytest
import torch
import torch.nn as nn

import nbddp
from nbddp.sweeps import stale

optuna = pytest.importorskip("optuna")
pytestmark = pytest.mark.timeout(400)

WIDTH = optuna.distributions.CategoricalDistribution([4, 8, 16])


def make_net(width: int = 8) -> nn.Module:
    return nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 2))


def tensors(n: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return x, (x.sum(1) > 0).long()


def heartbeat_storage(path, **kwargs):
    return optuna.storages.RDBStorage(f"sqlite:///{path}", heartbeat_interval=1, grace_period=1, **kwargs)


def age_heartbeats(path) -> None:
    """An hour passes for every heartbeat in the file: what a process that died an hour ago leaves."""
    with sqlite3.connect(path) as db:
        db.execute("UPDATE trial_heartbeats SET heartbeat = datetime(heartbeat, '-1 hour')")


# ---- units on a study file (no worker involved) ----------------------------------------------------
def test_a_trial_whose_heartbeat_stopped_is_failed_and_queued_again(tmp_path):
    path = tmp_path / "hb.db"
    retry = optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=1)
    study = optuna.create_study(storage=heartbeat_storage(path, heartbeat_stale_trial_callback=retry))
    beats = stale.Heartbeats(study)
    dead, alive = study.ask({"width": WIDTH}), study.ask({"width": WIDTH})
    beats.start(dead)
    beats.start(alive)
    age_heartbeats(path)
    beats.beat([alive])  # the live trial's heartbeat is recorded again, and the dead one is failed
    states = {t.number: t.state.name for t in study.trials}
    assert states == {dead.number: "FAIL", alive.number: "RUNNING", 2: "WAITING"}
    assert study.trials[2].params == dead.params  # Optuna's callback queued the dead trial's parameters
    assert stale.fail_stale(study) == []  # nothing more is stale


def test_a_trial_started_without_a_heartbeat_is_never_taken_for_stale(tmp_path):
    """Optuna only fails trials that had a heartbeat: ``Heartbeats.start`` is what makes a sweep's trials count."""
    path = tmp_path / "hb.db"
    study = optuna.create_study(storage=heartbeat_storage(path))
    study.ask({"width": WIDTH})
    age_heartbeats(path)
    assert stale.fail_stale(study) == [] and study.trials[0].state.name == "RUNNING"


def test_running_trials_in_a_storage_without_heartbeat_are_named_with_the_fix(tmp_path):
    study = optuna.create_study(study_name="plain", storage=f"sqlite:///{tmp_path / 'plain.db'}")
    assert stale.interval(study) is None and stale.stale_warning(study) is None
    study.ask({"width": WIDTH})
    message = stale.stale_warning(study)
    assert "study 'plain' holds 1 trial(s) still RUNNING ([0])" in message
    assert "heartbeat_interval=60, grace_period=120" in message and "RetryHeartbeatStaleTrialCallback" in message
    memory = optuna.create_study()
    memory.ask({"width": WIDTH})
    assert stale.stale_warning(memory) is None  # a study in memory dies with its process: nothing to warn about


def test_a_sweep_warns_about_running_trials_it_cannot_judge(workers, tmp_path):
    study = optuna.create_study(study_name="plain", storage=f"sqlite:///{tmp_path / 'plain.db'}")
    study.ask({"width": WIDTH})
    with pytest.warns(nbddp.NbddpWarning, match=r"holds 1 trial\(s\) still RUNNING \(\[0\]\).*heartbeat_interval"):
        result = nbddp.sweep(make_net, tensors(), space={"width": [4, 8, 16]}, metric="loss", n_trials=1,
                             study=study, epochs=1, batch_size=16, live=False)
    assert list(result.trials["state"]) == ["complete"]


# ---- end to end: a killed process, then a new one --------------------------------------------------
SCRIPT = """
import json, os, signal, sys, threading, time
import optuna, torch, torch.nn as nn
import nbddp
from nbddp.session.session import get_session
optuna.logging.set_verbosity(optuna.logging.WARNING)
def make_net(width=8):
    return nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 2))
def slow_step(model, batch):
    time.sleep(0.05)
    return nn.functional.cross_entropy(model(batch[0]), batch[1])
mode, url = sys.argv[1], sys.argv[2]
storage = optuna.storages.RDBStorage(url, heartbeat_interval=1, grace_period=1,
    heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=1))
study = optuna.load_study(study_name="resumed", storage=storage)
g = torch.Generator().manual_seed(0)
x = torch.randn(64, 4, generator=g)
def die_once_running():
    while True:  # this kernel dies (kill -9) while its trial runs, as a crashed or restarted kernel does
        rows = getattr(get_session().running, "rows", [])
        if any(r.state == "running" and r.epoch is not None for r in rows):
            print("DYING", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.05)
nbddp.start(n=2, backend="gloo")
try:
    grid = optuna.samplers.GridSampler({"width": [4, 8, 16]}, seed=0)
    if mode == "die":
        threading.Thread(target=die_once_running, daemon=True).start()
    result = nbddp.sweep(make_net, (x, (x.sum(1) > 0).long()), space={"width": [4, 8, 16]}, metric="loss",
                         sampler=grid, n_trials=3, study=study, epochs=40 if mode == "die" else 1, batch_size=16,
                         live=False, workers_per_trial=2, step_fn=slow_step if mode == "die" else None)
    print("ROWS", json.dumps([int(t) for t in result.trials["trial"]]))
finally:
    nbddp.stop()
"""


@pytest.mark.slow
@pytest.mark.fresh_workers
def test_a_study_in_sqlite_resumes_in_a_new_process_and_skips_the_trials_done(workers, tmp_path):
    """Two trials done here; a second process (its own 2 workers, as a kernel has) is killed -9 while the third runs,
    leaving it RUNNING; a third process resumes: the dead trial is failed by Optuna's heartbeat, its parameters run
    again, and the two done are skipped.

    It cannot be faster: each new process imports torch and starts two engines of its own (7 s on a quiet
    machine, over a minute on a loaded one), which is what a kernel restart means; the trials are tiny.
    """
    import subprocess
    import sys
    import time

    path = tmp_path / "sweep.db"
    url = f"sqlite:///{path}"
    study = optuna.create_study(study_name="resumed", storage=heartbeat_storage(path),
                                sampler=optuna.samplers.GridSampler({"width": [4, 8, 16]}, seed=0))
    first = nbddp.sweep(make_net, tensors(), space={"width": [4, 8, 16]}, metric="loss", n_trials=2, study=study,
                        epochs=1, batch_size=16, live=False)
    assert list(first.trials["trial"]) == [0, 1]
    script = tmp_path / "resume.py"
    script.write_text(SCRIPT)
    died = subprocess.run([sys.executable, str(script), "die", url], capture_output=True, text=True, timeout=240,
                          cwd=str(tmp_path))
    assert died.returncode == -9 and "DYING" in died.stdout, died.stderr[-3000:]
    left = optuna.load_study(study_name="resumed", storage=url)
    assert [t.state.name for t in left.trials] == ["COMPLETE", "COMPLETE", "RUNNING"]  # what a dead kernel leaves
    time.sleep(2.5)  # the storage's grace period (1 s, counted in whole seconds by SQLite) passes: the condition tested
    out = subprocess.run([sys.executable, str(script), "resume", url], capture_output=True, text=True, timeout=240,
                         cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "trial(s) [2] of study 'resumed' were left RUNNING" in out.stderr  # the "nbddp" logger
    assert "ROWS [3]" in out.stdout  # only the dead trial's parameters ran again: the two done were skipped
    again = optuna.load_study(study_name="resumed", storage=url)
    assert [t.state.name for t in again.trials] == ["COMPLETE", "COMPLETE", "FAIL", "COMPLETE"]
    assert again.trials[3].params == again.trials[2].params  # the dead trial's parameters, run again
    assert sorted(t.params["width"] for t in again.trials if t.state.name == "COMPLETE") == [4, 8, 16]
