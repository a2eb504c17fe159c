"""The worker side's checks on values its types say may be missing (issue 42, mypy on ``nbddp/worker``).

In this process, no engines: each test reaches one check with the value the
type allowed (``None``, a wrapper of another class, a dataset without state)
and reads the error a person or a strategy author would see.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.utils.data import DistributedSampler, TensorDataset

import nbddp
from nbddp.protocol.fit_options import FitConfig
from nbddp.worker.checkpoints import files as ckpt, snapshots
from nbddp.worker.data.datasets import SkipSampler, StridedSampler
from nbddp.worker.data.streams import LoadStates, RankShard, resumable
from nbddp.worker.strategies.ddp import DDPStrategy
from nbddp.worker.strategies.shards import restore_own, snapshot_own
from nbddp.worker.strategies.tensor import TensorParallelStrategy
from nbddp.worker.training import loop
from nbddp.worker.training.fit_state import TrainState

CPU = torch.device("cpu")


def _ddp() -> DDPStrategy:
    return DDPStrategy(CPU, nbddp.DDP())


def test_a_strategy_read_before_wrap_says_which_attribute_wrap_must_set():
    strategy = _ddp()
    with pytest.raises(RuntimeError, match=r"DDPStrategy\.module was read before DDPStrategy\.wrap\(model\) set it"):
        strategy.param_bytes()
    with pytest.raises(RuntimeError, match=r"DDPStrategy\.wrapped was read before .* must set both self\.module and "
                                           r"self\.wrapped"):
        strategy.parameters()


def test_a_wrapper_of_another_class_is_named_where_the_strategy_needs_its_own():
    strategy = _ddp()
    strategy.wrapped = strategy.module = nn.Linear(2, 2)
    with strategy.gradient_sync(True):  # syncing as usual needs nothing of the wrapper
        pass
    with pytest.raises(TypeError, match=r"DDPStrategy trains a DistributedDataParallel, but its wrap\(\) left a "
                                        r"Linear in self\.wrapped"):
        strategy.gradient_sync(False)


def test_restoring_replicated_weights_needs_rank_0s_copy():
    strategy = _ddp()
    strategy.wrapped = strategy.module = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"rank 0 holds the copy that every rank gets, but it was given None"):
        strategy.restore_weights(None, 0)


def test_restoring_a_shard_needs_this_ranks_own_snapshot():
    model = nn.Linear(2, 2)
    saved = snapshot_own(model)
    with torch.no_grad():
        model.weight.zero_()
    restore_own(model, saved)
    assert torch.equal(model.weight, saved["weight"])
    with pytest.raises(ValueError, match=r"restoring the weights of Linear: this rank .* was given None"):
        restore_own(model, None)


def test_a_model_parallel_strategy_needs_the_resolved_mesh():
    with pytest.raises(ValueError, match=r"TensorParallelStrategy splits the model over the fit's mesh "
                                         r"\(\{'dp': \.\.\., 'tp': \.\.\.\}.*but was given mesh=None"):
        TensorParallelStrategy.create(nbddp.TensorParallel(), CPU, "32-true", None)


def test_a_checkpoint_name_without_a_step_is_refused_naming_the_form(tmp_path):
    assert ckpt.step_of(str(tmp_path / "step-00000120.pt")) == 120 == ckpt.step_of(str(tmp_path / "step-00000120"))
    with pytest.raises(ValueError, match=r"'model\.pt' is not named as an nbddp checkpoint \(step-00000123\.pt"):
        ckpt.step_of("model.pt")


def test_numpys_random_state_is_saved_only_in_its_mt19937_form(monkeypatch):
    assert ckpt.rng_state()["numpy"][0] == "MT19937"
    monkeypatch.setattr(np.random, "get_state", lambda: {"bit_generator": "PCG64", "state": {}})
    with pytest.raises(RuntimeError, match=r"np\.random's global generator runs on PCG64, not MT19937"):
        ckpt.rng_state()


def test_snapshots_need_the_folder_the_kernel_makes():
    with pytest.raises(ValueError, match=r"snapshots need the folder the kernel makes for them \(cfg\.snapshot_dir\), "
                                         r"and this fit's is None"):
        snapshots.SnapshotClock(FitConfig(snapshot_every=2), CPU)


def test_a_relaunch_without_a_snapshot_folder_starts_afresh_across_hosts_too(monkeypatch):
    """It used to pass ``None`` on to the copy between hosts, which read it as a folder."""
    monkeypatch.setattr(snapshots.peer_copies, "spans_hosts", lambda placement: True)
    assert snapshots.relaunch_from(FitConfig(from_snapshot=True), _ddp(), 0, 2) is None


def test_a_stream_resumed_from_its_state_must_be_able_to_take_it():
    shard = RankShard(iter(range(4)), 0, 1)
    assert resumable(shard) is shard
    with pytest.raises(TypeError, match=r"the loader worker's dataset \(TensorDataset\) has no "
                                        r"state_dict\(\)/load_state_dict\(\)"):
        resumable(TensorDataset(torch.zeros(2)))


def test_loader_worker_states_are_loaded_in_loader_workers_only():
    with pytest.raises(RuntimeError, match=r"LoadStates is a DataLoader worker_init_fn: .* here get_worker_info\(\) "
                                           r"is None"):
        LoadStates({0: {}})(0)


def test_a_skipping_sampler_passes_the_epoch_on_to_a_sampler_that_takes_one():
    inner = DistributedSampler(TensorDataset(torch.arange(8)), num_replicas=2, rank=0, shuffle=True)
    SkipSampler(inner, 2).set_epoch(3)
    assert inner.epoch == 3
    SkipSampler(StridedSampler(8, 0, 2), 1).set_epoch(3)  # validation's order has no epochs: nothing to pass on


def test_an_optimizer_step_before_the_optimizer_exists_says_so():
    ts = TrainState(cfg=FitConfig(), rank=0, world=1, device=CPU, strategy=_ddp(), model=nn.Linear(2, 2),
                    loader=[], sampler=None, make_loader=list)
    with pytest.raises(RuntimeError, match=r"an optimizer step came before setup\.wrap_and_restore built"):
        loop.optimizer_step(ts)


def test_a_checkpoint_with_nowhere_to_go_is_refused_before_any_collective():
    ts = TrainState(cfg=FitConfig(), rank=0, world=1, device=CPU, strategy=_ddp(), model=nn.Linear(2, 2),
                    loader=[], sampler=None, make_loader=list, step=7)
    with pytest.raises(ValueError, match=r"a checkpoint was due at step 7, but neither checkpoint_dir nor the request "
                                         r"says where it goes"):
        loop.save_checkpoint(ts, 0)


def test_a_set_up_phase_returns_its_result_or_raises_on_every_rank(monkeypatch):
    peers: list[float] = [0.0]

    def all_reduce(flag, group=None):
        flag += peers[0]

    monkeypatch.setattr(loop.dist, "all_reduce", all_reduce)
    assert loop.agreed(lambda: ("ts", "parts"), CPU, "setup") == ("ts", "parts")
    with pytest.raises(KeyError, match="x"):  # this rank's own error
        loop.agreed(lambda: {}["x"], CPU, "setup")
    peers[0] = 1.0
    with pytest.raises(loop.PeerFailed, match=r"another rank failed during setup"):
        loop.agreed(lambda: 1, CPU, "setup")
