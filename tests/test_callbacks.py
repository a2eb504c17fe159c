"""Issue 25: callbacks in the kernel, stopping from a callback, EarlyStopping and restore_best, History as data."""

from __future__ import annotations

import sys
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nbddp
from nbddp.callbacks.base import Callback, Record
from nbddp.callbacks.fit_hooks import FitHooks
from nbddp.fit.history import History


def _data(n: int = 64, seed: int = 0, sign: float = 1.0):
    """Regression on a fixed direction; ``sign=-1`` flips the targets (validation then worsens as training improves)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return x, sign * (x @ torch.linspace(-1, 1, 6).unsqueeze(1))


class Slow(nn.Module):
    """Each forward takes 20 ms: a stop asked from the kernel lands long before the last step."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x):
        time.sleep(0.02)
        return self.net(x)


def _fast() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(6, 1)


def _mae(output, target):
    return (output - target).abs().mean()


class Recorder:
    """Every hook, duck-typed (no base class)."""

    def __init__(self):
        self.info = None
        self.records: list[Record] = []
        self.epoch_ends: list[dict] = []
        self.end = None

    def on_fit_start(self, info):
        self.info = info

    def on_record(self, record):
        self.records.append(record)

    def on_epoch_end(self, record):
        self.epoch_ends.append(dict(record))

    def on_fit_end(self, history):
        self.end = history


class EpochsOnly:
    def on_epoch_end(self, record):
        self.last = record["epoch"]


def test_callbacks_get_the_fit_every_record_in_order_then_the_history(workers):
    rec, epochs_only = Recorder(), EpochsOnly()
    h = nbddp.dist_fit(_fast(), _data(), epochs=2, batch_size=8, val_data=_data(16, 1), metrics={"mae": _mae},
                       log_every=1, live=False, callbacks=[rec, epochs_only])
    assert h.status == "completed" and rec.end is h and epochs_only.last == 1
    info = rec.info
    assert (info.world_size, info.total_steps, info.steps_per_epoch, info.start_step) == (2, 8, 4, 0)
    assert (info.model_class, info.params, info.strategy, info.precision) == ("torch.nn.modules.linear.Linear", 7,
                                                                              "ddp", "32-true")
    assert info.hparams["epochs"] == 2 and info.hparams["metrics"] == "mae" and not info.resumed
    by_kind = {k: [dict(r) for r in rec.records if r.kind == k] for k in ("step", "epoch", "val")}
    assert (by_kind["step"], by_kind["epoch"], by_kind["val"]) == (h.steps, h.epochs, h.validations)
    assert rec.epoch_ends == h.epochs
    steps = [r["step"] for r in rec.records]
    assert steps == sorted(steps)  # in the order they were made
    assert [r.kind for r in rec.records[-3:]] == ["step", "val", "epoch"]  # an epoch's end: its validation first


class StopAt:
    def __init__(self, how: str):
        self.how = how

    def on_record(self, record):
        if record.kind == "step" and record["step"] >= 3:
            if self.how == "return":
                return "stop"
            nbddp.stop_fit("enough at step 3")
        return None


@pytest.mark.parametrize("how, reason", [("return", "StopAt.on_record returned 'stop'"),
                                         ("stop_fit", "enough at step 3"), ("cell", "from a cell")])
def test_a_callback_or_a_cell_stops_the_fit_at_the_next_sync(workers, how, reason):
    model = Slow()
    before = [p.detach().clone() for p in model.parameters()]
    if how == "cell":  # nbddp.stop_fit() from the notebook while a non-blocking fit trains
        handle = nbddp.dist_fit(model, _data(), epochs=40, batch_size=4, log_every=1, live=False, block=False)
        deadline = time.monotonic() + 60
        while len(handle.history.steps) < 3 and not handle.done() and time.monotonic() < deadline:
            time.sleep(0.02)
        nbddp.stop_fit("from a cell")
        h = handle.wait(timeout=60)
    else:
        h = nbddp.dist_fit(model, _data(), epochs=40, batch_size=4, log_every=1, live=False, callbacks=[StopAt(how)])
    assert h.status == "interrupted" and h.stop_reason == reason
    assert 3 <= h.steps[-1]["step"] < 40 * 8
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))  # that step's weights came back


class Boom(Callback):
    def on_record(self, record):
        if record["step"] >= 2:
            raise ValueError("boom (test)")


class Quiet(Callback):
    stop_on_error = False

    def __init__(self):
        self.calls = 0

    def on_record(self, record):
        self.calls += 1
        raise RuntimeError("quiet (test)")


def test_a_callback_that_raises_is_reported_and_stops_the_fit_cleanly(workers, caplog):
    quiet = Quiet()
    with pytest.warns(nbddp.NbddpWarning) as warned:
        h = nbddp.dist_fit(Slow(), _data(), epochs=40, batch_size=4, log_every=1, live=False,
                           callbacks=[quiet, Boom()])
    assert h.status == "interrupted" and h.stop_reason == "Boom.on_record raised ValueError: boom (test)"
    assert h.steps[-1]["step"] < 40 * 8 and quiet.calls == 1  # dropped after its first error; the fit went on
    said = [str(w.message) for w in warned]
    assert "nbddp: callback Boom.on_record raised; it gets no more records, and the fit stops at the next sync " \
           "(the model keeps that step's weights)" in said
    assert "nbddp: callback Quiet.on_record raised; it gets no more records, and the fit goes on" in said
    logged = [r.getMessage() for r in caplog.records if r.name == "nbddp"]  # the tracebacks, on the nbddp logger
    assert sum("Traceback (most recent call last)" in m for m in logged) == 2
    assert [e["source"] for e in h.errors] == ["callback Quiet.on_record", "callback Boom.on_record"]
    assert "raise ValueError" in h.errors[1]["traceback"]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_early_stopping_restore_best_leaves_the_best_checks_weights_in_the_model(workers, strategy):
    xv, yv = _data(32, 1, sign=-1.0)  # validation against the flipped targets: it gets worse as training goes
    model = Slow()
    es = nbddp.EarlyStopping(monitor="val_loss", patience=3, restore_best=True)
    h = nbddp.dist_fit(model, _data(), epochs=40, batch_size=4, val_data=(xv, yv), val_every=1, log_every=1,
                       optimizer=torch.optim.SGD, lr=0.05, live=False, strategy=strategy, callbacks=[es])
    # an early stop is a normal end (as in Keras, Lightning and HF), decided on the workers right at the check
    assert h.status == "completed" and h.stop_reason.startswith("EarlyStopping: val_loss did not improve for 3")
    best = min(h.validations, key=lambda r: r["val_loss"])
    after = [r for r in h.validations if r["step"] > best["step"]]
    assert len(after) == 3 and h.steps[-1]["step"] == h.validations[-1]["step"] == es.stopped_at
    assert h.best == {"monitor": "val_loss", "mode": "min", "value": best["val_loss"], "step": best["step"],
                      "epoch": best["epoch"], "checks": len(h.validations), "stopped_at": es.stopped_at,
                      "restored": True}
    assert h.validations[-1]["val_loss"] > best["val_loss"] and h.steps[-1]["step"] > best["step"]
    with torch.no_grad():
        assert F.mse_loss(model(xv), yv).item() == pytest.approx(best["val_loss"], rel=1e-5)


# ---- History as data (no workers) ------------------------------------------------------


def _history(scale: float) -> History:
    h = History(world_size=2, batch_size=4)
    for s in range(1, 7):
        h.add("step", {"step": s, "epoch": (s - 1) // 3, "loss": scale / s, "lr": 0.1, "samples_per_s": 10.0})
    for e, s in ((0, 3), (1, 6)):
        h.add("val", {"epoch": e, "step": s, "val_loss": scale / s + 0.1})
        h.add("epoch", {"epoch": e, "step": s, "loss": scale / s, "val_loss": scale / s + 0.1})
    return h


def test_history_to_pandas_and_the_figures():
    from IPython.core.formatters import DisplayFormatter
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    h = _history(1.0)
    df = h.to_pandas()  # one DataFrame, as people expect from a to_pandas
    assert list(df.columns[:4]) == ["kind", "step", "epoch", "loss"]
    assert df.kind.tolist() == ["step"] * 6 + ["epoch"] * 2 + ["val"] * len(h.validations)
    assert df[df.kind == "step"].loss.tolist() == [r["loss"] for r in h.steps]
    steps, epochs, validations = h.to_frames()  # the three-frame form, under its own name
    assert list(steps.columns[:3]) == ["step", "epoch", "loss"] and len(steps) == 6
    assert steps.loss.tolist() == [r["loss"] for r in h.steps] and epochs.epoch.tolist() == [0, 1]
    assert h.to_frames().validations.val_loss.tolist() == validations.val_loss.tolist()
    empty = History().to_frames()
    assert list(empty.steps.columns) == ["step", "epoch", "loss"] and empty.steps.empty
    assert list(History().to_pandas().columns) == ["kind", "step", "epoch", "loss"]
    fig = h.plot()
    assert len(fig.axes[0].lines) == 2
    shown, _ = DisplayFormatter().format(fig)  # what a plain Jupyter kernel displays, pyplot never imported
    assert shown["image/png"][:4] == b"\x89PNG"
    own = Figure().add_subplot(1, 1, 1)
    assert h.plot(ax=own) is own and len(own.lines) == 2
    fig = nbddp.plot_histories([h, _history(2.0)], labels=["lr 0.1", "lr 0.2"])
    assert isinstance(fig.canvas, FigureCanvasAgg)
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == [
        "lr 0.1 (train)", "lr 0.1 (val)", "lr 0.2 (train)", "lr 0.2 (val)"]
    assert fig.axes[0].lines[2].get_ydata().tolist() == [2.0 / s for s in range(1, 7)]
    assert len(nbddp.plot_histories(h, metric="lr").axes[0].lines) == 1  # one History alone; no val_lr recorded


def test_history_data_bad_input(monkeypatch):
    h = _history(1.0)
    with pytest.raises(TypeError, match=r"takes a list of History objects .* got int"):
        nbddp.plot_histories([h, 3])
    with pytest.raises(TypeError, match=r"got an empty list"):
        nbddp.plot_histories([])
    with pytest.raises(ValueError, match=r"1 labels for 2 histories"):
        nbddp.plot_histories([h, h], labels=["a"])
    with pytest.raises(ValueError, match=r"metric='acc'\): no step record holds 'acc'; the steps hold \['epoch'"):
        nbddp.plot_histories([h], metric="acc")
    monkeypatch.setitem(sys.modules, "pandas", None)
    with pytest.raises(ModuleNotFoundError, match=r"History.to_pandas\(\) needs pandas: pip install pandas"):
        h.to_pandas()
    with pytest.raises(ModuleNotFoundError, match=r"History.to_frames\(\) needs pandas: pip install pandas"):
        h.to_frames()


# ---- bad input: before any worker starts ------------------------------------------------


def test_bad_callbacks_and_early_stopping_fail_before_any_worker_starts():
    from nbddp.session.session import get_session

    started = get_session().started
    fit = dict(model=_fast(), data=_data(), live=False)
    with pytest.raises(TypeError, match=r"object .* has none of the hook methods on_fit_start, on_record, "
                                        r"on_validation_end, on_epoch_end, on_fit_end"):
        nbddp.dist_fit(**fit, callbacks=[object()])
    with pytest.raises(TypeError, match=r"got the class Recorder; pass an instance: Recorder\(\)"):
        nbddp.dist_fit(**fit, callbacks=[Recorder])
    # a Lightning callback has on_fit_start(trainer, pl_module): refused at once, not called with a record mid-fit
    lightning_base = type("Callback", (), {"__module__": "lightning.pytorch.callbacks.callback",
                                           "on_fit_start": lambda self, trainer, pl_module: None})
    checkpoint = type("ModelCheckpoint", (lightning_base,), {"__module__": "__main__"})
    with pytest.raises(TypeError, match=r"got a Lightning callback, ModelCheckpoint \(lightning\.pytorch\.callbacks"
                                        r"\.callback\.Callback\); .* nbddp calls on_fit_start\(info\), "
                                        r"on_record\(record\), on_validation_end\(record\), on_epoch_end\(record\) and "
                                        r"on_fit_end\(history\) .* self.handle.save_checkpoint\(folder\) and "
                                        r"self.handle.set_lr\(lr\) act on every rank before the next epoch"):
        nbddp.dist_fit(**fit, callbacks=[checkpoint()])
    keras = type("EarlyStopping", (), {"__module__": "keras.src.callbacks.early_stopping", "on_epoch_end": print})
    with pytest.raises(TypeError, match=r"got a Keras callback, EarlyStopping .* nbddp\.EarlyStopping\(\.\.\.\) "
                                        r"takes the place of early stopping"):
        nbddp.dist_fit(**fit, callbacks=[keras()])
    with pytest.raises(ValueError, match=r"monitor='val_acc'\): this fit records \['loss', 'val_loss'\] .* "
                                         r"metrics=\{'acc': fn\}"):
        nbddp.dist_fit(**fit, val_data=_data(8), callbacks=[nbddp.EarlyStopping(monitor="val_acc")])
    with pytest.raises(ValueError, match=r"monitor='val_loss'\) watches validation, but the fit has no val_data"):
        nbddp.dist_fit(**fit, callbacks=nbddp.EarlyStopping())
    with pytest.raises(ValueError, match=r"monitor='acc'\): this fit records \['loss'\]"):
        nbddp.dist_fit(**fit, callbacks=[nbddp.EarlyStopping(monitor="acc")])
    with pytest.raises(ValueError, match=r"2 EarlyStopping\(restore_best=True\)"):
        nbddp.dist_fit(**fit, val_data=_data(8), callbacks=[nbddp.EarlyStopping(restore_best=True),
                                                            nbddp.EarlyStopping("loss", restore_best=True)])
    assert get_session().started == started and get_session().running is None


def test_early_stopping_settings_are_checked_when_made():
    with pytest.raises(ValueError, match=r"mode=...\) must be 'min' \(lower is better\), 'max' or 'auto'; got 'median'"):
        nbddp.EarlyStopping(mode="median")
    with pytest.raises(ValueError, match=r"patience=...\) is a number of checks, an int >= 1; got 0"):
        nbddp.EarlyStopping(patience=0)
    with pytest.raises(ValueError, match=r"min_delta=...\) must be a number >= 0; got -0.1"):
        nbddp.EarlyStopping(min_delta=-0.1)
    with pytest.raises(TypeError, match=r"monitor=...\) names a recorded value such as 'val_loss'; got 3"):
        nbddp.EarlyStopping(monitor=3)
    with pytest.raises(TypeError, match=r"restore_best=...\) must be True or False; got 'yes'"):
        nbddp.EarlyStopping(restore_best="yes")
    with pytest.raises(nbddp.NbddpError, match=r"stop_fit\(\): no dist_fit is running"):
        nbddp.stop_fit()


def test_early_stopping_counts_checks_and_names_a_value_the_records_lack():
    """A step_fn may record val_* values of its own: the name is taken, and checked at the first check."""
    es = nbddp.EarlyStopping(monitor="val_f1", mode="max", patience=2, min_delta=0.05)
    hooks = FitHooks.build(callbacks=[es], val_data=_data(8), step_fn=lambda model, batch: model(batch[0]).sum())
    assert hooks.best is None and hooks.stoppers == [es]
    for step, f1 in ((1, 0.5), (2, 0.52), (3, 0.6)):
        es.on_record(Record("val", {"step": step, "epoch": 0, "val_f1": f1}))
    assert (es.best, es.best_step, es.wait, es.stopped_at) == (0.6, 3, 0, None)  # 0.52 was within min_delta
    with pytest.raises(KeyError, match=r"monitor='val_f1'\): the val records hold \['val_loss'\]"):
        es.on_record(Record("val", {"step": 4, "epoch": 0, "val_loss": 1.0}))
