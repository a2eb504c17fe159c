"""Bad input (issue 4, row 6): one case per kind, each a clear error, the workers still usable.

Kernel-side cases must raise before anything is sent to a worker (the
client's task history does not grow). Worker-side cases (what only running
the model can tell) raise the same message on the first step, as a
``WorkerError``. After every case one all-reduce proves the workers and the
process group still work.
"""

from __future__ import annotations

import sys
import threading

import cloudpickle
import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

import nbddp
from faultkit import D, Net, regression_data
from nbddp.protocol.errors import FitRunningError, NotStartedError, WorkerError

cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.timeout(240)


class Stream(IterableDataset):
    def __iter__(self):
        yield from ()


class DictData(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict:
        return {"x": torch.randn(D), "labels": torch.randn(1)}


class NoLossModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, 1)

    def forward(self, x, labels=None):
        return {"logits": self.lin(x)}  # forgot the loss


class ReturnsNone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, 1)

    def forward(self, x):
        self.lin(x)


class WithLock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, 1)
        self.guard = threading.Lock()

    def forward(self, x):
        return self.lin(x)


class GeneratorData(Dataset):
    def __init__(self) -> None:
        self.x, self.y = regression_data()
        self.rows = (i for i in range(len(self.x)))  # a generator: does not pickle

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def xy(n: int = 512):
    return regression_data(n)


def nan_data():
    x, y = regression_data()
    x[5:] = float("nan")
    return x, y


# (id, build kwargs, exception, match, where)
CASES = [
    ("model is an int", lambda: dict(model=42), TypeError, r"model=\.\.\.\) must be a torch\.nn\.Module .* got int", "kernel"),
    ("model is a non-Module class", lambda: dict(model=dict), TypeError, r"got the class dict, which is not an nn\.Module", "kernel"),
    ("data is a string", lambda: dict(data="train.csv"), TypeError, r"data=\.\.\.\) must be a map-style Dataset.* got str", "kernel"),
    ("data tuple of non-tensors", lambda: dict(data=(xy()[0], [1, 2])), TypeError, r"a tuple must hold tensors .*\(Tensor, list\)", "kernel"),
    ("mismatched x, y lengths", lambda: dict(data=(xy()[0], xy()[1][:100])), ValueError, r"same first dimension.*\[512, 100\]", "kernel"),
    ("empty dataset", lambda: dict(data=TensorDataset(torch.empty(0, D), torch.empty(0, 1))), ValueError, r"data=\.\.\.\) is empty \(len 0\)", "kernel"),
    ("empty val_data", lambda: dict(val_data=TensorDataset(torch.empty(0, D))), ValueError, r"val_data=\.\.\.\) is empty .*pass None", "kernel"),
    ("shard smaller than a batch", lambda: dict(data=xy(20), batch_size=16), ValueError, r"batch_size=16\) is larger than each rank's shard: 20 samples over 2 ranks gives 10 .*batch_size<=10", "kernel"),
    # streams are data now (issue 24); one that yields nothing is an error on every rank at once, not a hang
    ("IterableDataset that yields nothing", lambda: dict(data=Stream()), WorkerError,
     r"EmptyShard: the training data yielded no sample on any rank in epoch 0", "worker"),
    ("DataLoader over an empty IterableDataset", lambda: dict(data=DataLoader(Stream(), batch_size=16)), WorkerError,
     r"the training data yielded no sample on any rank", "worker"),
    ("epochs=0", lambda: dict(epochs=0), ValueError, r"epochs=\.\.\.\) must be >= 1, got 0", "kernel"),
    ("epochs is a string", lambda: dict(epochs="3"), TypeError, r"epochs=\.\.\.\) must be an int, got str '3'", "kernel"),
    ("lr is a string", lambda: dict(lr="fast"), TypeError, r"lr=\.\.\.\) must be a number, got str 'fast'", "kernel"),
    ("batch_size=0", lambda: dict(batch_size=0), ValueError, r"batch_size=\.\.\.\) must be >= 1, got 0", "kernel"),
    ("unknown precision", lambda: dict(precision="fp16"), ValueError, r"precision=\.\.\.\) must be one of .* got 'fp16' \(did you mean '16-mixed'\?\)", "kernel"),
    ("16-mixed on CPU", lambda: dict(precision="16-mixed"), ValueError, r"precision='16-mixed'\) needs CUDA GPUs", "kernel"),
    ("sync_batchnorm on CPU", lambda: dict(sync_batchnorm=True), ValueError, r"sync_batchnorm=True\) needs CUDA GPUs", "kernel"),
    ("optimizer already built", lambda: dict(optimizer=torch.optim.SGD(Net().parameters(), lr=0.1)), TypeError, r"optimizer already built .*lambda params", "kernel"),
    ("loss_fn not callable", lambda: dict(loss_fn="mse"), TypeError, r"loss_fn=\.\.\.\) must be callable, got str 'mse'", "kernel"),
    ("metrics not a dict of functions", lambda: dict(metrics={"acc": 1}, val_data=xy(64)), TypeError, r"metrics=\.\.\.\) must be a dict of name -> fn", "kernel"),
    ("metrics without val_data", lambda: dict(metrics={"mae": torch.nn.functional.l1_loss}), ValueError, r"pass val_data=\.\.\. too", "kernel"),
    ("unpicklable model attribute", lambda: dict(model=WithLock()), TypeError, r"dist_fit\(model=\.\.\.\) cannot be sent to the workers.*The part that fails is `model\.guard` \(lock\).*`model=lambda: \.\.\.`", "kernel"),
    ("unpicklable dataset attribute", lambda: dict(data=GeneratorData()), TypeError, r"dist_fit\(data=\.\.\.\) cannot be sent .*The part that fails is `data\.rows` \(generator\)", "kernel"),
    ("unknown option", lambda: dict(epoch=3), TypeError, r"unknown option\(s\) \['epoch'\]", "kernel"),
    ("checkpoint_every without a dir", lambda: dict(checkpoint_every=5), ValueError, r"checkpoint_every=\.\.\.\) needs checkpoint_dir", "kernel"),
    ("resume=True without a dir", lambda: dict(resume=True), ValueError, r"resume=True\) resumes from checkpoint_dir", "kernel"),
    ("grad_accum=0", lambda: dict(grad_accum=0), ValueError, r"grad_accum=\.\.\.\) must be >= 1, got 0", "kernel"),
    ("clip_grad_norm=0", lambda: dict(clip_grad_norm=0), ValueError, r"clip_grad_norm=\.\.\.\) must be > 0\.0, got 0", "kernel"),
    ("shuffle is a string", lambda: dict(shuffle="yes"), TypeError, r"shuffle=\.\.\.\) must be True or False, got str 'yes'", "kernel"),
    ("block is a string", lambda: dict(block="no"), TypeError, r"block=\.\.\.\) must be True or False, got 'no'", "kernel"),
    ("live is unknown", lambda: dict(live="maybe"), ValueError, r"live=\.\.\.\) must be True, False, None .* got 'maybe'", "kernel"),
    # what only running the model can tell: raised on every rank at the first step
    ("forward returns no loss (dict batch)", lambda: dict(model=NoLossModel(), data=DictData()), WorkerError, r"BatchError: the batch is a dict, so the model's output must be the loss", "worker"),
    ("forward returns None, no loss_fn", lambda: dict(model=ReturnsNone()), WorkerError, r"the model returned NoneType, not a tensor, and no loss_fn was given", "worker"),
    ("non-scalar loss", lambda: dict(loss_fn=lambda out, y: (out - y) ** 2), WorkerError, r"the loss must be a scalar, got a tensor of shape \(16, 1\)", "worker"),
    ("NaN loss", lambda: dict(data=nan_data()), WorkerError, r"FloatingPointError: the loss is nan at step 1 \(epoch 0\)", "worker"),
    ("model factory returns no module", lambda: dict(model=lambda: 42), WorkerError, r"the model factory returned int, not a torch\.nn\.Module", "worker"),
    ("data factory returns no dataset", lambda: dict(data=lambda: 42), WorkerError, r"the data factory returned int; it must return a map-style Dataset", "worker"),
    ("data factory returns an empty dataset", lambda: dict(data=lambda: TensorDataset(*xy(0))), WorkerError,
     r"the dataset built on the worker is empty \(len 0\)", "worker"),
    # one sample over two ranks with drop_last: each shard holds 0 samples (the kernel cannot see a factory's size)
    ("no full batch on a rank", lambda: dict(data=lambda: TensorDataset(*xy(1)), batch_size=1, drop_last=True), WorkerError,
     r"rank \d has no full batch to train on: its shard holds 0 samples and drop_last=True with batch_size=1", "worker"),
]


def _all_reduce_one() -> float:
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return float(t)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_clearly_and_workers_stay_usable(workers, case):
    _, build, exc_type, match, where = case
    kwargs = dict(model=Net(), data=xy(), batch_size=16, max_steps=3, live=False)
    kwargs.update(build())
    sent = len(workers.client.history)
    generation = workers.generation
    with pytest.raises(exc_type, match=match) as info:
        nbddp.dist_fit(kwargs.pop("model"), kwargs.pop("data"), **kwargs)
    if where == "kernel":
        assert len(workers.client.history) == sent, "a task reached the workers before the error"
        assert workers.generation == generation and not workers.supervisor.healing
    else:
        assert not info.value.note, f"every rank fails the same way; none is stuck: {info.value}"
    assert workers.running is None
    assert nbddp.run(_all_reduce_one) == [2.0, 2.0]


def test_nccl_without_gpus(workers):
    if torch.cuda.device_count():
        pytest.skip("this machine has GPUs")
    with pytest.raises(ValueError, match=r"backend='nccl'\) needs CUDA GPUs.* Use backend='gloo'"):
        nbddp.start(n=2, backend="nccl")
    assert workers.backend == "gloo" and nbddp.run(_all_reduce_one) == [2.0, 2.0]


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(n=0), ValueError, r"start\(n=\.\.\.\) must be >= 1, got 0"),
    (dict(n="2"), TypeError, r"start\(n=\.\.\.\) must be an int, got str '2'"),
    (dict(backend="mpi"), ValueError, r"start\(backend=\.\.\.\) must be one of \('gloo', 'nccl'\), got 'mpi'"),
    (dict(threads=0), ValueError, r"start\(threads=\.\.\.\) must be a positive int"),
    (dict(n=3, backend="gloo"), Exception, r"workers are already running \(2 x gloo\); call nbddp\.stop\(\) first"),
])
def test_bad_start_arguments(workers, kwargs, exc, match):
    generation = workers.generation
    with pytest.raises(exc, match=match):
        nbddp.start(**kwargs)
    assert workers.generation == generation and nbddp.run(_all_reduce_one) == [2.0, 2.0]


def test_run_needs_a_function(workers):
    with pytest.raises(TypeError, match=r"nbddp\.run\(fn, \.\.\.\) needs a function, got int"):
        nbddp.run(42)


def test_dist_fit_after_stop(monkeypatch):
    """After ``stop()`` a fit says to start again (a fresh Session stands in for a stopped one)."""
    import nbddp.session.session as session_mod

    stopped = session_mod.Session()
    stopped.stopped_explicitly = True
    monkeypatch.setattr(session_mod, "_SESSION", stopped)
    with pytest.raises(NotStartedError, match=r"stopped with nbddp\.stop\(\); start new ones with nbddp\.start\(\)"):
        nbddp.dist_fit(Net(), xy(), live=False)
    assert not stopped.started, "dist_fit must not start workers behind the person's back after stop()"


def test_second_concurrent_fit(workers):
    handle = nbddp.dist_fit(Net(delay=0.05), xy(), batch_size=16, epochs=50, live=False, block=False)
    try:
        with pytest.raises(FitRunningError, match=r"a dist_fit is still running on these workers; wait for it"):
            nbddp.dist_fit(Net(), xy(), batch_size=16, max_steps=2, live=False)
        with pytest.raises(FitRunningError, match=r"still running"):
            nbddp.run(_all_reduce_one)
    finally:
        h = handle.stop()
    assert h.status == "interrupted"
    assert nbddp.run(_all_reduce_one) == [2.0, 2.0]
