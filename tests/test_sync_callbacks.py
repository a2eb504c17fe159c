"""Issue 37: a callback's on_epoch_end (and on_validation_end) is synchronous, and acts through the fit's handle."""

from __future__ import annotations

import math
import os
import stat
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nbddp
from nbddp.callbacks.base import Callback
from nbddp.callbacks.epoch_answers import Answers, sync_kinds
from nbddp.loggers.base import Logger
from nbddp.protocol.epoch_answer import EpochAnswer, read_answer, wait_answer, write_answer
from nbddp.protocol.errors import NbddpError

# 64 samples, batch 4 a rank on 2 ranks: 8 steps an epoch
STEPS = 8


def _data(n: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return x, x @ torch.linspace(-1, 1, 6).unsqueeze(1)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(6, 1)


def _fit(callbacks, **options):
    kw = dict(epochs=5, batch_size=4, loss_fn=F.mse_loss, optimizer=torch.optim.SGD, lr=0.05, log_every=1,
              live=False, callbacks=callbacks)
    return nbddp.dist_fit(_model(), _data(), **{**kw, **options})


class StopAtEpoch(Callback):
    def __init__(self, epoch: int):
        self.epoch = epoch
        self.seen: list[int] = []

    def on_epoch_end(self, record):
        self.seen.append(record["epoch"])
        return "stop" if record["epoch"] == self.epoch else None


class Ends(Logger):
    """What a tracker is told at the end (MLflow maps "completed" to FINISHED, "interrupted" to KILLED)."""

    def __init__(self):
        self.status = None

    def log_metrics(self, metrics, step):
        pass

    def finish(self, status):
        self.status = status


def test_a_stop_from_on_epoch_end_ends_after_exactly_that_epoch_on_every_rank(workers):
    cb, ends = StopAtEpoch(1), Ends()  # the second epoch of five
    h = _fit([cb], loggers=[ends])
    assert h.status == "completed" and h.stop_reason == "StopAtEpoch.on_epoch_end returned 'stop'"
    assert ends.status == "completed"  # the loggers record a finished run
    assert [e["epoch"] for e in h.epochs] == [0, 1] and cb.seen == [0, 1]
    assert h.steps[-1]["step"] == 2 * STEPS
    assert [r["samples"] for r in h.ranks] == [2 * 32, 2 * 32]  # every rank trained exactly two epochs
    assert h.timings["answer_points"] == 2 and 0 < h.timings["answer_wait_s"] < h.timings["train_s"]


class HalveOnce(Callback):
    def on_fit_start(self, info):
        assert info.handle is self.handle and self.handle is not None

    def on_epoch_end(self, record):
        if record["epoch"] == 0:
            self.handle.set_lr(0.01)


def _kept_weights():
    from nbddp.worker.engine.rank_state import STATE

    return STATE.namespace["sync_lr_kept"].weight.detach().clone()


def test_set_lr_from_on_epoch_end_sets_the_next_epochs_rate_on_every_rank(workers):
    h = _fit([HalveOnce()], epochs=3, keep="sync_lr_kept")
    try:
        lrs = {e: sorted({s["lr"] for s in h.steps if s["epoch"] == e}) for e in range(3)}
        assert lrs == {0: [0.05], 1: [0.01], 2: [0.01]}
        ranks = nbddp.run(_kept_weights)  # a rank that kept lr=0.05 would have moved its weights elsewhere
        assert torch.equal(ranks[0], ranks[1])
    finally:
        nbddp.run_cell("del sync_lr_kept")


class Slow(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(6, 1)

    def forward(self, x):
        time.sleep(0.02)
        return self.net(x)


def test_set_lr_from_a_cell_is_taken_at_the_next_epoch_end_of_a_synchronous_fit(workers):
    handle = nbddp.dist_fit(Slow(), _data(), epochs=4, batch_size=4, loss_fn=F.mse_loss, optimizer=torch.optim.SGD,
                            lr=0.05, log_every=1, live=False, callbacks=[EpochsSeen()], block=False)
    deadline = time.monotonic() + 60
    while not handle.history.steps and time.monotonic() < deadline:
        time.sleep(0.01)
    handle.set_lr(0.01)
    h = handle.wait(timeout=120)
    per_epoch = [sorted({s["lr"] for s in h.steps if s["epoch"] == e}) for e in range(4)]
    assert all(len(lrs) == 1 for lrs in per_epoch), per_epoch  # taken between epochs, on every step of one
    assert per_epoch[0] == [0.05] and per_epoch[-1] == [0.01], per_epoch


class CheckpointFirstEpoch(Callback):
    def __init__(self, folder: str):
        self.folder, self.written = folder, None

    def on_epoch_end(self, record):
        if record["epoch"] == 0:
            self.written = self.handle.save_checkpoint(self.folder)


@pytest.mark.parametrize("strategy, written", [("ddp", f"step-{STEPS:08d}.pt"), ("fsdp", f"step-{STEPS:08d}")])
def test_save_checkpoint_from_on_epoch_end_writes_a_checkpoint_that_resumes(workers, tmp_path, strategy, written):
    cb = CheckpointFirstEpoch(str(tmp_path / "asked"))
    h = _fit([cb], epochs=2, strategy=strategy)
    assert h.status == "completed" and cb.written == str(tmp_path / "asked")
    assert os.listdir(cb.written) == [written]  # the fit's own checkpoint format: a file, or DCP's sharded folder
    resumed = _fit(None, epochs=2, resume=cb.written, strategy=strategy)
    assert [e["epoch"] for e in resumed.epochs] == [1]
    assert resumed.steps[0]["step"] > STEPS and resumed.steps[-1]["step"] == 2 * STEPS
    # the resumed second epoch is the straight fit's second epoch
    assert resumed.epochs[-1]["loss"] == pytest.approx(h.epochs[-1]["loss"], rel=1e-6)


class Raises(Callback):
    def on_epoch_end(self, record):
        raise ValueError("epoch hook broke (test)")


def test_a_synchronous_hook_that_raises_is_answered_and_the_fit_stops_cleanly(workers):
    with pytest.warns(nbddp.NbddpWarning, match=r"callback Raises.on_epoch_end raised"):
        h = _fit([Raises()])
    assert h.status == "completed" and h.stop_reason == "Raises.on_epoch_end raised ValueError: epoch hook broke (test)"
    assert [e["epoch"] for e in h.epochs] == [0]
    assert h.errors[0]["source"] == "callback Raises.on_epoch_end"


class WaitsForItself(Callback):
    def on_epoch_end(self, record):
        try:
            self.handle.wait()
        except NbddpError as exc:
            self.refused = str(exc)
        self.handle.profile(2)  # raises too: the hook fails, is answered, and the fit stops there


def test_a_hook_cannot_wait_for_its_own_fit(workers):
    cb = WaitsForItself()
    with pytest.warns(nbddp.NbddpWarning, match=r"callback WaitsForItself.on_epoch_end raised"):
        h = _fit([cb], epochs=3)
    assert cb.refused.startswith("handle.wait() was called from one of this fit's callbacks; it waits for the fit, "
                                 "and the fit waits for the callback")
    assert h.status == "completed" and h.stop_reason.startswith(
        "WaitsForItself.on_epoch_end raised NbddpError: handle.profile() was called from one of this fit's callbacks")
    assert [e["epoch"] for e in h.epochs] == [0]


class StopAtFirstCheck(Callback):
    def on_validation_end(self, record):
        return "stop"


def test_a_stop_from_on_validation_end_lands_right_after_that_check(workers):
    h = _fit([StopAtFirstCheck()], val_data=_data(16, 1), val_every=3)
    assert h.status == "completed" and h.stop_reason == "StopAtFirstCheck.on_validation_end returned 'stop'"
    assert h.steps[-1]["step"] == 3 and [v["step"] for v in h.validations] == [3]


class OnlyRecords:
    def __init__(self):
        self.n = 0

    def on_record(self, record):
        self.n += 1


def test_fits_without_a_synchronous_hook_do_not_wait_and_the_handle_says_why_it_cannot_act(workers):
    assert sync_kinds([OnlyRecords(), Callback(), nbddp.EarlyStopping()]) == ()  # inherited empty hooks: no wait
    assert sync_kinds([StopAtEpoch(0), StopAtFirstCheck()]) == ("epoch", "val")
    only = OnlyRecords()
    handle = _fit([only], epochs=2, block=False)
    try:
        assert handle._run.hooks.answers is None and handle._run.plan.launch.answers == ()
        with pytest.raises(NbddpError, match=r"handle.set_lr\(\) is taken by the ranks at a synchronous callback "
                                             r"point, and this fit has none: call it from a callback's on_epoch_end"):
            handle.set_lr(0.1)
    finally:
        h = handle.wait(timeout=120)
    assert h.status == "completed" and only.n > 0 and "answer_points" not in h.timings  # the ranks never waited
    with pytest.raises(NbddpError, match=r"handle.save_checkpoint\(\): this fit has ended \(completed\)"):
        handle.save_checkpoint("somewhere")


def test_the_handles_requests_are_checked(tmp_path):
    answers = Answers("nbddp-test-answers-w0", ("epoch",))
    with pytest.raises(TypeError, match=r"handle.set_lr\(lr\) takes a number, got str 'fast'"):
        answers.set_lr("fast")
    with pytest.raises(TypeError, match=r"takes a number, got bool True"):
        answers.set_lr(True)
    for bad in (-0.1, math.nan, math.inf):
        with pytest.raises(ValueError, match=r"the learning rate must be a finite number >= 0"):
            answers.set_lr(bad)
    with pytest.raises(TypeError, match=r"handle.save_checkpoint\(path\) takes a folder path .* got int 3"):
        answers.save_checkpoint(3)
    afile = tmp_path / "a-file"
    afile.write_text("")
    with pytest.raises(ValueError, match=r"is a file; pass a folder: the checkpoint is written in it as step-<N>.pt"):
        answers.save_checkpoint(afile)
    answers.set_lr(0.5)
    answers.stop("enough")
    answers.answer(7)  # what was asked goes out once; the stop stays
    assert read_answer(answers.path, 7) == EpochAnswer(seq=7, stop="enough", lr=0.5)
    assert stat.S_IMODE(os.stat(answers.path).st_mode) == 0o600
    answers.answer(8)
    assert read_answer(answers.path, 8) == EpochAnswer(seq=8, stop="enough")
    answers.close()
    assert not os.path.exists(answers.path)


def test_rank_0_takes_only_the_answer_to_its_own_point_and_gives_up_after_the_timeout(tmp_path):
    path = str(tmp_path / "answer")
    assert wait_answer(path, 0, timeout_s=0.05) is None  # no file: the kernel never answered
    write_answer(path, EpochAnswer(seq=3, lr=0.1))
    assert read_answer(path, 2) is None and wait_answer(path, 4, timeout_s=0.05) is None
    assert wait_answer(path, 3, timeout_s=0.05) == EpochAnswer(seq=3, lr=0.1)
    with open(path, "w") as f:
        f.write("{half")  # being replaced: read as "not yet"
    assert read_answer(path, 3) is None


class EpochsSeen(Callback):
    def __init__(self):
        self.epochs: list[int] = []

    def on_epoch_end(self, record):
        self.epochs.append(record["epoch"])


@pytest.mark.faults
@pytest.mark.timeout(240)
def test_an_elastic_fit_that_loses_a_rank_after_an_epoch_end_is_answered_again_and_completes(workers, tmp_path):
    """Rank 1 dies in epoch 1; the relaunched ranks count their records from 0 again, from the last snapshot: no
    stale answer is taken for theirs, a replayed point is answered at once, and each epoch reaches the hook once."""
    from elastic_kit import KillAt, armed
    from faultkit import Net, regression_data

    marker, seen = armed(str(tmp_path / "kill")), EpochsSeen()
    torch.manual_seed(0)
    h = nbddp.dist_fit(Net(), regression_data(), batch_size=16, epochs=2, live=False, seed=3, callbacks=[seen],
                       step_fn=KillAt([(1, 20, marker)]), max_restarts=1, snapshot_every=4)
    assert h.status == "completed" and not os.path.exists(marker) and len(h.restarts) == 1
    assert seen.epochs == [0, 1] and [e["epoch"] for e in h.epochs] == [0, 1]
