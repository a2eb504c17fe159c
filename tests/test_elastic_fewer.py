"""``dist_fit(min_workers=...)`` (issue 33, item 7): an elastic fit going on with fewer ranks, its batch kept.

The checks and the rules run in the kernel alone; how the epoch's batches are
dealt to fewer ranks is checked here on the samplers themselves; one fit on
the warm workers shows the worker's own refusal. The fault tests (a rank
lost with no replacement) are in ``test_elastic.py``, beside the unbroken
reference fit they compare with.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DistributedSampler, IterableDataset, TensorDataset

import nbddp
from elastic_kit import FakeRun
from faultkit import Net
from nbddp.elastic.fewer_ranks import check_min_workers, go_on, going_on_with, reason
from nbddp.protocol.errors import ClusterError, RankFailure, WorkerError
from nbddp.protocol.fit_options import FitConfig
from nbddp.worker.data.datasets import SkipSampler
from nbddp.worker.data.fewer_ranks import SlotBatches, slot_batches, slots_of, train_loader


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(min_workers="1"), TypeError, r"min_workers=\.\.\.\) must be an int .*got str '1'"),
    (dict(min_workers=True), TypeError, r"must be an int .*got bool True"),
    (dict(min_workers=0), ValueError, r"min_workers=0\): a fit needs at least 1 rank; give 1 to 2"),
    (dict(min_workers=3), ValueError, r"min_workers=3\) is above the 2 workers running; .*nbddp.start\(n=3\)"),
    (dict(max_restarts=0), ValueError, r"min_workers=1\) takes effect only .*max_restarts=N"),
    (dict(strategy=nbddp.Pipeline(stages=2)), ValueError,
     r"strategy=Pipeline\(\.\.\.\)\): going on with fewer ranks is built for strategy='ddp'.* and 'fsdp'"),
    (dict(stream=True), ValueError, r"min_workers=\.\.\.\) needs map-style data"),
    (dict(world=3, min_workers=2), ValueError, r"min_workers=2\) with 3 workers: .*divides 3.*min_workers=1"),
])
def test_bad_min_workers_are_named_with_the_fix(kwargs, error, match):
    args = {"min_workers": 1, "max_restarts": 1, "world": 2, "strategy": "ddp", "stream": False, **kwargs}
    with pytest.raises(error, match=match):
        check_min_workers(args["min_workers"], args["max_restarts"], args["world"], args["strategy"], args["stream"])


def test_min_workers_as_many_as_the_workers_or_left_out_never_goes_on_with_fewer():
    assert check_min_workers(None, 0, 2, "fsdp", True) is None
    assert check_min_workers(2, 1, 2, "ddp", False) == 2 and check_min_workers(1, 1, 2, nbddp.DDP(), False) == 1
    assert check_min_workers(1, 1, 2, "fsdp", False) == 1 and check_min_workers(1, 1, 2, nbddp.FSDP(), False) == 1
    assert going_on_with(2, 1, 2) == 0


@pytest.mark.parametrize("data_world, alive, minimum, world", [
    (2, 1, 1, 1), (4, 3, 1, 2), (4, 3, 2, 2), (4, 3, 3, 0), (4, 2, 2, 2), (6, 5, 1, 3), (3, 2, 1, 1), (4, 0, 1, 0)])
def test_the_fit_goes_on_with_the_most_survivors_that_divide_the_world_it_began_with(data_world, alive, minimum,
                                                                                      world):
    assert going_on_with(data_world, alive, minimum) == world


def test_the_live_line_gives_the_heals_error_in_a_few_words():
    failed = ClusterError("replacing failed workers did not work: ...")
    failed.__cause__ = ClusterError("1 engine(s) of this attached cluster died and no replacement registered "
                                    "within 1 s; nbddp cannot start engines on a cluster it did not start")
    assert reason(failed) == "1 engine(s) of this attached cluster died and no replacement registered within 1 s"


def _steps(batches: list[list[int]], per_step: int) -> list[set[int]]:
    return [set(sum(batches[i:i + per_step], [])) for i in range(0, len(batches), per_step)]


@pytest.mark.parametrize("n, data_world, world, accum, batch", [
    (64, 2, 1, 1, 8), (70, 4, 2, 2, 4), (70, 4, 1, 3, 5), (50, 6, 3, 1, 3)])
def test_fewer_ranks_take_each_step_the_very_batches_of_every_original_rank(n, data_world, world, accum, batch):
    ds = TensorDataset(torch.arange(n))
    old = [list(DistributedSampler(ds, data_world, r, shuffle=True, seed=5)) for r in range(data_world)]
    old = [[s[i:i + batch] for i in range(0, len(s), batch)] for s in old]  # each original rank's batches
    per_rank = len(old[0])
    want = []  # the original steps: every rank's window of batches (the last window may be shorter)
    for start in range(0, per_rank, accum):
        want.append(sorted(tuple(b) for r in range(data_world) for b in old[r][start:start + accum]))
    q = data_world // world
    got = [[] for _ in want]
    for rank in range(world):
        samplers = [DistributedSampler(ds, data_world, slot, shuffle=True, seed=5)
                    for slot in slots_of(rank, world, data_world)]
        mine = list(SlotBatches(samplers, batch, accum, drop_last=False))
        assert len(mine) == len(SlotBatches(samplers, batch, accum, drop_last=False)) == q * per_rank
        start = 0
        for step, expected in enumerate(want):
            window = len(expected) // data_world * q  # the loop's window on this rank: accum x q, or what is left
            got[step] += [tuple(b) for b in mine[start:start + window]]
            start += window
    assert [sorted(g) for g in got] == want


def test_a_position_in_the_epoch_is_carried_over_in_the_original_ranks_batches():
    ds = TensorDataset(torch.arange(64))
    samplers = [DistributedSampler(ds, 4, slot, seed=1) for slot in (0, 1)]
    whole = list(SlotBatches(samplers, 4, 2, drop_last=False))
    # 3 steps of 2 micro-batches done on 4 ranks = 6 batches per original rank = 12 micro-batches here
    assert slot_batches(6, 4, 4) == 6 and slot_batches(12, 2, 4) == 6 and slot_batches(24, 1, 4) == 6
    assert list(SlotBatches(samplers, 4, 2, drop_last=False, skip=12)) == whole[12:]
    cfg = SimpleNamespace(data_world=4, grad_accum=4, batch_size=4, seed=1, shuffle=True, drop_last=False,
                          num_workers=0, pin_memory=False)
    spec = SimpleNamespace(sampler=None, loader=None, collate_fn=None)
    loader, sampler, make = train_loader(ds, spec, cfg, 0, 2, torch.device("cpu"))
    assert len(loader) == 8 and [b[0].tolist() for b in loader] == [[ds[i][0].item() for i in b] for b in whole]
    resumed = make(SkipSampler(sampler, 6 * 4))  # the loop's resume: first batch index x batch_size
    assert [b[0].tolist() for b in resumed] == [[ds[i][0].item() for i in b] for b in whole[6:]]


class _Numbers(IterableDataset):
    def __iter__(self):
        for i in range(64):
            yield torch.full((8,), float(i)), torch.zeros(1)


@pytest.mark.heavy
def test_a_stream_made_on_the_workers_is_refused_there_naming_min_workers(workers):
    """Heavy: an elastic fit starts the warm spare engine, which imports torch and nbddp's training code (about 10 s)."""
    with pytest.raises(WorkerError, match=r"min_workers=\.\.\.\) needs map-style data.*\(_Numbers\)"):
        nbddp.dist_fit(Net(), _Numbers, batch_size=8, max_steps=2, live=False, max_restarts=1, min_workers=1)


def _run(world: int, alive: list[int], closing: bool = False) -> FakeRun:
    formed = []
    session = SimpleNamespace(world_size=world, workers=SimpleNamespace(ids=alive),
                              supervisor=SimpleNamespace(closing=closing, regrow_to=None),
                              form_group=lambda reprobe, engines: formed.append(engines))
    run = FakeRun(session, FitConfig(grad_accum=3, data_world=4), restarts=["rank 1 lost ..."], world_size=world)
    run.formed = formed
    return run


def test_a_heal_that_failed_with_every_worker_there_or_while_stopping_is_not_a_reason_to_go_on_with_fewer():
    recovery = SimpleNamespace(policy=SimpleNamespace(min_workers=1))
    lost, failed = WorkerError(RankFailure(1, "WorkerDied", "died")), ClusterError("joining the group timed out")
    for run in (_run(4, [0, 1, 2, 3]), _run(4, [0, 1, 2], closing=True)):
        with pytest.raises(ClusterError, match="joining the group timed out"):
            go_on(recovery, run, lost, failed, {})
        assert run.formed == [] and run.config.grad_accum == 3


def test_three_survivors_of_four_go_on_as_two_ranks_accumulating_twice_as_much():
    run = _run(4, [0, 2, 3])
    event = {"rank": 1, "step_lost_at": 40, "cause": "killed by signal 9 (SIGKILL)"}
    go_on(SimpleNamespace(policy=SimpleNamespace(min_workers=2)), run, WorkerError(RankFailure(1, "WorkerDied", "died")),
          ClusterError("an engine did not start; the launcher failed"), event)
    assert run.formed == [[0, 2]] and run.config.grad_accum == 6 and run.config.data_world == 4
    assert run.restarts == ["rank 1 lost at step 40 (killed by signal 9 (SIGKILL)); no replacement could "
                                       "start (an engine did not start); going on with 2 of 4 ranks, accumulating 6 "
                                       "batches per step"]
