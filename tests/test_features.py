"""Issue 5: the training options of dist_fit, each through the real workers (2 CPU ranks, gloo)."""

from __future__ import annotations

import os
import time
import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nbddp


def _regression(n: int = 80, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    y = x @ torch.randn(6, 2, generator=g)
    return x, y


def _mlp(seed: int = 1, dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Dropout(dropout), nn.Linear(32, 2))


def _core(record: dict) -> tuple:
    """The deterministic part of a record (no timings)."""
    return tuple((k, record[k]) for k in sorted(record) if k not in ("time", "samples_per_s"))


def _assert_records_close(a: list[dict], b: list[dict], tol: float = 1e-6) -> None:
    assert len(a) == len(b), (a, b)
    for ra, rb in zip(a, b):
        ka, kb = dict(_core(ra)), dict(_core(rb))
        assert ka.keys() == kb.keys()
        for k in ka:
            assert ka[k] == pytest.approx(kb[k], abs=tol, rel=tol), (k, ra, rb)


def _assert_same_weights(a: nn.Module, b: nn.Module, atol: float) -> None:
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.allclose(pa, pb, atol=atol, rtol=0), f"{name} differs by {(pa - pb).abs().max().item():.3g}"


# ---------------------------------------------------------------------------
# accumulation, clipping, schedulers, max_steps


def test_grad_accum_2_of_batch_b_equals_batch_2b_including_a_partial_last_window(workers):
    # 80 samples / 2 ranks = 40 per rank: 5 micro-batches of 8, so the last window holds one micro-batch
    x, y = _regression(80)
    accumulated, plain = _mlp(), _mlp()
    common = dict(epochs=2, optimizer=torch.optim.SGD, lr=0.05, loss_fn=F.mse_loss, shuffle=False, live=False)
    h_acc = nbddp.dist_fit(accumulated, (x, y), batch_size=8, grad_accum=2, log_every=1, **common)
    h_big = nbddp.dist_fit(plain, (x, y), batch_size=16, log_every=1, **common)
    assert [r["step"] for r in h_acc.steps] == [1, 2, 3, 4, 5, 6]
    _assert_same_weights(accumulated, plain, atol=1e-5)
    assert [r["loss"] for r in h_acc.steps] == pytest.approx([r["loss"] for r in h_big.steps], rel=1e-5)


class _NormRecorder:
    """An optimizer factory whose optimizer writes the global gradient norm seen by each step (on the worker)."""

    def __init__(self, directory: str):
        self.directory = directory

    def __call__(self, params):
        opt = torch.optim.SGD(params, lr=0.01)
        opt.register_step_pre_hook(self._record)
        return opt

    def _record(self, opt, args, kwargs):
        import torch.distributed as dist

        grads = [p.grad for group in opt.param_groups for p in group["params"] if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()
        with open(os.path.join(self.directory, f"rank{dist.get_rank()}.txt"), "a") as f:
            f.write(f"{norm!r}\n")


def test_clip_grad_norm_bounds_the_norm_the_optimizer_sees(workers, tmp_path):
    x, y = _regression(64)
    y = y * 100  # big targets: unclipped gradient norms are far above the bound
    clipped, free = tmp_path / "clipped", tmp_path / "free"
    clipped.mkdir(), free.mkdir()
    common = dict(batch_size=8, loss_fn=F.mse_loss, shuffle=False, live=False)
    nbddp.dist_fit(_mlp(), (x, y), optimizer=_NormRecorder(str(clipped)), clip_grad_norm=0.5, **common)
    nbddp.dist_fit(_mlp(), (x, y), optimizer=_NormRecorder(str(free)), **common)
    norms = {d: [[float(v) for v in (d / f"rank{r}.txt").read_text().split()] for r in (0, 1)] for d in (clipped, free)}
    assert len(norms[clipped][0]) == 4  # 64 / 2 ranks / 8 = 4 steps
    assert norms[clipped][0] == norms[clipped][1]  # the global norm: the same on every rank
    assert all(n <= 0.5 * (1 + 1e-5) for n in norms[clipped][0])
    assert all(n == pytest.approx(0.5, rel=1e-4) for n in norms[clipped][0])  # the bound was active
    assert all(n > 5.0 for n in norms[free][0])


def test_scheduler_lr_sequence_is_in_history_steps(workers):
    x, y = _regression(64)
    history = nbddp.dist_fit(_mlp(), (x, y), epochs=2, batch_size=8, optimizer=torch.optim.SGD, lr=0.1, log_every=1,
                             scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5),
                             scheduler_interval="step", live=False)
    assert [r["step"] for r in history.steps] == list(range(1, 9))
    assert [r["lr"] for r in history.steps] == pytest.approx([0.1] * 3 + [0.05] * 3 + [0.025] * 2)


def test_max_steps_stops_mid_epoch(workers):
    x, y = _regression(80)
    history = nbddp.dist_fit(_mlp(), (x, y), epochs=3, batch_size=8, max_steps=7, log_every=1, live=False)
    assert history.status == "completed"
    assert history.steps[-1]["step"] == 7 and history.steps[-1]["epoch"] == 1
    assert [e["epoch"] for e in history.epochs] == [0]  # epoch 1 was not finished


# ---------------------------------------------------------------------------
# precision, batch norm


def test_bf16_on_cpu_trains_and_the_loss_decreases(workers, digits):
    (x, y), _ = digits
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    history = nbddp.dist_fit(model, (x, y), epochs=3, batch_size=32, precision="bf16", lr=3e-3, live=False)
    losses = [e["loss"] for e in history.epochs]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.7 * losses[0]
    assert model[0].weight.dtype == torch.float32  # autocast, not a bf16 model


def test_fp16_mixed_and_sync_batchnorm_on_cpu_are_refused_before_training(workers):
    x, y = _regression(32)
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=r"precision='16-mixed'\) needs CUDA GPUs.*use precision='bf16-mixed'"):
        nbddp.dist_fit(_mlp(), (x, y), precision="16-mixed", live=False)
    with pytest.raises(ValueError, match=r"sync_batchnorm=True\) needs CUDA GPUs: SyncBatchNorm has no CPU"):
        nbddp.dist_fit(_mlp(), (x, y), sync_batchnorm=True, live=False)
    assert time.perf_counter() - t0 < 5, "these are kernel-side checks; no worker should have been asked"
    assert workers.running is None


# ---------------------------------------------------------------------------
# data forms, step_fn, metrics, uneven data, seeds


class _DictData(torch.utils.data.Dataset):
    def __init__(self, n: int = 96):
        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(n, 6, generator=g)
        self.labels = (self.x[:, 0] + self.x[:, 1] > 0).long()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.labels[i]}


class _HFStyle(nn.Module):
    """Like a transformers model: keyword inputs, an output object with .loss and .logits."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(6, 2)

    def forward(self, x, labels=None):
        logits = self.head(x)
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        return types.SimpleNamespace(loss=loss, logits=logits)


def test_dict_batches_train_a_model_whose_output_has_dot_loss(workers):
    torch.manual_seed(0)
    model = _HFStyle()
    history = nbddp.dist_fit(model, _DictData(), val_data=_DictData(40), epochs=4, batch_size=8, lr=0.05,
                             metrics={"acc": lambda out, t: (out.logits.argmax(1) == t).float().mean()}, live=False)
    assert history.epochs[-1]["loss"] < history.epochs[0]["loss"]
    assert history.epochs[-1]["val_acc"] > 0.7


def test_step_fn_extras_are_reduced_and_recorded(workers):
    x, y = _regression(64)

    def step(model, batch):
        xb, yb = batch
        out = model(xb)
        return {"loss": F.mse_loss(out, yb), "abs_err": (out - yb).abs().mean(), "const": 2.0}

    history = nbddp.dist_fit(_mlp(), (x, y), val_data=_regression(30, seed=5), batch_size=8, step_fn=step,
                             log_every=1, live=False)
    assert all({"abs_err", "const"} <= set(r) for r in history.steps)
    assert all(r["const"] == pytest.approx(2.0) for r in history.steps)
    assert {"val_loss", "val_abs_err", "val_const"} <= set(history.epochs[-1])


def test_validation_metrics_are_sample_weighted_over_unpadded_shards(workers):
    x, y = _regression(64)
    vx, vy = _regression(101, seed=7)  # odd: a padded sampler would count one sample twice
    model = _mlp()
    with torch.no_grad():
        out = model(vx)
        expected_loss = F.mse_loss(out, vy).item()
        expected_err = (out - vy).abs().mean().item()
    history = nbddp.dist_fit(model, (x, y), val_data=(vx, vy), epochs=2, batch_size=8, loss_fn=F.mse_loss,
                             optimizer=torch.optim.SGD, lr=0.0, val_every=2, live=False,
                             metrics={"err": lambda o, t: (o - t).abs().mean()})
    # every 2 steps inside an epoch (steps 2, 6) plus each epoch end (steps 4, 8)
    assert [v["step"] for v in history.validations] == [2, 4, 6, 8]
    for v in history.validations:
        assert v["val_loss"] == pytest.approx(expected_loss, rel=1e-6)
        assert v["val_err"] == pytest.approx(expected_err, rel=1e-6)


def test_uneven_data_trains_without_hanging(workers):
    x, y = _regression(101)  # 101 samples: 51 per rank (the sampler pads one), 7 batches of 8
    t0 = time.perf_counter()
    history = nbddp.dist_fit(_mlp(), (x, y), epochs=2, batch_size=8, loss_fn=F.mse_loss, log_every=1, live=False)
    assert time.perf_counter() - t0 < 120
    assert history.status == "completed"
    assert [r["step"] for r in history.steps] == list(range(1, 15))


def test_same_seed_gives_the_same_history_and_weights(workers):
    x, y = _regression(96)
    runs = []
    for seed in (11, 11, 12):
        h = nbddp.dist_fit(lambda: _mlp(dropout=0.3), (x, y), epochs=2, batch_size=8, shuffle=True, seed=seed,
                           log_every=1, live=False)
        runs.append(h)
    a, b, c = runs
    assert [_core(r) for r in a.steps] == [_core(r) for r in b.steps]
    assert [_core(r) for r in a.epochs] == [_core(r) for r in b.epochs]
    _assert_same_weights(a.model, b.model, atol=0)
    assert [r["loss"] for r in a.steps] != [r["loss"] for r in c.steps]


# ---------------------------------------------------------------------------
# checkpoints


def _resume_model():
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 2))


_RESUME = dict(batch_size=8, shuffle=True, seed=3, log_every=1, live=False, loss_fn=F.mse_loss,
               scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7))


def test_resume_after_an_epoch_matches_training_straight_through(workers, tmp_path):
    x, y = _regression(80)  # 5 steps per epoch
    straight = nbddp.dist_fit(_resume_model, (x, y), epochs=2, **_RESUME)
    first = nbddp.dist_fit(_resume_model, (x, y), epochs=1, checkpoint_dir=tmp_path, **_RESUME)
    assert os.path.exists(tmp_path / "step-00000005.pt")
    second = nbddp.dist_fit(_resume_model, (x, y), epochs=2, checkpoint_dir=tmp_path, resume=True, **_RESUME)
    _assert_records_close(first.steps, straight.steps[:5])
    _assert_records_close(second.steps, [r for r in straight.steps if r["step"] > 5])
    _assert_records_close(second.epochs, straight.epochs[1:])
    _assert_same_weights(second.model, straight.model, atol=1e-6)


def test_resume_mid_epoch_matches_training_straight_through(workers, tmp_path):
    x, y = _regression(80)
    straight = nbddp.dist_fit(_resume_model, (x, y), epochs=2, **_RESUME)
    # stop at step 3 of 5 in epoch 0 (the stop writes a checkpoint), then continue to the end
    nbddp.dist_fit(_resume_model, (x, y), epochs=2, max_steps=3, checkpoint_dir=tmp_path, **_RESUME)
    second = nbddp.dist_fit(_resume_model, (x, y), epochs=2, resume=str(tmp_path / "step-00000003.pt"), **_RESUME)
    _assert_records_close(second.steps, [r for r in straight.steps if r["step"] > 3])
    _assert_records_close(second.epochs, straight.epochs)  # epoch 0's loss includes the steps before the stop
    _assert_same_weights(second.model, straight.model, atol=1e-6)


def test_checkpoint_loads_with_plain_torch_without_nbddp(workers, tmp_path):
    import subprocess
    import sys

    x, y = _regression(64)
    nbddp.dist_fit(_mlp(), (x, y), epochs=1, batch_size=8, checkpoint_dir=tmp_path, checkpoint_every=2, live=False,
                   scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1))
    names = sorted(os.listdir(tmp_path))
    assert names == ["step-00000002.pt", "step-00000004.pt"]
    code = (
        "import sys, torch\n"
        f"state = torch.load({str(tmp_path / names[-1])!r})\n"  # torch's default: weights_only=True
        "model = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.ReLU(), torch.nn.Dropout(0.0), torch.nn.Linear(32, 2))\n"
        "model.load_state_dict(state['model'])\n"
        "assert 'nbddp' not in sys.modules\n"
        "print(state['step'], state['epoch'], sorted(state))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(tmp_path), timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("4 1 ")
    for key in ("model", "optimizer", "scheduler", "rng_per_rank", "batches_done"):
        assert repr(key) in out.stdout


def test_resume_from_a_file_that_is_not_a_checkpoint_is_a_clear_error(workers, tmp_path):
    bogus = tmp_path / "weights.pt"
    torch.save({"weight": torch.zeros(2)}, bogus)
    x, y = _regression(32)
    with pytest.raises(nbddp.WorkerError, match=r"is not an nbddp checkpoint \(missing \['model', 'optimizer'"):
        nbddp.dist_fit(_mlp(), (x, y), batch_size=8, resume=str(bogus), live=False)


def test_a_stop_writes_a_checkpoint_at_the_step_it_stopped(workers, tmp_path):
    x, y = _regression(64)
    handle = nbddp.dist_fit(_mlp(), (x, y), epochs=500, batch_size=8, log_every=1, checkpoint_dir=tmp_path,
                            block=False, live=False)
    deadline = time.monotonic() + 120
    while len(handle.history.steps) < 6 and not handle.done() and time.monotonic() < deadline:
        time.sleep(0.05)
    history = handle.stop()
    assert history.status == "interrupted"
    last = history.steps[-1]
    state = torch.load(tmp_path / f"step-{last['step']:08d}.pt")
    assert state["step"] == last["step"]
    assert state["batches_done"] == (0 if last["step"] % 4 == 0 else last["step"] % 4)  # 4 steps per epoch



def _draws_differ_across_ranks(model, batch):
    """A step_fn: all-gathers one random draw per rank and reports whether they differ."""
    import torch.distributed as dist

    out = model(batch[0])
    mine = torch.rand(1)
    draws = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(draws, mine)
    return {"loss": F.cross_entropy(out, batch[1]), "differ": float(len({d.item() for d in draws}) > 1)}


def test_ranks_draw_different_random_numbers(workers):
    """The same seed gives the same run, but each rank has its own stream (dropout masks differ)."""
    import nbddp

    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
    h = nbddp.dist_fit(nn.Linear(4, 2), (x, y), epochs=1, batch_size=8, step_fn=_draws_differ_across_ranks,
                       live=False, log_every=1, seed=3)
    assert [r["differ"] for r in h.steps] == [1.0] * 4


def test_prefetch_is_checked_and_ignored_on_cpu_workers(workers):
    x, y = _regression(64)
    weights = []
    for depth in (0, 2):
        torch.manual_seed(0)
        model = _mlp()
        nbddp.dist_fit(model, (x, y), epochs=1, batch_size=8, prefetch=depth, shuffle=False, live=False)
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.equal(weights[0], weights[1])
    with pytest.raises(ValueError, match=r"prefetch=\.\.\.\) is how many batches are copied to the GPU ahead of the "
                                         r"step: 0, 1 or 2.*got 3"):
        nbddp.dist_fit(_mlp(), (x, y), prefetch=3, live=False)
