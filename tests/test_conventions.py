"""Issue 37: nbddp behaves as people coming from Lightning, Keras, HF and plain PyTorch expect.

DDP's own settings (``nbddp.DDP``), schedulers stepped as their own docs
say, loss and NaN handling, and a person's DataLoader kept as given. Each
test trains the smallest model that shows the behaviour, on the suite's two
CPU workers.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, Sampler, TensorDataset

import nbddp
from nbddp.protocol.parallel_settings import DDP

pytestmark = pytest.mark.timeout(300)


def _data(n: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return x, x.sum(1, keepdim=True)


class HalfUsed(nn.Module):
    """A head that no step uses, like the unused pooler of many Hugging Face models."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.used, self.unused = nn.Linear(4, 1), nn.Linear(4, 1)

    def forward(self, x):
        return self.used(x)


# ---- nbddp.DDP -----------------------------------------------------------------------------------------------------

def test_ddp_settings_reach_torch_and_unused_parameters_train(workers):
    with pytest.raises(nbddp.WorkerError, match="find_unused_parameters"):
        nbddp.dist_fit(HalfUsed(), _data(), batch_size=8, live=False)  # torch's own error, named
    model = HalfUsed()
    before = model.unused.weight.detach().clone()
    history = nbddp.dist_fit(model, _data(), batch_size=8, live=False,
                             strategy=nbddp.DDP(find_unused_parameters=True, gradient_as_bucket_view=True,
                                                bucket_cap_mb=1, broadcast_buffers=False))
    assert history.status == "completed" and len(history.steps) >= 1
    assert not torch.equal(model.used.weight, HalfUsed().used.weight)  # the used head trained
    assert torch.equal(model.unused.weight, before)  # the unused head got no gradient, and no error


def test_ddp_settings_are_checked_where_they_are_written():
    with pytest.raises(ValueError, match=r"nbddp\.DDP\(bucket_cap_mb=\.\.\.\) is the size of a gradient bucket in MiB: "
                                         r"a number > 0, or None for torch's default \(25\); got -1"):
        nbddp.DDP(bucket_cap_mb=-1)
    with pytest.raises(TypeError, match=r"nbddp\.DDP\(static_graph=\.\.\.\) must be True or False, got str 'yes'"):
        nbddp.DDP(static_graph="yes")
    with pytest.raises(ValueError, match=r"nbddp\.Pipeline\(dp=DDP\(find_unused_parameters=True.*DDP's settings would "
                                         r"be ignored there; use dp='ddp'"):
        nbddp.Pipeline(dp=nbddp.DDP(find_unused_parameters=True))
    assert nbddp.Pipeline(dp=nbddp.DDP()).dp == "ddp"


def test_ddp_settings_become_torchs_keyword_arguments():
    assert DDP().torch_kwargs() == {"find_unused_parameters": False, "static_graph": False,
                                    "gradient_as_bucket_view": False}
    kwargs = DDP(static_graph=True, broadcast_buffers=False, bucket_cap_mb=4).torch_kwargs()
    assert kwargs["static_graph"] is True and kwargs["bucket_cap_mb"] == 4 and kwargs["forward_sync_buffers"] is False


# ---- schedulers ----------------------------------------------------------------------------------------------------

def _lrs(**kw):
    """The learning rate of every step: 64 samples, 2 ranks, batch 8 -> 4 steps an epoch."""
    options = dict(epochs=3, batch_size=8, optimizer=torch.optim.SGD, lr=0.1, log_every=1, live=False,
                   loss_fn=F.mse_loss)
    options.update(kw)
    history = nbddp.dist_fit(nn.Linear(4, 1), _data(), **options)
    return [r["lr"] for r in history.steps], history


def test_schedulers_step_as_their_own_docs_count(workers):
    per_epoch, _ = _lrs(scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
    assert per_epoch == pytest.approx([0.1] * 4 + [0.05] * 4 + [0.025] * 4)
    per_step, _ = _lrs(epochs=1, scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (s + 1)))
    assert per_step == pytest.approx([0.1, 0.05, 0.1 / 3, 0.025])  # HF's warmup schedules are LambdaLRs
    one_cycle, _ = _lrs(epochs=1, scheduler=lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, 0.1, total_steps=4))
    assert len(set(one_cycle)) == 4  # a new rate every optimizer step
    forced, _ = _lrs(epochs=1, scheduler_interval="step",
                     scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
    assert forced == pytest.approx([0.1, 0.05, 0.025, 0.0125])


def test_a_lightning_style_scheduler_dict_decides(workers):
    every_other, _ = _lrs(epochs=1, scheduler={
        "scheduler": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
        "interval": "step", "frequency": 2})
    assert every_other == pytest.approx([0.1, 0.1, 0.05, 0.05])


def test_reduce_lr_on_plateau_gets_the_monitored_value(workers):
    # threshold=10 in 'rel' mode: no value ever counts as better, so each epoch end (patience 0) halves the rate
    plateau = {"scheduler": lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5,
                                                                                    threshold=10.0),
               "monitor": "val_loss"}
    lrs, history = _lrs(scheduler=plateau, val_data=_data(16, seed=1))
    assert lrs == pytest.approx([0.1] * 4 + [0.05] * 4 + [0.025] * 4)
    assert all("val_loss" in e for e in history.epochs)
    with pytest.raises(nbddp.WorkerError, match=r"the scheduler monitors 'val_acc', which the epoch record does not "
                                                r"hold; it holds \[.*'val_loss'"):
        _lrs(epochs=1, val_data=_data(16, seed=1), scheduler={**plateau, "monitor": "val_acc"})
    with pytest.raises(nbddp.WorkerError, match=r"scheduler_interval='step'\) with ReduceLROnPlateau: its step\(\) "
                                                r"needs the monitored value"):
        _lrs(epochs=1, scheduler=plateau["scheduler"], scheduler_interval="step")


class Halving(torch.optim.lr_scheduler.LRScheduler):
    """A scheduler of a kind nbddp cannot tell: epochs or steps?"""

    def get_lr(self):
        if self.last_epoch == 0:
            return [group["lr"] for group in self.optimizer.param_groups]
        return [group["lr"] * 0.5 for group in self.optimizer.param_groups]


def test_an_unknown_scheduler_steps_per_epoch_with_a_notice(workers):
    with pytest.warns(nbddp.NbddpWarning, match=r"the scheduler Halving is stepped once per epoch .* pass "
                                                r"scheduler_interval='step'"):
        lrs, _ = _lrs(epochs=2, scheduler=Halving)
    assert lrs == pytest.approx([0.1] * 4 + [0.05] * 4)


# ---- loss and NaN --------------------------------------------------------------------------------------------------

def test_float_targets_of_only_zeros_and_ones_need_a_named_loss(workers):
    x = torch.randn(64, 4)
    labels = (x[:, :1] > 0).float()
    with pytest.raises(nbddp.WorkerError, match=r"hold only 0 and 1: labels.*loss_fn=torch\.nn\.functional\."
                                                r"binary_cross_entropy_with_logits"):
        nbddp.dist_fit(nn.Linear(4, 1), (x, labels), batch_size=8, live=False)
    history = nbddp.dist_fit(nn.Linear(4, 1), (x, labels), batch_size=8, live=False,
                             loss_fn=F.binary_cross_entropy_with_logits)
    assert history.status == "completed"


def _poisoned():
    """Sample 32 holds NaN: without shuffling it is in rank 0's third batch (step 3), and in no batch of rank 1."""
    x, y = _data()
    x = x.clone()
    x[32] = float("nan")
    return x, y


def _nan_fit(**kw):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    options = dict(batch_size=8, shuffle=False, optimizer=torch.optim.SGD, lr=0.05, log_every=1, live=False,
                   loss_fn=F.mse_loss)
    options.update(kw)
    return model, nbddp.dist_fit(model, _poisoned(), **options)


def test_on_nan_stop_ends_with_the_last_good_weights_on_every_rank(workers):
    good, _ = _nan_fit(max_steps=2)
    model, history = _nan_fit(on_nan="stop", epochs=2)
    assert history.status == "completed"
    assert "step 3" in history.stop_reason and "on_nan='stop'" in history.stop_reason
    assert [r["step"] for r in history.steps] == [1, 2]
    assert torch.equal(model.weight, good.weight) and torch.equal(model.bias, good.bias)


def test_on_nan_skip_drops_that_update_and_trains_on(workers):
    with pytest.warns(nbddp.NbddpWarning, match=r"1 optimizer step\(s\) were skipped .* first at step 3"):
        model, history = _nan_fit(on_nan="skip")
    assert history.status == "completed" and history.steps[-1]["step"] == 4
    assert torch.isfinite(model.weight).all() and all(torch.isfinite(torch.tensor(r["loss"])) for r in history.steps)
    with pytest.raises(nbddp.WorkerError, match=r"the loss is nan at step"):
        _nan_fit()  # on_nan="raise", the default


# ---- a person's DataLoader -----------------------------------------------------------------------------------------

class Indexed(Dataset):
    """Sample i is (i + offset, i): a batch's mean input says which samples it held."""

    def __init__(self, n: int = 64):
        self.n, self.offset = n, 0.0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor([float(i) + self.offset]), torch.tensor([float(i)])


def _mean_index(model, batch):
    x, y = batch
    return {"loss": (model(x) - y).pow(2).mean(), "index": x.mean()}


def _indices(loader, **kw):
    torch.manual_seed(0)
    history = nbddp.dist_fit(nn.Linear(1, 1), loader, step_fn=_mean_index, log_every=1, live=False, **kw)
    return [r["index"] for r in history.steps]


class Evens(Sampler):
    def __init__(self, n: int):
        self.n = n

    def __iter__(self):
        return iter(range(0, self.n, 2))

    def __len__(self):
        return self.n // 2


def _offset_in_loader_worker(worker_id):
    torch.utils.data.get_worker_info().dataset.offset = 1000.0


def test_a_dataloader_keeps_its_order_sampler_and_settings(workers):
    in_order = _indices(DataLoader(Indexed(), batch_size=8, shuffle=False))
    assert in_order == pytest.approx([7.5, 23.5, 39.5, 55.5])  # both ranks' batches together: 16 samples in order
    evens = _indices(DataLoader(Indexed(), batch_size=8, sampler=Evens(64)))
    assert evens == pytest.approx([15.0, 47.0])  # the sampler's 32 indices, shared out between the ranks
    kept = _indices(DataLoader(Indexed(), batch_size=24, shuffle=False, drop_last=True, num_workers=1,
                               worker_init_fn=_offset_in_loader_worker, generator=torch.Generator().manual_seed(1)))
    assert kept == pytest.approx([1000 + 23.5])  # one whole batch of 24 per rank; the loader worker's init ran


class IndexedStream(torch.utils.data.IterableDataset):
    """Sample i of the stream is (i + offset, i); a loader worker's init may move the offset."""

    def __init__(self, n: int):
        self.n, self.offset = n, 0.0

    def __iter__(self):
        for i in range(self.n):
            yield torch.tensor([float(i) + self.offset]), torch.tensor([float(i)])


def _offset_stream_in_loader_worker(worker_id):
    shard = torch.utils.data.get_worker_info().dataset  # nbddp's rank share of the person's stream
    getattr(shard, "inner", shard).offset = 1000.0


def _own_part(model, batch):
    """How many of the batch's samples belong to another (rank, loader worker) than this one: none may."""
    import torch.distributed as dist

    x, y = batch
    idx = y.squeeze(1).long()
    part = (idx % 4) // 2  # 2 ranks x 2 loader workers: sample i is rank ((i % 4) // 2)'s
    return {"loss": (model(x - 1000.0) - y).pow(2).mean(), "foreign": (part != dist.get_rank()).double().mean(),
            "offset": (x - y).mean(), "rows": torch.tensor(float(len(idx)))}


def test_a_dataloader_over_a_stream_keeps_its_workers_init_and_drop_last(workers):
    loader = DataLoader(IndexedStream(72), batch_size=4, num_workers=2, drop_last=True, pin_memory=False,
                        worker_init_fn=_offset_stream_in_loader_worker, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    h = nbddp.dist_fit(nn.Linear(1, 1), loader, step_fn=_own_part, log_every=1, live=False, epochs=1)
    # 18 samples per (rank, loader worker): 4 whole batches each with drop_last (the loader's), 8 steps per rank
    assert [r["samples"] for r in h.ranks] == [32, 32] and len(h.steps) == 8
    assert all(r["foreign"] == 0 and r["offset"] == 1000.0 and r["rows"] == 4 for r in h.steps)
    with pytest.raises(ValueError, match=r"dist_fit\(num_workers=0\) and the DataLoader's num_workers=2 disagree"):
        nbddp.dist_fit(nn.Linear(1, 1), loader, step_fn=_own_part, num_workers=0, live=False)
    with pytest.raises(ValueError, match=r"dist_fit\(batch_size=8\) and the DataLoader's batch_size=4 disagree"):
        nbddp.dist_fit(nn.Linear(1, 1), loader, step_fn=_own_part, batch_size=8, live=False)


def _batch_rows(output, target):
    return torch.tensor(float(output.shape[0]))


def test_a_validation_dataloader_keeps_its_batch_size(workers):
    history = nbddp.dist_fit(nn.Linear(4, 1), _data(), batch_size=8, live=False, loss_fn=F.mse_loss,
                             val_data=DataLoader(TensorDataset(*_data(20, seed=1)), batch_size=5),
                             metrics={"rows": _batch_rows})
    assert history.epochs[-1]["val_rows"] == pytest.approx(5.0)  # 10 samples per rank in batches of 5, not 8 and 2


def test_a_loaders_settings_are_read_as_given():
    from nbddp.protocol.data_forms import loader_settings
    from nbddp.worker.data.datasets import RankShareSampler

    g = torch.Generator()
    settings, sampler = loader_settings(DataLoader(Indexed(), batch_size=4, sampler=Evens(64), generator=g,
                                                   pin_memory=True, drop_last=True))
    assert isinstance(sampler, Evens) and settings["generator"] is g and settings["drop_last"] is True
    assert settings["pin_memory"] is True and settings["shuffle"] is False and settings["batch_size"] == 4
    shares = [list(RankShareSampler(Evens(10), rank, 2)) for rank in (0, 1)]
    assert shares == [[0, 4, 8], [2, 6, 0]]  # 5 indices padded to 6 with the first, as DistributedSampler pads


# ---- notices -------------------------------------------------------------------------------------------------------

def test_notices_are_warnings_a_person_can_filter_and_details_go_to_the_nbddp_logger(caplog):
    import warnings

    from nbddp.protocol.notices import notify, report

    with pytest.warns(nbddp.NbddpWarning, match="nbddp: a notice"):
        notify("nbddp: a notice")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=nbddp.NbddpWarning)
        notify("nbddp: silenced")
        report("nbddp: silenced too", "Traceback (most recent call last):\n  ...")
    assert seen == []
    assert [(r.name, r.levelname) for r in caplog.records] == [("nbddp", "WARNING")]
    assert "Traceback (most recent call last)" in caplog.records[0].getMessage()


# ---- threads per worker --------------------------------------------------------------------------------------------

def _cgroup(tmp_path, cgroup_line: str, files: dict[str, str]) -> tuple[str, str]:
    for name, text in files.items():
        path = tmp_path / "fs" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (tmp_path / "self").write_text(cgroup_line)
    return str(tmp_path / "fs"), str(tmp_path / "self")


def test_threads_per_worker_follow_the_affinity_mask_and_the_cgroup_quota(tmp_path, monkeypatch):
    import os

    from nbddp.protocol import cpus
    from nbddp.session import start_options

    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    v2 = _cgroup(tmp_path / "v2", "0::/job\n", {"job/cpu.max": "300000 100000\n"})
    assert cpus.cgroup_cpu_quota(*v2) == 3.0
    assert cpus.usable_cpus(*v2) == 3  # the quota is the tighter limit
    v1 = _cgroup(tmp_path / "v1", "4:cpu,cpuacct:/slurm/step\n", {"cpu/slurm/step/cpu.cfs_quota_us": "1200000",
                                                                   "cpu/slurm/step/cpu.cfs_period_us": "100000"})
    assert cpus.usable_cpus(*v1) == 8  # 12 CPUs of quota: the affinity mask's 8 is tighter
    free = _cgroup(tmp_path / "free", "0::/\n", {"cpu.max": "max 100000\n"})
    assert cpus.cgroup_cpu_quota(*free) is None and cpus.usable_cpus(*free) == 8
    monkeypatch.setattr(start_options, "usable_cpus", lambda: 6)
    assert start_options.threads_per_worker(2) == 3 and start_options.threads_per_worker(8) == 1
    from nbddp.protocol import cpus

    half = _cgroup(tmp_path / "half", "0::/a/b\n", {"a/b/cpu.max": "150000 100000\n"})
    assert cpus.cgroup_cpu_quota(*half) == 1.5 and cpus.usable_cpus(*half) == 1  # 1.5 CPUs: one full thread
    assert cpus.cgroup_cpu_quota(*_cgroup(tmp_path / "bad", "0::/\n", {"cpu.max": "garbage\n"})) is None


def _count_cpus_as(n):
    """On an engine: this host's usable CPUs read as ``n`` (None: as they are again)."""
    import torch

    from nbddp.protocol import cpus

    real = cpus.__dict__.setdefault("real_usable_cpus", cpus.usable_cpus)
    cpus.usable_cpus = real if n is None else (lambda *args: n)
    return torch.get_num_threads()


def test_each_engine_counts_the_cpus_of_its_own_host_when_it_joins(workers):
    """The kernel no longer decides the threads for hosts it cannot see: each engine divides its own usable CPUs
    by the ranks on its host (here an engine told that its host has 12 CPUs runs 12 // 2 threads)."""
    from nbddp.protocol.cpus import threads_for
    from nbddp.session.session import get_session

    timeout = get_session().options.timeout
    nbddp.run(_count_cpus_as, 12)
    try:
        nbddp.start(2, timeout=timeout + 1)  # the group forms again: every engine joins and counts
        assert nbddp.run(torch.get_num_threads) == [6, 6]
    finally:
        nbddp.run(_count_cpus_as, None)
        nbddp.start(2, timeout=timeout)
    assert nbddp.run(torch.get_num_threads) == [threads_for(2)] * 2  # this host's own count again


# ---- EarlyStopping on the workers ----------------------------------------------------------------------------------

def test_early_stopping_stops_right_after_the_check_where_patience_ran_out(workers):
    """The issue's case: mode='max' on a falling val_loss, patience 1: the second epoch is the last, however fast."""
    stops = []
    for _ in range(2):  # two runs of one seeded fit stop at the same epoch
        torch.manual_seed(0)
        h = nbddp.dist_fit(nn.Linear(4, 1), _data(96), epochs=20, batch_size=4, val_data=_data(16, seed=1),
                           loss_fn=F.mse_loss, optimizer=torch.optim.SGD, lr=0.05, live=False,
                           callbacks=[nbddp.EarlyStopping(monitor="val_loss", mode="max", patience=1)])
        assert h.status == "completed" and h.stop_reason.startswith("EarlyStopping: val_loss did not improve for 1")
        stops.append([e["epoch"] for e in h.epochs])
    assert stops == [[0, 1], [0, 1]]  # 12 steps an epoch; no epoch trained past the decision


def test_early_stopping_takes_keras_and_lightning_names():
    from nbddp.callbacks.base import Record

    assert nbddp.EarlyStopping("val_acc", mode="auto").spec.mode == "max"
    assert nbddp.EarlyStopping("val_loss", mode="auto").spec.mode == "min"
    assert nbddp.EarlyStopping(restore_best_weights=True).restore_best is True

    def checks(es, values):
        es.on_fit_start(None)
        for step, value in enumerate(values, 1):
            es.on_record(Record("val", {"step": step, "epoch": 0, "val_loss": value}))
        return es.stopped_at

    assert checks(nbddp.EarlyStopping(patience=2, baseline=1.0), [2.0, 1.5, 0.5]) == 2  # never beat the baseline
    assert checks(nbddp.EarlyStopping(patience=2, baseline=1.0), [0.9, 0.95, 0.8]) is None
    assert checks(nbddp.EarlyStopping(patience=5), [1.0, float("nan"), 0.5]) == 2  # check_finite, Lightning's default
    assert checks(nbddp.EarlyStopping(patience=5, check_finite=False), [1.0, float("nan"), 0.5]) is None
    with pytest.raises(TypeError, match=r"EarlyStopping\(baseline=\.\.\.\) is a value of the monitor to beat, a "
                                        r"number; got 'low'"):
        nbddp.EarlyStopping(baseline="low")
    with pytest.raises(TypeError, match=r"EarlyStopping\(check_finite=\.\.\.\) must be True or False; got 'yes'"):
        nbddp.EarlyStopping(check_finite="yes")
