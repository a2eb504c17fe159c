"""Issue 2's numerical contract, through the real workers: DDP equals one big batch; losses are global means."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nbddp


def _data(n: int = 96, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    y = x @ torch.randn(6, 2, generator=g) + 0.1 * torch.randn(n, 2, generator=g)
    return x, y


def _model(seed: int = 1) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))


def _local_sgd(model: nn.Module, x, y, batch: int, epochs: int, lr: float) -> nn.Module:
    """The reference: one process, sequential batches of ``batch`` samples."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(epochs):
        for i in range(0, len(x), batch):
            opt.zero_grad()
            F.mse_loss(model(x[i:i + batch]), y[i:i + batch]).backward()
            opt.step()
    return model


def _assert_same_weights(a: nn.Module, b: nn.Module, atol: float) -> None:
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.allclose(pa, pb, atol=atol, rtol=0), f"{name} differs by {(pa - pb).abs().max().item():.3g}"


def test_two_ranks_of_batch_b_equal_one_process_with_batch_2b(workers):
    x, y = _data()
    b = 8
    dist_model = _model()
    ref = _local_sgd(_model(), x, y, batch=2 * b, epochs=2, lr=0.05)
    history = nbddp.dist_fit(dist_model, (x, y), epochs=2, batch_size=b, optimizer=torch.optim.SGD, lr=0.05,
                             loss_fn=F.mse_loss, shuffle=False, live=False)
    assert history.status == "completed"
    assert history.steps[-1]["step"] == 2 * len(x) // (2 * b)
    _assert_same_weights(dist_model, ref, atol=1e-5)


def test_with_lr_zero_each_epoch_loss_is_the_mean_loss_over_the_whole_dataset(workers):
    # 90 samples: divisible by the 2 ranks (no padding), not by the batch (a short last batch per rank)
    x, y = _data(90)
    model = _model()
    with torch.no_grad():
        expected = F.mse_loss(model(x), y).item()
    history = nbddp.dist_fit(model, (x, y), epochs=2, batch_size=7, optimizer=torch.optim.SGD, lr=0.0,
                             loss_fn=F.mse_loss, shuffle=True, log_every=3, live=False)
    assert [e["epoch"] for e in history.epochs] == [0, 1]
    for record in history.epochs:
        assert record["loss"] == pytest.approx(expected, abs=1e-6, rel=1e-6)
    assert all(r["lr"] == 0.0 for r in history.steps)
    assert history.steps[-1]["step"] == 2 * 7  # ceil(45 / 7) steps per epoch
