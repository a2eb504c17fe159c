"""Streams as data (issue 24): IterableDataset sharding, uneven ends that never hang, loader workers, resume.

Every batch carries the ids of its samples; the ``step_fn`` writes them to one
file per rank, so the tests see exactly which samples each rank trained on,
in which order. The sizes are the issue's own: 97 samples, batches of 8.
"""

from __future__ import annotations

import os
import sys

import cloudpickle
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset

import nbddp
from nbddp.errors import WorkerError

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
        self.start = 0

    def __iter__(self):
        start, self.start = self.start, 0
        for i in range(start, self.n):
            if self.log:
                with open(f"{self.log}-{os.getpid()}", "a") as f:
                    f.write(f"{i}\n")
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
    """The engine's child processes, but multiprocessing's resource tracker (one per process, ends with it)."""
    import psutil

    found = [" ".join(c.cmdline()) for c in psutil.Process().children(recursive=True)]
    return [cmd for cmd in found if "resource_tracker" not in cmd]


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


def _reference_weights(n: int, accum: int, steps: int) -> torch.Tensor:
    """One process over the same global batches: step k trains samples 16k..16k+15 (rank 0's evens, rank 1's odds)."""
    model = linear()
    opt = torch.optim.SGD(model.parameters(), lr=FIT["lr"])
    batches = [list(range(16 * b, 16 * b + 16)) for b in range(n // 16)]
    for s in range(steps):
        window = batches[accum * s: accum * (s + 1)]
        for ids in window:
            x = torch.stack([sample(i)[0] for i in ids])
            y = torch.stack([sample(i)[1] for i in ids])
            (F.mse_loss(model(x), y) / len(window)).backward()
        opt.step()
        opt.zero_grad()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.parametrize("n, accum, steps", [(97, 1, 6), (80, 2, 3)], ids=["97-samples", "accum-2-short-last-window"])
def test_weights_equal_one_process_over_the_same_global_batches(workers, tmp_path, n, accum, steps):
    h = nbddp.dist_fit(linear(), Stream(n), epochs=1, grad_accum=accum, step_fn=recorder(str(tmp_path)), **FIT)
    read_ids(tmp_path)
    assert h.steps[-1]["step"] == steps
    got = torch.cat([p.detach().flatten() for p in h.model.parameters()])
    torch.testing.assert_close(got, _reference_weights(n, accum, steps), atol=1e-6, rtol=1e-5)


def _first_reads(prefix: str) -> list[int]:
    """The first sample each process read (every rank reads the whole stream and keeps its part)."""
    found = []
    folder, stem = os.path.split(prefix)
    for name in sorted(os.listdir(folder)):
        if name.startswith(stem + "-"):
            with open(os.path.join(folder, name)) as f:
                found.append(int(f.readline()))
            os.unlink(os.path.join(folder, name))
    return sorted(found)


@pytest.mark.parametrize("kind", ["skip", "state"])
def test_resume_mid_epoch_continues_after_the_last_checkpointed_sample(workers, tmp_path, kind):
    cls = StatefulStream if kind == "state" else Stream
    log = str(tmp_path / "read")
    fit = dict(epochs=2, step_fn=recorder(str(tmp_path)), **FIT)
    straight = nbddp.dist_fit(linear(), cls(97), **fit)
    straight_ids = read_ids(tmp_path)
    ckpt = tmp_path / "ckpt"
    nbddp.dist_fit(linear(), cls(97), max_steps=4, checkpoint_dir=ckpt, **fit)  # stops at step 4 of 6
    read_ids(tmp_path)
    state = torch.load(ckpt / "step-00000004.pt", weights_only=True)  # plain torch, no nbddp classes
    assert [p["samples"] for p in state["stream_per_rank"]] == [32, 32]
    assert [p["batches"] for p in state["stream_per_rank"]] == [4, 4]
    resumed = nbddp.dist_fit(linear(), cls(97, log=log), checkpoint_dir=ckpt, resume=True, **fit)
    ids = read_ids(tmp_path)
    for r in (0, 1):
        assert ids[r] == straight_ids[r][4:], "the resumed fit did not continue with the next sample"
    # the first epoch's rest: read again from the start and skipped, or started from the dataset's state
    # (rank 0 stopped after sample 62, rank 1 after 63)
    assert _first_reads(log) == ([0, 0] if kind == "skip" else [63, 64])
    assert resumed.epochs[0]["samples_per_rank"] == [48, 48]
    torch.testing.assert_close(list(resumed.model.parameters())[0], list(straight.model.parameters())[0],
                               atol=1e-6, rtol=1e-5)


def test_validation_on_an_uneven_stream_is_exact_under_fsdp(workers):
    val = Stream(13)  # 7 samples on rank 0, 6 on rank 1: batches of 8 and 6, forwards in lockstep
    h = nbddp.dist_fit(linear(), Stream(64), val_data=val, epochs=1, strategy="fsdp",
                       step_fn=lambda model, b: F.mse_loss(model(b[0]), b[1]), **FIT)
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


@pytest.mark.parametrize("bad", [NotData(), iter([1, 2]), {"x": torch.zeros(3)}],
                         ids=["an object", "an iterator", "a dict"])
def test_data_of_no_accepted_form_names_the_forms(workers, bad):
    with pytest.raises(TypeError, match=r"must be a map-style Dataset .*an IterableDataset .*a DataLoader over "
                                        r"either, a tuple of tensors .* or a zero-argument function"):
        nbddp.dist_fit(linear(), bad, live=False)


def test_a_notebook_class_reaches_spawned_loader_workers(workers):
    """Under CUDA the loader workers are spawned: a class defined in a cell must reach them by value."""
    def spawned():
        from nbddp.worker import loaders, streams
        from nbddp.worker.data import DataSpec
        from nbddp.options import make_config

        import torch.distributed as dist

        default, loaders.start_method = loaders.start_method, lambda: "spawn"  # as once CUDA is initialised
        try:
            cfg = make_config(batch_size=4, num_workers=1)
            s = streams.train_stream(Stream(20), DataSpec(stream=True), cfg, dist.get_rank(), 2, torch.device("cpu"),
                                     None)
            return [i for batch, _ in s.loader for i in batch[2].tolist()]
        finally:
            loaders.start_method = default
            streams.release(None)

    before = nbddp.run(_loader_children)
    got = nbddp.run(spawned)
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
