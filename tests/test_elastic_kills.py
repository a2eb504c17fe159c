"""Elastic fits under repeated losses (issue 33): two kills in one fit, and torchft's "punisher".

Both end with an unbroken run's weights (bit for bit: a resume is exact). Both
need several heals, each a fresh engine started and importing torch, so both
are ``slow`` as well as ``faults``.
"""

from __future__ import annotations

import glob
import os
import random
import signal
import threading
import time

import pytest
import torch

import nbddp
from elastic_kit import KillAt, armed
from faultkit import Net, regression_data
from nbddp.protocol.notes import shm_dir


def _fit(step_fn, steps: int, block: bool = True, **elastic):
    torch.manual_seed(0)
    model = Net()
    h = nbddp.dist_fit(model, regression_data(), batch_size=16, max_steps=steps, epochs=steps // 16 + 1, live=False,
                       seed=3, step_fn=step_fn, block=block, **elastic)
    return h, model


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    for name, value in want.items():
        assert torch.equal(got[name], value), (name, (got[name] - value).abs().max().item())


def _no_snapshots_left(session) -> bool:
    return glob.glob(os.path.join(shm_dir(), f"{session.file_prefix}-snap-*")) == []


@pytest.mark.faults
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_kills_in_one_fit_the_fit_completes_with_the_unbroken_weights(workers, tmp_path):
    """Rank 1 dies at step 7, then (in the relaunched fit) rank 0 at step 19; max_restarts=2 covers both.

    It cannot be faster than two heals, each a fresh engine started and importing torch (30-40 s each on a
    loaded 2-core machine).
    """
    _, reference = _fit(KillAt(), 24)
    first, second = armed(str(tmp_path / "first")), armed(str(tmp_path / "second"))
    # KillAt counts the calls of each launch: the relaunch from step 4 runs step 19 as its 15th call
    h, model = _fit(KillAt([(1, 7, first), (0, 15, second)]), 24, max_restarts=2, snapshot_every=4)
    assert h.status == "completed" and not os.path.exists(first) and not os.path.exists(second)
    _assert_same(_weights(model), _weights(reference))
    assert [(e["rank"], e["step_resumed_from"]) for e in h.restarts] == [(1, 4), (0, 16)]
    assert all(0 < e["replace_s"] <= e["seconds"] for e in h.restarts)
    steps = [r["step"] for r in h.steps]
    assert steps == sorted(set(steps)) and steps[-1] == 24  # each replay overwrote the lost steps' records
    assert _no_snapshots_left(workers)


class Punisher:
    """Kills a random rank's engine every 20-30 s while ``handle``'s fit trains (torchft's punisher).

    A kill waits until the fit trains again after the last one (a step past the resumed one), so that every
    cycle makes progress; at most ``most`` kills. ``rng`` is seeded: a failure names the seed to replay it.
    """

    def __init__(self, session, handle, rng: random.Random, most: int = 3):
        self.session, self.handle, self.rng, self.most = session, handle, rng, most
        self.kills: list[tuple[float, int]] = []  # (time, rank)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="test-punisher", daemon=True)

    def _training_again(self) -> bool:
        history = self.handle.history
        if self.handle.status != "training" or not history.steps:
            return False
        restarts = history.restarts
        if len(restarts) < len(self.kills):  # the last kill is not yet noticed
            return False
        resumed = restarts[-1]["step_resumed_from"] if restarts else 0
        return resumed is not None and history.steps[-1]["step"] > resumed

    def _run(self) -> None:
        start = time.monotonic()
        while len(self.kills) < self.most and not self.stop.is_set():
            due = (self.kills[-1][0] if self.kills else start) + self.rng.uniform(20.0, 30.0)
            while not self.stop.wait(0.05) and not (time.monotonic() >= due and self._training_again()):
                pass
            if self.stop.is_set() or self.handle.done():
                return
            rank = self.rng.randrange(self.session.world_size)
            os.kill(self.session.placements[rank].pid, signal.SIGKILL)  # an engine this session started
            self.kills.append((time.monotonic(), rank))


@pytest.mark.faults
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_the_punisher_a_random_rank_killed_every_20_to_30_s_and_the_fit_ends_with_the_unbroken_weights(workers):
    """A fit of 300 steps of 0.2 s (a minute of training) loses a random rank every 20-30 s, 2 or 3 times.

    It cannot be faster: it needs a fit long enough for two kills 20-30 s apart, and two or three heals.
    """
    seed = random.randrange(1 << 30)
    _, reference = _fit(KillAt(), 300)
    handle, model = _fit(KillAt(delay=0.2), 300, block=False, max_restarts=3, snapshot_every=4)
    punisher = Punisher(workers, handle, random.Random(seed))
    punisher.thread.start()
    try:
        h = handle.wait(timeout=360)
    finally:
        punisher.stop.set()
        punisher.thread.join(5)
    assert h.status == "completed", f"seed {seed}"
    assert len(h.restarts) == len(punisher.kills) >= 2, (seed, punisher.kills, h.restarts)
    assert [e["rank"] for e in h.restarts] == [rank for _, rank in punisher.kills], seed
    _assert_same(_weights(model), _weights(reference))
    steps = [r["step"] for r in h.steps]
    assert steps == sorted(set(steps)) and steps[-1] == 300
    assert _no_snapshots_left(workers)


@pytest.mark.requires_gpu
@pytest.mark.faults
@pytest.mark.timeout(300)
def test_a_cuda_fit_that_loses_its_rank_recovers_from_its_snapshot_with_the_unbroken_weights(gpu_workers, tmp_path):
    """One rank per GPU (nccl): the model lives on CUDA, each snapshot is a device-to-host copy into /dev/shm.

    Rank 0 is SIGKILLed at step 7 (on one GPU, the whole group): the warm spare engine takes its place and the
    fit resumes from step 4 on the GPU. scripts/gpu_check.sh runs it.
    """
    def fit(step_fn, **elastic):
        torch.manual_seed(0)
        model = Net().to("cuda:0")
        h = nbddp.dist_fit(model, regression_data(), batch_size=16, max_steps=12, epochs=2, live=False, seed=3,
                           step_fn=step_fn, **elastic)
        return h, _weights(model)

    _, want = fit(KillAt())
    h, got = fit(KillAt([(0, 7, armed(str(tmp_path / "kill")))]), max_restarts=1, snapshot_every=4)
    assert h.status == "completed" and [e["step_resumed_from"] for e in h.restarts] == [4]
    assert {str(v.device) for v in got.values()} == {"cuda:0"}
    assert max((got[k] - want[k]).abs().max().item() for k in want) <= 1e-6  # a resume's tolerance
    assert _no_snapshots_left(gpu_workers)
