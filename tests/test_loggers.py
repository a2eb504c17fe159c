"""Issue 25: loggers write every record once, from the kernel, into real backends read back with their own readers.

TensorBoard is read with tensorboard's ``EventAccumulator``, W&B (offline)
from its run directory's transaction log, MLflow from a local store with
``MlflowClient.get_metric_history``, CSV with pandas. Each checks that
the logged loss series is ``History.steps``' one.
"""

from __future__ import annotations

import glob
import json
import os
import struct
import sys

import pytest
import torch
import torch.nn as nn

import nbddp
from nbddp.loggers.fit_info import FitInfo
from nbddp.loggers import CSV, Logger, MLflow, TensorBoard, WandB

SENTINEL = "nbddp-sentinel-7c1e"  # a W&B project name and tag: must never reach a worker


def _data(n: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return x, x @ torch.linspace(-1, 1, 6).unsqueeze(1) + 0.05 * torch.randn(n, 1, generator=g)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(6, 1)


def _mae(output, target):
    return (output - target).abs().mean()


@pytest.fixture
def offline_wandb(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    yield
    if "wandb" in sys.modules:
        sys.modules["wandb"].teardown()  # its service process goes with the last run, not with pytest


def _series(history_steps) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in history_steps]


# ---- readers ---------------------------------------------------------------------


def _tensorboard(run_dir: str):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    ea = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    ea.Reload()
    loss = [(e.step, e.value) for e in ea.Scalars("train/loss")]
    content = ea.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    return ea, loss, hparams


def _wandb_records(path: str):
    """The records of a W&B ``.wandb`` file: its 7-byte header, then LevelDB-log blocks of protobuf records."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        room = 32768 - pos % 32768
        if room < 7:
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        chunk, pos = data[pos:pos + length], pos + length
        if kind in (1, 2):  # full, first
            pending = chunk
        elif kind in (3, 4):  # middle, last
            pending += chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            yield record


def _wandb_run(run_dir: str):
    """(run id, config, [(step, train/loss)]) of one offline run directory."""
    (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    run_id, config, loss = None, {}, []
    for record in _wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
            config.update({i.key: json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            if "train/loss" in items:
                loss.append((record.history.step.num, items["train/loss"]))
    return run_id, config, loss


# ---- the real thing ------------------------------------------------------------------


@pytest.mark.heavy
def test_four_backends_hold_every_record_and_a_resumed_fit_continues_the_same_runs(workers, tmp_path, monkeypatch,
                                                                                    offline_wandb):
    """Heavy: TensorBoard, MLflow, W&B (offline) and CSV imported and written, then a resumed fit writes the same runs."""
    import pandas as pd
    from mlflow.tracking import MlflowClient

    from nbddp.fit import fit_run as fitting

    shipped: list[bytes] = []
    launch = fitting.FitRun.launch

    def spy(run):
        import pickle

        shipped.extend([p.data for p in run.plan.parcels.values()] + [pickle.dumps((run.plan.cfg, run.plan.launch))])
        return launch(run)

    monkeypatch.setattr(fitting.FitRun, "launch", spy)
    # MLflow's file store: the same MlflowClient calls as its default SQLite store, whose first creation runs
    # MLflow's schema migrations (2 s on a quiet 2-core machine, 17-21 s on a busy one)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    store = f"file://{tmp_path}/mlruns"

    def loggers():
        return [TensorBoard(tmp_path / "tb"), WandB(project=SENTINEL, dir=tmp_path, tags=[SENTINEL]),
                MLflow(tracking_uri=store, experiment="issue25"), CSV(tmp_path / "metrics.csv")]

    model = _model()
    common = dict(batch_size=8, val_data=_data(32, 1), metrics={"mae": _mae}, log_every=2, live=False,
                  checkpoint_dir=str(tmp_path / "ckpt"), optimizer=torch.optim.SGD, lr=0.05)
    h1 = nbddp.dist_fit(model, _data(), epochs=1, loggers=loggers(), **common)
    h2 = nbddp.dist_fit(model, _data(), epochs=2, resume=True, loggers=loggers(), **common)
    assert h2.steps[0]["step"] > h1.steps[-1]["step"]  # it did resume
    expected = _series(h1.steps + h2.steps)
    val_expected = [(r["step"], r["val_loss"]) for r in h1.validations + h2.validations]

    # TensorBoard: one directory, both fits' events, the hyperparameters in its HParams plugin data
    (run_dir,) = glob.glob(str(tmp_path / "tb" / "*"))
    ea, loss, hparams = _tensorboard(run_dir)
    assert [s for s, _ in loss] == [s for s, _ in expected]
    assert [v for _, v in loss] == pytest.approx([v for _, v in expected], rel=1e-6)  # events hold float32
    val = ea.Scalars("val/loss")
    assert [e.step for e in val] == [s for s, _ in val_expected]
    assert [e.value for e in val] == pytest.approx([v for _, v in val_expected], rel=1e-6)
    assert hparams["params"].number_value == 7 and hparams["world_size"].number_value == 2
    assert hparams["strategy"].string_value == "ddp" and hparams["precision"].string_value == "32-true"
    assert hparams["model_class"].string_value == "torch.nn.modules.linear.Linear"

    # W&B, offline: two run directories with one run id (the second resumed it); every step exactly
    runs = sorted(glob.glob(str(tmp_path / "wandb" / "offline-run-*")))
    assert len(runs) == 2
    (id1, config, loss1), (id2, _, loss2) = (_wandb_run(r) for r in runs)
    assert id1 == id2
    assert loss1 + loss2 == expected
    assert config["params"] == 7 and config["world_size"] == 2 and config["optimizer"] == "SGD"

    # MLflow: one run in the experiment, the whole series by its client
    client = MlflowClient(tracking_uri=store)
    (run,) = client.search_runs([client.get_experiment_by_name("issue25").experiment_id])
    history = sorted(client.get_metric_history(run.info.run_id, "train/loss"), key=lambda m: m.step)
    assert [(m.step, m.value) for m in history] == expected
    assert run.data.params["params"] == "7" and run.data.params["strategy"] == "ddp"
    assert run.data.params["epochs"] == "1" and run.data.tags["nbddp.resumed.epochs"] == "2"
    assert run.info.status == "FINISHED"

    # CSV: one run name across both fits
    df = pd.read_csv(tmp_path / "metrics.csv", float_precision="round_trip")
    assert df.run.nunique() == 1
    steps = df[df.kind == "step"]
    assert list(zip(steps.step, steps.loss)) == expected
    assert list(df[df.kind == "val"].val_mae) == [r["val_mae"] for r in h1.validations + h2.validations]

    assert [row["missed"] for row in h1.loggers + h2.loggers] == [0] * 8
    assert SENTINEL in repr(loggers()[1].__dict__) and not any(SENTINEL.encode() in b for b in shipped)
    on_workers = nbddp.run(lambda: sorted({m.split(".")[0] for m in sys.modules} & {"wandb", "mlflow", "tensorboard"}))
    assert on_workers == [[], []]  # no logger package was ever imported on a worker


class Flaky(Logger):
    """Fails on its third record, like a full disk."""

    def __init__(self):
        self.calls = 0
        self.closed_with = None

    def log_metrics(self, metrics, step):
        self.calls += 1
        if self.calls == 3:
            raise OSError("disk full (test)")

    def finish(self, status):
        self.closed_with = status


class Unfinished(Logger):
    """Implements nothing: the base class's log_metrics raises NotImplementedError at the first record."""


def test_a_logger_that_raises_never_stops_the_fit_and_the_summary_counts_what_it_missed(workers, tmp_path, caplog):
    flaky = Flaky()
    with pytest.warns(nbddp.NbddpWarning) as warned:
        h = nbddp.dist_fit(_model(), _data(), epochs=2, batch_size=8, log_every=1, live=False, val_data=_data(16, 2),
                           loggers=[flaky, Unfinished(), CSV(tmp_path / "m.csv")])
    assert h.status == "completed" and h.steps[-1]["step"] == 8
    total = len(h.steps) + len(h.epochs) + len(h.validations)
    rows = {row["logger"]: row for row in h.loggers}
    assert (rows["Flaky"]["logged"], rows["Flaky"]["missed"]) == (2, total - 2)
    assert (rows["Unfinished"]["logged"], rows["Unfinished"]["missed"]) == (0, total)
    assert (rows["CSV"]["logged"], rows["CSV"]["missed"]) == (total, 0)
    assert flaky.calls == 3 and flaky.closed_with == "completed"  # no record after the error; the run still closed
    said = "\n".join(str(w.message) for w in warned)  # one line each, filterable by category
    logged = "\n".join(r.getMessage() for r in caplog.records if r.name == "nbddp")  # with the tracebacks
    assert said.count("nbddp: logger Flaky failed in log at step") == 1 and "Traceback" in logged
    assert f"nbddp: logger Flaky missed {total - 2} of {total} records" in said
    assert "Unfinished must implement log_metrics" in logged
    assert [e["source"] for e in h.errors] == ["logger Flaky", "logger Unfinished"]


def _info(start_step: int = 0) -> FitInfo:
    return FitInfo(run_name="unit", world_size=2, backend="gloo", strategy="ddp", precision="32-true", batch_size=4,
                   epochs=1, total_steps=8, steps_per_epoch=8, start_step=start_step, resumed=start_step > 0,
                   model_class="m.Net", params=3, hparams={"lr": 0.1, "note": None, "params": 3})


def _write(logger: Logger, steps: range, start_step: int, resume) -> dict:
    logger.check()
    state = logger.start(_info(start_step), resume)
    for s in steps:
        logger.log("step", {"step": s, "epoch": 0, "loss": float(s + (100 if resume else 0)), "lr": 0.1})
    logger.flush()
    logger.finish("completed")
    return state


def test_loggers_get_every_record_when_the_published_plan_never_arrived(workers, tmp_path, monkeypatch):
    """Rank 0's published plan can land after its result (a short fit on a busy machine): the result carries it."""
    from nbddp.fit import fit_run as fitting

    real = fitting.published
    monkeypatch.setattr(fitting, "published", lambda ar, kind: None if kind == "plan" else real(ar, kind))
    h = nbddp.dist_fit(_model(), _data(), epochs=1, batch_size=8, log_every=1, live=False,
                       loggers=[CSV(tmp_path / "m.csv")])
    rows = {row["logger"]: row for row in h.loggers}
    assert rows["CSV"]["logged"] == len(h.steps) + len(h.epochs) and rows["CSV"]["missed"] == 0, h.loggers


def test_resuming_from_an_earlier_checkpoint_drops_what_the_first_fit_wrote_after_it(tmp_path):
    """TensorBoard (purge_step) and CSV rewrite the steps after the checkpoint; the run reads as one series."""
    import pandas as pd

    state = _write(TensorBoard(tmp_path / "tb"), range(1, 7), 0, None)
    _write(TensorBoard(tmp_path / "tb"), range(5, 9), 4, state)
    _, loss, _ = _tensorboard(state["dir"])
    assert loss == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 105.0), (6, 106.0), (7, 107.0), (8, 108.0)]
    csv_path = tmp_path / "m.csv"
    _write(CSV(csv_path, name="other"), range(1, 3), 0, None)  # another run in the same file stays
    state = _write(CSV(csv_path), range(1, 7), 0, None)
    _write(CSV(csv_path), range(5, 9), 4, state)
    df = pd.read_csv(csv_path)
    mine = df[df.run == "unit"]
    assert list(zip(mine.step, mine.loss)) == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 105.0), (6, 106.0),
                                               (7, 107.0), (8, 108.0)]
    assert list(df[df.run == "other"].step) == [1, 2]
    again = _write(CSV(csv_path), range(1, 2), 0, None)  # a new fit with the same run name gets its own
    assert again["run"] == "unit-2"


# ---- bad input: all before any worker starts ----------------------------------------------


def _fit(**kw):
    return nbddp.dist_fit(_model(), _data(), live=False, **kw)


def test_bad_loggers_fail_before_any_worker_starts(tmp_path, monkeypatch):
    from nbddp.session.session import get_session

    started = get_session().started
    with pytest.raises(ValueError, match=r"unknown logger name; the names are 'tensorboard', 'wandb', 'mlflow', 'csv'"):
        _fit(loggers=["tensorbord"])
    with pytest.raises(TypeError, match=r"takes the names .* got int 3"):
        _fit(loggers=[3])
    with pytest.raises(TypeError, match=r"got the class TensorBoard. HINT: call it"):
        _fit(loggers=[TensorBoard])
    with pytest.raises(TypeError, match=r"takes a list of loggers, got dict"):
        _fit(loggers={"csv": 1})
    twice = CSV(tmp_path / "a.csv")
    with pytest.raises(ValueError, match=r"the same logger object twice"):
        _fit(loggers=[twice, twice])
    (tmp_path / "file").write_text("")
    with pytest.raises(PermissionError, match=r"TensorBoard\(log_dir=.*\) cannot write to .*file/runs"):
        _fit(loggers=[TensorBoard(tmp_path / "file" / "runs")])
    with pytest.raises(IsADirectoryError, match=r"CSV\(path=.*\) is a directory"):
        _fit(loggers=[CSV(tmp_path)])
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ModuleNotFoundError, match=r'WandB needs the wandb package.*pip install "nbddp\[loggers\]"'):
        _fit(loggers=["wandb"])
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    with pytest.raises(RuntimeError, match=r"MLflow\(tracking_uri='file:.*cannot open the tracking store"):
        _fit(loggers=[MLflow(tracking_uri=f"file://{tmp_path}/mlruns")])
    assert get_session().started == started and get_session().running is None


def test_wandb_online_without_a_key_fails_before_training_and_says_how_to_log_in(tmp_path, monkeypatch):
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    with pytest.raises(RuntimeError, match=r"cannot log in to W&B .* `wandb login` .* WandB\(mode='offline'\)"):
        WandB(project="x").check()
