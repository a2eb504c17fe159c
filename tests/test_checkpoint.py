"""Checkpoints survive a writer killed mid-save; the files are plain torch."""

from __future__ import annotations

import glob
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import torch.nn as nn

import nbddp
from nbddp.worker.checkpoints import files as ckpt

_WRITER = """
import sys, torch
from nbddp.worker.checkpoints import files as ckpt
directory = sys.argv[1]
ckpt.save(directory, 1, {"model": {"w": torch.ones(4)}, "optimizer": {}, "step": 1, "epoch": 0})
print("saved", flush=True)
big = {"model": {"w": torch.zeros(100_000_000)}, "optimizer": {}, "step": 2, "epoch": 0}  # 400 MB
ckpt.save(directory, 2, big)
print("second save finished", flush=True)
"""


def _wait_for(predicate, timeout: float, poll: float = 0.002):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(poll)
    return None


@pytest.mark.faults
def test_a_writer_killed_mid_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        assert proc.stdout.readline().strip() == "saved"
        pattern = str(tmp_path / "step-00000002.pt.tmp-*")

        def partly_written():
            files = glob.glob(pattern)
            return files if files and os.path.getsize(files[0]) > (1 << 20) else None

        assert _wait_for(partly_written, timeout=120), "the second save never started writing"
        os.kill(proc.pid, signal.SIGKILL)  # mid-write: the temporary exists, the rename has not happened
    finally:
        proc.kill()
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    assert not os.path.exists(tmp_path / "step-00000002.pt")
    assert ckpt.latest(str(tmp_path)) == str(tmp_path / "step-00000001.pt")
    state = torch.load(tmp_path / "step-00000001.pt")
    assert state["step"] == 1 and torch.equal(state["model"]["w"], torch.ones(4))
    assert ckpt.resolve(True, str(tmp_path)) == str(tmp_path / "step-00000001.pt")
    # the dead writer's temporary is cleaned up by the next save
    assert glob.glob(pattern)
    ckpt.save(str(tmp_path), 3, {"model": {}, "optimizer": {}, "step": 3, "epoch": 0})
    assert not glob.glob(pattern)
    assert [os.path.basename(p) for p in ckpt.list_checkpoints(str(tmp_path))] == ["step-00000001.pt", "step-00000003.pt"]


def test_latest_skips_a_truncated_file_and_save_keeps_the_newest_three(tmp_path):
    for step in (1, 2, 3, 4):
        ckpt.save(str(tmp_path), step, {"model": {"w": torch.full((3,), float(step))}, "optimizer": {}, "step": step, "epoch": 0})
    assert [os.path.basename(p) for p in ckpt.list_checkpoints(str(tmp_path))] == [
        "step-00000002.pt", "step-00000003.pt", "step-00000004.pt"]
    newest = tmp_path / "step-00000004.pt"
    newest.write_bytes(newest.read_bytes()[:100])  # damaged by something outside nbddp
    assert not ckpt.is_complete(str(newest))
    assert ckpt.latest(str(tmp_path)) == str(tmp_path / "step-00000003.pt")


def test_rng_state_round_trips_through_a_weights_only_load(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    state = ckpt.rng_state()
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    torch.save({"rng": state}, tmp_path / "rng.pt")
    loaded = torch.load(tmp_path / "rng.pt")  # weights_only=True: no numpy arrays inside
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    ckpt.set_rng_state(loaded["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_resume_paths_that_do_not_exist_are_clear_errors(tmp_path):
    assert ckpt.resolve(False, str(tmp_path)) is None
    assert ckpt.resolve(True, str(tmp_path / "not-yet")) is None  # nothing saved yet: start fresh
    with pytest.raises(FileNotFoundError, match="no loadable step-\\*.pt checkpoint in that directory"):
        ckpt.resolve(str(tmp_path), None)
    with pytest.raises(FileNotFoundError, match="no such checkpoint file"):
        ckpt.resolve(str(tmp_path / "missing.pt"), None)
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(ValueError, match=r"is not an nbddp checkpoint \(missing \['model', 'optimizer', 'step', 'epoch'\]\)"):
        ckpt.load(str(tmp_path / "list.pt"))


def _big_model():
    return nn.Sequential(nn.Linear(4096, 4096, bias=False), nn.Linear(4096, 4096, bias=False))  # 128 MB of weights


@pytest.mark.faults
def test_killing_rank_0_inside_checkpoint_save_leaves_the_previous_checkpoint(workers, tmp_path):
    """End to end: rank 0's engine is SIGKILLed while it writes a checkpoint of a big model."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 4096, generator=g), torch.randn(64, 4096, generator=g)
    rank0_pid = workers.placements[0].pid
    handle = nbddp.dist_fit(_big_model, (x, y), epochs=100, batch_size=2, optimizer=torch.optim.SGD, lr=1e-3,
                            checkpoint_dir=tmp_path, checkpoint_every=1, block=False, live=False)
    try:
        def writing_after_a_complete_one():
            done = ckpt.list_checkpoints(str(tmp_path))
            tmps = glob.glob(str(tmp_path / f"step-*.pt.tmp-{rank0_pid}"))
            return done and tmps and os.path.getsize(tmps[0]) > (1 << 20)

        assert _wait_for(writing_after_a_complete_one, timeout=180, poll=0.005), "no checkpoint was being written"
        os.kill(rank0_pid, signal.SIGKILL)
        with pytest.raises(nbddp.WorkerError, match="rank 0"):
            handle.wait(timeout=180)
    finally:
        if not handle.done():
            handle.stop(wait=False)
    latest = ckpt.latest(str(tmp_path))
    assert latest is not None
    # the newest complete file loads in plain torch and holds the whole model
    code = (f"import sys, torch; s = torch.load({latest!r}); assert 'nbddp' not in sys.modules; "
            "print(s['step'], sorted(s['model']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr
    step = int(out.stdout.split()[0])
    assert latest.endswith(f"step-{step:08d}.pt")
    assert "['0.weight', '1.weight']" in out.stdout
    # the interrupted write never became a step-*.pt
    assert glob.glob(str(tmp_path / f"step-*.pt.tmp-{rank0_pid}"))
    assert ckpt.list_checkpoints(str(tmp_path))[-1] == latest
