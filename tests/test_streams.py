"""Streams as data (issue 24): IterableDataset sharding, uneven ends that never hang, loader workers, resume.

Every batch carries the ids of its samples; the ``step_fn`` writes them to one
file per rank, so the tests see exactly which samples each rank trained on,
in which order. The sizes are the issue's own: 97 samples, batches of 8.
"""

from __future__ import annotations

import os
import sys
from collections import deque

import cloudpickle
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset

import nbddp
from nbddp.protocol.errors import WorkerError

cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.timeout(240)

D = 4


def sample(i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    x = torch.randn(D, generator=g)
    return x, x.sum(0, keepdim=True) * 0.5, torch.tensor(i)


class Stream(IterableDataset):
    """Samples 0..n-1 in order, read afresh at every pass; ``log`` lists every sample read, per process."""

    def __init__(self, n: int, log: str | None = None):
        self.n, self.log = n, log
        self.start = self.epoch = 0

    def set_epoch(self, epoch: int) -> None:  # nbddp calls it every epoch, in the loader workers too
        self.epoch = epoch

    def __iter__(self):
        start, self.start = self.start, 0
        for i in range(start, self.n):
            if self.log:
                with open(f"{self.log}-{os.getpid()}", "a") as f:
                    f.write(f"{self.epoch} {i}\n")
            self.pos = i + 1
            yield sample(i)


class StatefulStream(Stream):
    """A stream that can say where it stands and start there (the torchdata ``Stateful`` protocol)."""

    pos = 0

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.start = state["pos"]


class Uneven(IterableDataset):
    """Shards itself: rank 0 holds 5 samples, rank 1 holds 50."""

    shards_itself = True

    def __iter__(self):
        import torch.distributed as dist

        rank = dist.get_rank()
        for i in range(5 if rank == 0 else 50):
            yield sample(1000 * rank + i)


class EmptyOnRank1(IterableDataset):
    shards_itself = True

    def __iter__(self):
        import torch.distributed as dist

        if dist.get_rank() == 0:
            yield from (sample(i) for i in range(20))


def recorder(folder: str):
    """A step_fn that trains (x, y, ids) batches with MSE and writes each batch's ids, one line per step."""

    def step(model, batch):
        import torch.distributed as dist

        x, y, ids = batch
        with open(os.path.join(folder, f"ids-{dist.get_rank()}.txt"), "a") as f:
            f.write(" ".join(str(i) for i in ids.tolist()) + "\n")
        return F.mse_loss(model(x), y)

    return step


def mse_step(model, batch):
    return F.mse_loss(model(batch[0]), batch[1])


def read_ids(folder) -> dict[int, list[list[int]]]:
    out = {}
    for rank in (0, 1):
        path = os.path.join(folder, f"ids-{rank}.txt")
        with open(path) as f:
            out[rank] = [[int(i) for i in line.split()] for line in f if line.strip()]
        os.unlink(path)
    return out


def linear() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(D, 1)


FIT = dict(batch_size=8, live=False, log_every=1, optimizer=torch.optim.SGD, lr=0.05)


def test_97_samples_over_2_ranks_3_epochs_each_sample_once_every_rank_the_same_steps(workers, tmp_path):
    h = nbddp.dist_fit(linear(), Stream(97), epochs=3, step_fn=recorder(str(tmp_path)), **FIT)
    ids = read_ids(tmp_path)
    # rank 0 holds 49 samples (7 batches), rank 1 holds 48 (6): both stop at the 6th step of every epoch
    assert len(ids[0]) == len(ids[1]) == 18 and h.steps[-1]["step"] == 18
    for epoch in range(3):
        rows = ids[0][6 * epoch: 6 * epoch + 6] + ids[1][6 * epoch: 6 * epoch + 6]
        seen = [i for row in rows for i in row]
        assert len(seen) == len(set(seen)) == 96, "a sample was read twice in one epoch"
        assert all(i % 2 == 0 for row in ids[0][6 * epoch: 6 * epoch + 6] for i in row)  # rank-strided
    assert [e["samples_per_rank"] for e in h.epochs] == [[48, 48]] * 3
    assert [e["ended_on"] for e in h.epochs] == [[1]] * 3
    assert [r["samples"] for r in h.ranks] == [144, 144]
    assert h.timings["train_s"] < 15, "18 steps of a linear model: the ranks waited for each other"


def test_a_rank_with_5_samples_and_one_with_50_both_stop_at_the_same_step(workers, tmp_path):
    h = nbddp.dist_fit(linear(), Uneven(), epochs=2, step_fn=recorder(str(tmp_path)), **FIT)
    ids = read_ids(tmp_path)
    assert h.status == "completed" and h.steps[-1]["step"] == 2
    assert ids[0] == [[0, 1, 2, 3, 4]] * 2 and ids[1] == [list(range(1000, 1008))] * 2
    assert [e["samples_per_rank"] for e in h.epochs] == [[5, 8], [5, 8]]
    assert [e["ended_on"] for e in h.epochs] == [[0], [0]]


def test_max_steps_stops_a_stream_mid_epoch(workers, tmp_path):
    h = nbddp.dist_fit(linear(), Stream(97), epochs=3, max_steps=8, step_fn=recorder(str(tmp_path)), **FIT)
    ids = read_ids(tmp_path)
    assert h.status == "completed" and h.steps[-1]["step"] == 8 and len(ids[0]) == len(ids[1]) == 8
    assert len(h.epochs) == 1  # the second epoch was cut by max_steps: no record for it


def _loader_children() -> list[str]:
    """The engine's child processes, but multiprocessing's resource tracker and forkserver (one per engine, each
    ends with it)."""
    import psutil

    found = [" ".join(c.cmdline()) for c in psutil.Process().children(recursive=True)]
    return [cmd for cmd in found if "resource_tracker" not in cmd and "forkserver" not in cmd]


class WithPid(Stream):
    def __iter__(self):
        for x, y, i in super().__iter__():
            yield x, y, i, torch.tensor(os.getpid())


def test_two_loader_workers_split_each_ranks_share_and_persist_across_epochs(workers, tmp_path):
    pids_file = str(tmp_path / "pids")

    def step(model, batch):
        x, y, ids, pids = batch
        with open(pids_file, "a") as f:
            f.write(" ".join(str(p) for p in pids.tolist()) + "\n")
        return recorder(str(tmp_path))(model, (x, y, ids))

    before = nbddp.run(_loader_children)  # the engines' nannies
    h = nbddp.dist_fit(linear(), WithPid(97), epochs=2, step_fn=step, num_workers=2, **FIT)
    ids = read_ids(tmp_path)
    assert h.status == "completed" and len(ids[0]) == len(ids[1])
    steps = len(ids[0]) // 2
    for epoch in range(2):
        seen = [i for r in (0, 1) for row in ids[r][steps * epoch: steps * (epoch + 1)] for i in row]
        assert len(seen) == len(set(seen)) >= 80, "a sample was read twice in one epoch"
    with open(pids_file) as f:
        lines = [set(map(int, line.split())) for line in f]
    assert all(len(line) == 1 for line in lines), "a batch mixes samples of two loader workers"
    assert len(set().union(*lines)) == 4, "2 ranks x 2 persistent loader workers, the same in both epochs"
    assert nbddp.run(_loader_children) == before, "a loader worker outlived its fit"


def _reference_weights(windows: list[list[list[int]]]) -> torch.Tensor:
    """One process over the same global batches: each window's micro-batches (global ids), then a step."""
    model = linear()
    opt = torch.optim.SGD(model.parameters(), lr=FIT["lr"])
    for window in windows:
        for ids in window:
            x = torch.stack([sample(i)[0] for i in ids])
            y = torch.stack([sample(i)[1] for i in ids])
            (F.mse_loss(model(x), y) / len(window)).backward()
        opt.step()
        opt.zero_grad()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _global(batch: int) -> list[int]:
    """Global batch ``batch`` of a rank-strided stream on 2 ranks in batches of 8: rank 0's evens, rank 1's odds."""
    return list(range(16 * batch, 16 * batch + 16))


def _weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.parametrize("n, accum, steps", [(97, 1, 6), (80, 2, 3)], ids=["97-samples", "accum-2-short-last-window"])
def test_weights_equal_one_process_over_the_same_global_batches(workers, tmp_path, n, accum, steps):
    h = nbddp.dist_fit(linear(), Stream(n), epochs=1, grad_accum=accum, step_fn=recorder(str(tmp_path)), **FIT)
    read_ids(tmp_path)
    assert h.steps[-1]["step"] == steps
    batches = [_global(b) for b in range(n // 16)]
    windows = [batches[accum * s: accum * (s + 1)] for s in range(steps)]
    torch.testing.assert_close(_weights(h.model), _reference_weights(windows), atol=1e-6, rtol=1e-5)


def _first_reads(prefix: str) -> dict[int, list[int]]:
    """Epoch -> the first sample each process read in it (every reader reads the whole stream, keeps its part)."""
    found: dict[int, list[int]] = {}
    folder, stem = os.path.split(prefix)
    for name in sorted(os.listdir(folder)):
        if name.startswith(stem + "-"):
            with open(os.path.join(folder, name)) as f:
                reads = [tuple(map(int, line.split())) for line in f]
            for epoch in sorted({e for e, _ in reads}):
                found.setdefault(epoch, []).append(next(i for e, i in reads if e == epoch))
            os.unlink(os.path.join(folder, name))
    return {epoch: sorted(firsts) for epoch, firsts in found.items()}


@pytest.mark.parametrize("kind", ["skip", "state"])
def test_resume_mid_epoch_continues_after_the_last_checkpointed_sample(workers, tmp_path, kind):
    cls = StatefulStream if kind == "state" else Stream
    log = str(tmp_path / "read")
    fit = dict(epochs=2, step_fn=recorder(str(tmp_path)), **FIT)
    ckpt = tmp_path / "ckpt"
    nbddp.dist_fit(linear(), cls(97), max_steps=4, checkpoint_dir=ckpt, **fit)  # stops at step 4 of 6
    read_ids(tmp_path)
    state = torch.load(ckpt / "step-00000004.pt", weights_only=True)  # plain torch, no nbddp classes
    assert [p["samples"] for p in state["stream_per_rank"]] == [32, 32]
    assert [p["batches"] for p in state["stream_per_rank"]] == [4, 4]
    assert all(bool(p["states"]) == (kind == "state") for p in state["stream_per_rank"])
    resumed = nbddp.dist_fit(linear(), cls(97, log=log), checkpoint_dir=ckpt, resume=True, **fit)
    ids = read_ids(tmp_path)
    rest = [4, 5, 0, 1, 2, 3, 4, 5]  # the global batches after the checkpoint: epoch 0's last two, then epoch 1
    assert ids == {r: [_global(b)[r::2] for b in rest] for r in (0, 1)}, "the resume did not continue where it stopped"
    # the first epoch's rest: read again from the start and skipped, or started from the dataset's state
    # (rank 0 stopped after sample 62, rank 1 after 63)
    assert _first_reads(log) == {0: [0, 0] if kind == "skip" else [63, 64], 1: [0, 0]}
    assert resumed.epochs[0]["samples_per_rank"] == [48, 48]
    expected = _reference_weights([[_global(b)] for b in [0, 1, 2, 3, *rest]])
    torch.testing.assert_close(_weights(resumed.model), expected, atol=1e-6, rtol=1e-5)


def _round_robin(rank: int, n: int = 97, workers: int = 2) -> list[list[int]]:
    """The batches of a rank-strided stream as a loader hands them out: worker 0's, worker 1's, ... in turn."""
    parts = [[i for i in range(n) if i % (2 * workers) == rank * workers + w] for w in range(workers)]
    chunks = [[part[k:k + 8] for k in range(0, len(part), 8)] for part in parts]
    order = []
    while any(chunks):
        order += [c.pop(0) for c in chunks if c]
    return order


def test_resume_with_loader_workers_continues_each_worker_in_the_uninterrupted_order(workers, tmp_path):
    fit = dict(epochs=2, num_workers=2, step_fn=recorder(str(tmp_path)), **FIT)
    ckpt = tmp_path / "ckpt"
    nbddp.dist_fit(linear(), StatefulStream(97), max_steps=3, checkpoint_dir=ckpt, **fit)  # odd: worker 1's turn
    before = read_ids(tmp_path)
    saved = torch.load(ckpt / "step-00000003.pt", weights_only=True)["stream_per_rank"]
    assert all(sorted(p["states"]) == [0, 1] and p["next_worker"] == 1 for p in saved)
    log = str(tmp_path / "read")
    nbddp.dist_fit(linear(), StatefulStream(97, log=log), checkpoint_dir=ckpt, resume=True, **fit)
    after = read_ids(tmp_path)
    firsts = _first_reads(log)
    assert len(firsts[0]) == 4 and min(firsts[0]) > 0, "a loader worker read its part again from the start"
    assert firsts[1] == [0, 0, 0, 0], "the next epoch's workers start afresh (and saw set_epoch(1))"
    for r in (0, 1):
        epoch = _round_robin(r)[:6]  # rank 0 holds 7 batches, rank 1 six: every epoch ends at the 6th
        assert before[r] == epoch[:3] and after[r] == epoch[3:] + epoch


def test_validation_on_an_uneven_stream_is_exact_under_fsdp(workers):
    val = Stream(13)  # 7 samples on rank 0, 6 on rank 1: batches of 8 and 6, forwards in lockstep
    h = nbddp.dist_fit(linear(), Stream(64), val_data=val, epochs=1, strategy="fsdp",
                       step_fn=mse_step, **FIT)
    model = h.model
    with torch.no_grad():
        xs = torch.stack([sample(i)[0] for i in range(13)])
        ys = torch.stack([sample(i)[1] for i in range(13)])
        expected = F.mse_loss(model(xs), ys).item()
    assert h.epochs[0]["val_loss"] == pytest.approx(expected, rel=1e-5)


def test_a_stream_empty_on_one_rank_is_an_error_naming_it_not_a_hang(workers):
    with pytest.raises(WorkerError, match=r"rank 1 got no sample in epoch 0: its share of the stream is empty"):
        nbddp.dist_fit(linear(), EmptyOnRank1(), **FIT)
    assert nbddp.run(lambda: 1) == [1, 1]


class NotData:
    pass


def test_data_of_no_accepted_form_names_the_forms(workers):
    forms = (r"must be a map-style Dataset .*an IterableDataset .*a DataLoader over either, a tuple of tensors .* or "
             r"a zero-argument function that builds one of these on each worker; got ")
    sent = len(workers.client.history)
    for bad, got in [(NotData(), "NotData$"), ({"x": torch.zeros(3)}, "dict$"),
                     (iter([1, 2]), r"list_iterator\. An iterator or generator can be read only once")]:
        with pytest.raises(TypeError, match=forms + got):
            nbddp.dist_fit(linear(), bad, live=False)
    assert len(workers.client.history) == sent, "a task reached the workers before the error"


@pytest.mark.heavy
def test_a_notebook_class_reaches_loader_workers_started_by_a_forkserver(workers):
    """Under CUDA the loader workers come from a forkserver: a class defined in a cell must reach them by value.

    Heavy: each worker starts a forkserver and loader processes, which import torch."""
    def from_forkserver():
        from nbddp.worker.data import loaders
        from nbddp.worker.data import streams
        from nbddp.protocol.data_forms import DataSpec
        from nbddp.fit.option_checks import make_config

        import torch.distributed as dist

        default = loaders.start_method
        torch.multiprocessing.get_context("forkserver").set_forkserver_preload(["torch"])
        loaders.start_method = lambda: "forkserver"  # as once CUDA is initialised
        try:
            cfg = make_config(batch_size=4, num_workers=1)
            s = streams.train_stream(Stream(20), DataSpec(stream=True), cfg, dist.get_rank(), 2, torch.device("cpu"),
                                     None)
            return [i for batch, _ in s.loader for i in batch[2].tolist()]
        finally:
            loaders.start_method = default
            streams.release(None)

    before = nbddp.run(_loader_children)
    got = nbddp.run(from_forkserver)
    assert got == [list(range(0, 20, 2)), list(range(1, 20, 2))]
    assert nbddp.run(_loader_children) == before


def test_a_dataloader_over_a_stream_keeps_its_batch_size_and_collate(workers, tmp_path):
    def collate(samples):
        x, y, i = zip(*samples)
        return torch.stack(x), torch.stack(y), torch.stack(i)

    h = nbddp.dist_fit(linear(), DataLoader(Stream(40), batch_size=5, collate_fn=collate), step_fn=recorder(str(tmp_path)),
                       live=False)
    ids = read_ids(tmp_path)
    assert h.batch_size == 5 and ids[0] == [[0, 2, 4, 6, 8], [10, 12, 14, 16, 18], [20, 22, 24, 26, 28],
                                            [30, 32, 34, 36, 38]]
    # batch_size=None: a stream that yields whole batches (here of 6) has them trained as they come
    h = nbddp.dist_fit(linear(), DataLoader(Batches(), batch_size=None), step_fn=recorder(str(tmp_path)), live=False)
    ids = read_ids(tmp_path)
    assert ids[0] == [list(range(0, 6)), list(range(12, 18))] and ids[1] == [list(range(6, 12)), list(range(18, 24))]


class Batches(IterableDataset):
    def __iter__(self):
        for b in range(4):
            rows = [sample(i) for i in range(6 * b, 6 * b + 6)]
            yield tuple(torch.stack(part) for part in zip(*rows))


def test_an_empty_validation_stream_is_an_error_on_every_rank(workers):
    with pytest.raises(WorkerError, match=r"val_data yielded no sample on any rank"):
        nbddp.dist_fit(linear(), Stream(32), val_data=Stream(0), step_fn=mse_step,
                       **FIT)
    assert nbddp.run(lambda: 1) == [1, 1]


def test_the_planners_refuse_a_stream_before_any_collective(workers):
    with pytest.raises(WorkerError, match=r"find_batch_size and scaling_report replay the same batches"):
        nbddp.find_batch_size(linear(), Stream(64), step_fn=mse_step)
    assert nbddp.run(lambda: 1) == [1, 1]


# --- the agreement, without workers: a peer rank played by a list of what it holds -----------------------------


class Peer:
    """``Agreement`` for rank 0 of 2, whose peer holds ``peer`` batches per epoch."""

    def __init__(self, peer: int):
        self.peer, self.asked = peer, 0

    def launch(self, state: int):
        self.asked += 1
        return [state, 1 if self.asked <= self.peer else 0]

    def wait(self, pending):
        return pending


def _items(n: int):
    return iter([((torch.zeros(8, D), torch.zeros(8, 1), torch.arange(8) + 8 * b), (0, None)) for b in range(n)])


def test_the_feed_hands_out_what_every_rank_holds_and_knows_the_end_a_window_ahead():
    for mine, peer, accum in [(7, 6, 1), (3, 9, 1), (5, 5, 2), (6, 4, 4)]:
        _check_feed(mine, peer, accum)


def _check_feed(mine: int, peer: int, accum: int) -> None:
    from nbddp.worker.data.batch_agreement import UNKNOWN, EpochFeed

    feed = EpochFeed(_items(mine), Peer(peer), epoch=0, accum=accum)
    known = []
    for i, _ in enumerate(feed):
        window_end = min(i - i % accum + accum, min(mine, peer)) - 1
        known.append(feed.batches_per_epoch if window_end >= min(mine, peer) - 1 else UNKNOWN)
        assert feed.batches_per_epoch in (UNKNOWN, min(mine, peer))
    assert len(known) == min(mine, peer) and known[-1] == min(mine, peer)
    # by the first micro-batch of the last window, its length is known
    last_window = (min(mine, peer) - 1) // accum * accum
    assert known[last_window] == min(mine, peer)
    assert feed.ended_on == ([0] if mine < peer else [1] if peer < mine else [0, 1])
    assert feed.samples == 8 * min(mine, peer) and not feed.pending


def test_an_empty_share_names_the_rank():
    from nbddp.worker.data.batch_agreement import EmptyShard, EpochFeed, lockstep

    with pytest.raises(EmptyShard, match=r"the training data: rank 0 got no sample in epoch 2: its share of the stream "
                                         r"is empty while rank 1 has data"):
        next(EpochFeed(_items(0), Peer(3), epoch=2))
    with pytest.raises(EmptyShard, match=r"val_data \(validated in lockstep under a sharded strategy\): rank 0 got no "
                                         r"sample in epoch 0"):
        list(lockstep([], Peer(2), 0))
    assert [counted for _, counted in lockstep([1, 2], Peer(4), 0)] == [True, True, False, False]


def test_a_rank_whose_data_fails_raises_it_and_the_others_learn_it_at_the_same_batch():
    from nbddp.worker.data.batch_agreement import Agreement, EpochFeed, PeerFailed

    def broken():
        yield from _items(2)
        raise OSError("disk gone")

    feed = EpochFeed(broken(), Peer(9), epoch=0)
    with pytest.raises(OSError, match="disk gone"):
        list(feed)
    assert feed.pending == deque() and feed.next_index == 1  # told the peer (FAILED) before raising
    with pytest.raises(PeerFailed, match=r"rank 1 failed reading its data"):
        Agreement(0, 2).wait((None, torch.tensor([1.0, 2.0])))


class FailsOnRank1(IterableDataset):
    shards_itself = True

    def __iter__(self):
        import torch.distributed as dist

        for i in range(40):
            if dist.get_rank() == 1 and i == 20:
                raise OSError(f"cannot read shard file {i}")
            yield sample(i)


def test_a_failing_data_pipeline_fails_every_rank_together_none_stuck(workers):
    generation = workers.generation
    with pytest.raises(WorkerError, match=r"rank 1.*OSError: cannot read shard file 20") as info:
        nbddp.dist_fit(linear(), FailsOnRank1(), step_fn=mse_step, **FIT)
    assert not info.value.note, f"a rank was stuck instead of failing with its peer: {info.value.note}"
    assert workers.generation == generation, "the workers had to be replaced"
    assert nbddp.run(lambda: 1) == [1, 1]


def test_a_mid_epoch_checkpoint_read_with_other_loader_workers_is_refused():
    from nbddp.fit.option_checks import make_config
    from nbddp.worker.data.batch_agreement import Agreement
    from nbddp.protocol.data_forms import DataSpec
    from nbddp.worker.data.streams import Stream as RankStream

    cfg = make_config(batch_size=8, num_workers=0)
    stream = RankStream(Stream(20), DataSpec(stream=True), cfg, 0, 2, torch.device("cpu"), Agreement(0, 2))
    saved = {"batches_done": 3, "stream_per_rank": [{"num_workers": 2, "samples": 24, "states": None}] * 2}
    with pytest.raises(ValueError, match=r"resume='ck': that checkpoint was saved mid-epoch reading the stream with "
                                         r"num_workers=2, and this fit reads it with num_workers=0.*Resume with "
                                         r"num_workers=2"):
        stream.restore(saved, "ck")
    stream.restore({"batches_done": 0, "stream_per_rank": saved["stream_per_rank"]}, "ck")  # an epoch end: fine


def test_the_live_view_shows_a_streams_unknown_total_then_an_estimate():
    from types import SimpleNamespace

    from nbddp.fit.history import History
    from nbddp.live.state import LiveState
    from nbddp.live.text import progress_line
    from nbddp.live.widget import progress_text
    from nbddp.live.text import progress_fields
    from nbddp.protocol.messages import FitPlanInfo

    plan = FitPlanInfo(total_steps=None, steps_per_epoch=None, start_step=0, batch_size=8)
    run = SimpleNamespace(live_state=LiveState(status="training", world_size=2, epochs=3, plan=plan),
                          history=History(), finished=False, started_at=None)
    run.history.add("step", {"step": 4, "epoch": 0, "loss": 1.0, "lr": 0.1, "samples_per_s": 10.0, "time": 2.0})
    assert "step 4/? " in progress_line(run) and "ETA" not in progress_line(run)
    run.history.add("epoch", {"epoch": 0, "step": 6, "loss": 1.0})
    run.history.add("step", {"step": 8, "epoch": 1, "loss": 0.9, "lr": 0.1, "samples_per_s": 10.0, "time": 4.0})
    assert "step 8/~18 " in progress_line(run) and "(ETA 0:05)" in progress_line(run)
    assert progress_text(progress_fields(run)).startswith("step 8/~18 ·")
    run.live_state.status, run.finished = "completed", True
    assert "step 8/8 " in progress_line(run)


class Squares(torch.utils.data.Dataset):
    """A map-style dataset defined here (a notebook cell's class, for the workers)."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int):
        x, y, _ = sample(i)
        return x, y


@pytest.mark.requires_gpu
def test_loader_workers_come_from_a_forkserver_once_cuda_is_up_and_notebook_classes_reach_them(gpu_workers,
                                                                                               tmp_path):
    """On GPU workers CUDA is initialised before the loaders start: forking the engine then would break."""
    h = nbddp.dist_fit(linear(), Stream(97), epochs=2, num_workers=2, step_fn=recorder(str(tmp_path)), **FIT)
    assert h.status == "completed" and h.steps[-1]["step"] > 0

    def method():
        from nbddp.worker.data import loaders
        return loaders.start_method()

    assert set(nbddp.run(method)) == {"forkserver"}
    h = nbddp.dist_fit(linear(), Squares(), epochs=2, num_workers=2, loss_fn=F.mse_loss, **FIT)
    assert h.epochs[-1]["loss"] < h.epochs[0]["loss"]
