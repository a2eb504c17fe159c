"""Is another GPU worth it: a batch-size finder every rank agrees on, and a scaling report (2 CPU workers)."""

from __future__ import annotations

import hashlib

import pytest
import torch
import torch.nn as nn

import nbddp
from nbddp.measure.scaling import ScalingReport, recommend, world_sizes
from nbddp.worker.tasks.trials import is_out_of_memory

pytestmark = pytest.mark.timeout(300)

LIMITS = {0: 24, 1: 40}  # the largest batch each rank "has memory for"


class Limited(nn.Module):
    """Runs out of memory above a different batch size on each rank, as a GPU with less free memory would."""

    def __init__(self, limits=None, error: str = "oom"):
        super().__init__()
        self.lin = nn.Linear(8, 2)
        self.limits = limits or LIMITS
        self.error = error

    def forward(self, x):
        import torch.distributed as dist

        if self.error == "bug":
            raise KeyError("'labels' (a bug that no batch size fixes)")
        if x.shape[0] > self.limits[dist.get_rank()]:
            if self.error == "allocator":
                raise RuntimeError(f"[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: not enough memory: "
                                   f"you tried to allocate {x.shape[0]} bytes")
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {x.shape[0]} GiB (a test)")
        return self.lin(x)


def data(n: int = 256):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 8, generator=g), torch.randint(0, 2, (n,), generator=g)


def _rng_digest():
    import numpy as np

    return hashlib.sha256(torch.get_rng_state().numpy().tobytes() + repr(np.random.get_state()[2]).encode()).hexdigest()


def test_the_finder_returns_the_largest_batch_that_fits_on_every_rank(workers, capsys):
    model = Limited()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng, generation = nbddp.run(_rng_digest), workers.generation
    assert nbddp.find_batch_size(model, data()) == 24
    printed = capsys.readouterr().out
    assert "batch size 16 per rank ... fits" in printed
    assert "batch size 32 per rank ... out of memory on rank 0 (OutOfMemoryError: CUDA out of memory" in printed
    # no side effects: the notebook's model, the workers' RNG and their group are as they were
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert nbddp.run(_rng_digest) == rng and workers.generation == generation
    assert nbddp.dist_fit(model, data(), batch_size=24, live=False).status == "completed"


def test_batch_size_auto_runs_the_finder_and_history_records_the_size(workers):
    h = nbddp.dist_fit(Limited(), data(), batch_size="auto", live=False)
    assert h.batch_size == 24 and h.status == "completed"
    assert h.steps[-1]["step"] == -(-128 // 24)  # 128 samples per rank in batches of 24
    assert nbddp.dist_fit(Limited(), data(), batch_size=8, live=False).batch_size == 8


def test_the_search_stays_inside_the_shard_and_max_batch_size(workers):
    roomy = {0: 10_000, 1: 10_000}
    assert nbddp.find_batch_size(Limited(roomy), data(), max_batch_size=10) == 10
    assert nbddp.find_batch_size(Limited(roomy), data(200)) == 100  # the shard: 200 samples over 2 ranks
    assert nbddp.find_batch_size(Limited({0: 37, 1: 90}, "allocator"), data(), start=16) == 37


def test_a_factory_dataset_learns_its_bound_from_the_workers(workers):
    roomy = {0: 10_000, 1: 10_000}
    assert nbddp.find_batch_size(Limited(roomy), lambda: torch.utils.data.TensorDataset(*data(64))) == 32


def test_what_no_batch_size_fixes_is_raised_not_searched(workers, capsys):
    with pytest.raises(nbddp.WorkerError, match=r"KeyError: .*'labels' \(a bug that no batch size fixes\)"):
        nbddp.find_batch_size(Limited(error="bug"), data())
    assert "batch size 2" not in capsys.readouterr().out
    with pytest.raises(nbddp.WorkerError, match=r"(?s)OutOfMemoryError: CUDA out of memory.*even a batch of 1 sample per "
                                                r"rank does not fit: shard the model"):
        nbddp.find_batch_size(Limited({0: 0, 1: 0}), data())
    assert nbddp.run(lambda: 3) == [3, 3]


def test_bad_bounds_and_too_little_data_are_clear_errors(workers):
    sent = len(workers.client.history)
    with pytest.raises(ValueError, match=r"find_batch_size\(max_batch_size=\.\.\.\) must be >= 1 \(samples per rank\), got 0"):
        nbddp.find_batch_size(Limited(), data(), max_batch_size=0)
    with pytest.raises(TypeError, match=r"find_batch_size\(start=\.\.\.\) must be an int, got float 2\.5"):
        nbddp.find_batch_size(Limited(), data(), start=2.5)
    with pytest.raises(TypeError, match=r"find_batch_size\(\) got batch_size=\.\.\.: it finds the batch size"):
        nbddp.find_batch_size(Limited(), data(), batch_size=4)
    assert len(workers.client.history) == sent
    with pytest.raises(ValueError, match=r"the data has 1 sample\(s\) for 2 ranks: each rank needs at least one"):
        nbddp.find_batch_size(Limited(), data(1))


def test_out_of_memory_is_told_apart_from_other_errors():
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    assert is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1e12 bytes"))
    assert is_out_of_memory(MemoryError())
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_out_of_memory(KeyError("out of memory"))


def test_the_scaling_report_measures_one_and_two_workers(workers):
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 2))
    report = nbddp.scaling_report(model, data(), batch_size=16, steps=8, warmup=2)
    assert [r["world_size"] for r in report.rows] == [1, 2]
    for row in report.rows:
        assert row["samples_per_s"] > 0 and 0 <= row["comm_share"] <= 1 and row["peak_mem"] > 0
        assert 0 <= row["data_share"] <= 1 and 0 <= row["wait_share"] <= 1  # the time split of its steps
    assert report.rows[0]["speedup"] == pytest.approx(1.0) and report.rows[0]["efficiency"] == pytest.approx(1.0)
    assert report.rows[1]["efficiency"] == pytest.approx(report.rows[1]["speedup"] / 2)
    fig = report.plot()
    assert [line.get_label() for line in fig.axes[0].get_lines()] == ["ideal (linear)", "measured"]
    assert "<table>" in report._repr_html_() and "data:image/png;base64," in report._repr_html_()
    text = repr(report)
    assert text.startswith("nbddp scaling report (batch size 16 per worker, cpu)") and "efficiency" in text
    assert nbddp.run(lambda: torch.distributed.get_world_size()) == [2, 2], "the workers' own group is untouched"
    assert nbddp.scaling_report(model, data(), batch_size=16, steps=2, warmup=0, strategy="fsdp").rows[1]["world_size"] == 2


def test_a_sharded_fit_after_a_sharded_scaling_report_gathers_its_weights(workers):
    """The report's subgroups are destroyed; torch's DTensor caches must not send the fit's gather to them."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    nbddp.scaling_report(model, data(), batch_size=16, steps=2, warmup=0, strategy="fsdp")
    before = [p.detach().clone() for p in model.parameters()]
    history = nbddp.dist_fit(model, data(), epochs=1, batch_size=16, strategy="fsdp", lr=0.1, live=False)
    assert history.status == "completed"
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters())), "the gathered weights came back"


def test_the_recommendation_reads_the_rows():
    row = {"world_size": 1, "samples_per_s": 100.0, "speedup": 1.0, "efficiency": 1.0, "step_s": 0.1, "comm_share": 0.0,
           "peak_mem": 1}
    good = [row, {**row, "world_size": 2, "samples_per_s": 190.0, "speedup": 1.9, "efficiency": 0.95, "comm_share": 0.05}]
    assert "Every added worker pays off" in recommend(good)
    poor = [row, {**row, "world_size": 2, "samples_per_s": 110.0, "speedup": 1.1, "efficiency": 0.55, "comm_share": 0.5}]
    assert "Beyond 1 worker(s)" in recommend(poor) and "Communication dominates" in recommend(poor)
    assert "start more" in recommend([row])
    assert world_sizes(6) == [1, 2, 4, 6] and world_sizes(1) == [1] and world_sizes(8) == [1, 2, 4, 8]
    assert "1 workers" not in repr(ScalingReport(rows=good, batch_size=4, device="cpu"))


def test_scaling_report_checks_its_arguments(workers):
    with pytest.raises(ValueError, match=r"scaling_report\(steps=\.\.\.\) must be an int >= 1, got 0"):
        nbddp.scaling_report(nn.Linear(8, 2), data(), steps=0)


@pytest.mark.requires_gpu
def test_the_finder_on_a_real_cuda_out_of_memory(_suite_session):
    class Hungry(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 2)

        def forward(self, x):
            ballast = torch.empty(x.shape[0], 2**30, dtype=torch.float32, device=x.device)  # 4 GiB per sample
            return self.lin(x) + ballast[:, :1] * 0

    nbddp.stop()
    nbddp.start(n=torch.cuda.device_count())
    try:
        found = nbddp.find_batch_size(Hungry(), data(4096))
        free = min(torch.cuda.mem_get_info(i)[1] for i in range(torch.cuda.device_count()))
        assert 1 <= found < free // 2**32 + 1
        assert nbddp.dist_fit(nn.Linear(8, 2), data(), batch_size=8, live=False).status == "completed"
    finally:
        nbddp.stop()
