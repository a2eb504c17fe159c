"""Issue 2 end to end: a notebook-style model trains with DDP on persistent workers."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nbddp
from nbddp.protocol.errors import NotStartedError


PUBLIC = {"start", "stop", "status", "restart", "run", "dist_fit", "run_cell", "push", "pull", "run_script", "stacks",
          "debug",
          "History", "FitHandle", "export_checkpoint", "FSDP", "Pipeline", "TensorParallel", "find_batch_size",
          "scaling_report", "sweep", "SweepResult", "SweepHandle", "compile_cache", "RecompileWarning", "predict", "evaluate",
          "PredictHandle", "CallHandle",
          "NbddpError", "NotStartedError", "FitRunningError", "ClusterError", "SlurmError", "ShippingError",
          "UntrustedCheckpointError", "WorkerError", "WorkerDied", "WorkerStalled", "NothingToDebug", "__version__",
          "load_ipython_extension",
          "unload_ipython_extension", "loggers", "EarlyStopping", "stop_fit", "plot_histories",
          "DDP", "NbddpWarning", "last_history", "detach", "attach", "sessions", "running", "kept", "SessionError",
          "report", "should_stop", "lightning_logger", "accelerate_tracker"}


class Net(nn.Module):
    """Defined in the test module (shipped by value, like a notebook class) and uses super()."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, x):
        return self.body(x)


class MarkedDataset(torch.utils.data.Dataset):
    """Appends the pid of the process that built it to ``log`` (a shared file)."""

    def __init__(self, log):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(256, 64, generator=g)
        self.y = torch.randint(0, 10, (256,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def test_import_is_lazy():
    code = "import sys, nbddp; print('torch' in sys.modules, 'ipyparallel' in sys.modules, nbddp.__version__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[:2] == ["False", "False"], "import nbddp must not import torch or ipyparallel"
    assert set(nbddp.__all__) == PUBLIC, "a public name was added or removed: update PUBLIC and docs/design.md"
    assert all(hasattr(nbddp, name) for name in nbddp.__all__)


def test_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        nbddp.nope  # noqa: B018


def test_dist_fit_trains_the_notebook_model_in_place(workers, digits):
    (xt, yt), val = digits
    model = Net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    weight_obj = model.body[0].weight
    history = nbddp.dist_fit(model, (xt, yt), epochs=3, batch_size=32, loss_fn=F.cross_entropy, lr=1e-3,
                             val_data=val, live=False, metrics={"acc": lambda o, t: (o.argmax(1) == t).float().mean()})
    assert history.status == "completed" and history.world_size == 2
    assert [e["epoch"] for e in history.epochs] == [0, 1, 2]
    assert {"epoch", "loss", "val_loss", "val_acc", "step"} <= set(history.epochs[-1])
    assert history.epochs[-1]["loss"] < history.epochs[0]["loss"]
    assert history.epochs[-1]["val_acc"] > 0.6
    assert all({"step", "epoch", "loss", "lr", "samples_per_s"} <= set(r) for r in history.steps)
    assert history.steps[-1]["step"] == 3 * 22  # 1400 samples / 2 ranks / 32 per batch = 22 steps per epoch
    # same object, same tensors, new values
    assert model.body[0].weight is weight_obj
    assert not torch.equal(before["body.0.weight"], model.body[0].weight)
    # the kernel model reproduces the validation loss the workers reported
    with torch.no_grad():
        val_loss = F.cross_entropy(model(val[0]), val[1]).item()
    assert val_loss == pytest.approx(history.epochs[-1]["val_loss"], rel=1e-5)


def test_second_fit_reuses_engines_and_process_group(workers, digits):
    (xt, yt), _ = digits
    pids = [p.pid for p in workers.placements]
    generation = workers.generation
    model = Net()
    nbddp.dist_fit(model, (xt, yt), epochs=1, loss_fn=F.cross_entropy, live=False)
    h2 = nbddp.dist_fit(model, (xt, yt), epochs=1, live=False)  # default loss: cross-entropy for int targets
    assert h2.status == "completed"
    assert [p.pid for p in workers.placements] == pids
    assert workers.generation == generation
    ranks = nbddp.run(_rank_and_pid)
    assert [r[0] for r in ranks] == [0, 1] and [r[1] for r in ranks] == pids


def test_timings_account_for_the_call(workers, digits):
    """The benchmarks read these keys: each is present and they add up (no speed is asserted)."""
    (xt, yt), _ = digits
    h = nbddp.dist_fit(Net(), (xt, yt), epochs=2, batch_size=32, live=False)
    t = h.timings
    for key in ("ship_s", "setup_s", "train_s", "publish_s", "return_s", "pack_s", "load_s", "total_s", "overhead_s",
                "watch_cpu_s"):
        assert key in t and t[key] >= 0, (key, t)
    assert 0 < t["publish_s"] < t["train_s"], t  # rank 0 published its records inside the loop
    assert t["train_s"] < t["total_s"] and t["overhead_s"] == pytest.approx(t["total_s"] - t["train_s"])
    assert t["return_s"] >= t["load_s"], t  # from rank 0's last step to the weights in the model
    assert h.transfers["returned_bytes"] >= sum(p.numel() * 4 for p in Net().parameters())


def _rank_and_pid():
    import torch.distributed as dist

    return dist.get_rank(), os.getpid()


def test_dataset_factory_runs_on_the_workers(workers, tmp_path):
    log = tmp_path / "built_by"
    history = nbddp.dist_fit(Net(), lambda: MarkedDataset(log), epochs=1, batch_size=16, live=False)
    assert history.status == "completed"
    builders = sorted(int(line) for line in log.read_text().split())
    assert builders == sorted(p.pid for p in workers.placements), "the factory runs once on each worker"
    assert os.getpid() not in builders, "the factory must not run in the kernel"


def test_factory_model_comes_back_as_history_model(workers):
    x = torch.randn(128, 64)
    y = torch.randint(0, 10, (128,))
    history = nbddp.dist_fit(Net, (x, y), epochs=1, batch_size=16, live=False)
    assert isinstance(history.model, Net)
    assert history.model(x[:2]).shape == (2, 10)


def test_dataloader_batch_size_and_collate_are_used(workers, tmp_path):
    log = str(tmp_path / "collate")

    def collate(items):  # runs on the workers: it can only tell the test through a file
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {len(items)}\n")
        xs, ys = zip(*items)
        return torch.stack(xs), torch.stack(ys)

    ds = torch.utils.data.TensorDataset(torch.randn(96, 64), torch.randint(0, 10, (96,)))
    loader = torch.utils.data.DataLoader(ds, batch_size=12, collate_fn=collate)
    history = nbddp.dist_fit(Net(), loader, epochs=1, live=False)
    assert history.steps[-1]["step"] == 96 // 2 // 12 and history.batch_size == 12
    calls = [line.split() for line in open(log).read().splitlines()]
    assert sorted(int(pid) for pid, _ in calls) == sorted([p.pid for p in workers.placements] * 4)
    assert {int(n) for _, n in calls} == {12}


def test_run_returns_results_in_rank_order_and_ships_closures(workers):
    offset = 100
    assert nbddp.run(lambda k: _rank_and_pid()[0] * k + offset, 3) == [100, 103]


def test_run_needs_a_function(workers):
    with pytest.raises(TypeError, match=r"needs a function.*not its result"):
        nbddp.run(42)


def test_status_describes_ranks(workers):
    st = nbddp.status()
    assert st["running"] and st["backend"] == "gloo" and st["world_size"] == 2
    assert [r["rank"] for r in st["ranks"]] == [0, 1]
    assert all(r["device"] == "cpu" for r in st["ranks"])
    assert not st["fit_running"]


def test_history_plot_and_repr(workers, digits):
    (xt, yt), val = digits
    h = nbddp.dist_fit(Net(), (xt[:256], yt[:256]), epochs=2, batch_size=32, val_data=val, live=False, log_every=2)
    fig = h.plot()
    ax = fig.axes[0]
    assert [line.get_label() for line in ax.get_lines()] == ["train loss", "val loss"]
    assert len(ax.get_lines()[1].get_xdata()) == 2
    assert "status='completed'" in repr(h)


@pytest.mark.fresh_workers
def test_stop_leaves_no_process_and_start_after_stop_works(workers):
    import time

    pids = set(workers.workers.all_pids())
    procs = []
    for pid in pids:
        try:
            procs += [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        except psutil.Error:
            pass
    reaper = workers.workers.reaper.process
    prefix = workers.file_prefix
    nbddp.stop()
    import glob

    from nbddp.protocol.notes import shm_dir

    assert not glob.glob(os.path.join(shm_dir(), prefix + "*")), "stop() must remove the session's shared-memory files"
    assert nbddp.status()["running"] is False
    gone, alive = psutil.wait_procs(procs, timeout=10)
    assert not alive, f"processes left after stop(): {[p.pid for p in alive]}"
    assert reaper is None or reaper.poll() is not None
    with pytest.raises(NotStartedError, match=r"stopped with nbddp.stop\(\); start new ones"):
        nbddp.dist_fit(Net(), (torch.randn(8, 64), torch.randint(0, 10, (8,))), batch_size=2, live=False)
    t0 = time.perf_counter()
    nbddp.start(n=2)
    assert time.perf_counter() - t0 < 120
    assert nbddp.status()["world_size"] == 2


def test_stop_right_after_a_non_blocking_start_is_a_clean_stop(workers):
    """A stop requested before the ranks are training is held until they can take it."""
    x, y = torch.randn(4096, 64), torch.randint(0, 10, (4096,))
    model = Net()
    handle = nbddp.dist_fit(model, (x, y), epochs=50, batch_size=8, live=False, block=False)
    history = handle.stop()
    assert history.status == "interrupted"
    assert 0 < history.steps[-1]["step"] < 50 * 256
    assert handle.done()


def test_the_shared_workers_get_back_the_default_options_a_test_left_changed(workers):
    """What the ``workers`` fixture does before each test: a timeout left at 250 s (which once failed a test in
    another file, in the CI runs that ordered the two that way) and a stall timeout are put back."""
    from shared_options import reset_to_default_options

    from nbddp.session.session import DEFAULT_PG_TIMEOUT_S

    nbddp.start(n=2, timeout=250)
    workers.options.stall_timeout = 30.0
    generation = workers.generation
    reset_to_default_options(workers)
    assert (workers.options.timeout, workers.options.stall_timeout) == (DEFAULT_PG_TIMEOUT_S, None)
    assert workers.generation > generation and nbddp.run(lambda: 1) == [1, 1]  # a new group, on the same engines
    reset_to_default_options(workers)
    assert nbddp.status()["stall_timeout"] is None


def test_only_the_current_process_group_store_file_exists(workers):
    """Rebuilding the group (a new generation) removes the old generation's file store."""
    import glob

    from nbddp.session.session import DEFAULT_PG_TIMEOUT_S
    from nbddp.protocol.notes import shm_dir

    nbddp.start(n=2, timeout=250)  # a new timeout re-forms the group on the same engines
    try:
        stores = glob.glob(os.path.join(shm_dir(), f"{workers.file_prefix}-pg-*"))
        assert stores == [os.path.join(shm_dir(), f"{workers.file_prefix}-pg-{workers.generation}")]
    finally:
        nbddp.start(n=2, timeout=DEFAULT_PG_TIMEOUT_S)  # timeout=None keeps 250: give the next test the default
