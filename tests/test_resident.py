"""Datasets stay resident on the workers between fits (issue 8 fast path)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import nbddp
from nbddp.shipping import pickling as shipping
def test_fingerprint_follows_content_not_object():
    x, y = torch.randn(50, 3), torch.randint(0, 2, (50,))
    ds1 = torch.utils.data.TensorDataset(x, y)
    ds2 = torch.utils.data.TensorDataset(x, y)
    assert shipping.fingerprint(ds1) == shipping.fingerprint(ds2)
    before = shipping.fingerprint(ds1)
    x[0, 0] += 1  # in-place change: the version counter moves
    assert shipping.fingerprint(ds1) != before
    assert shipping.fingerprint(torch.utils.data.TensorDataset(x.clone(), y)) != shipping.fingerprint(ds1)


def test_same_data_is_not_shipped_twice_and_changes_are_seen(workers):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4096, 256, generator=g), torch.randn(4096, 1, generator=g)
    first = nbddp.dist_fit(nn.Linear(256, 1), (x, y), epochs=1, batch_size=512, live=False, lr=0.0)
    second = nbddp.dist_fit(nn.Linear(256, 1), (x, y), epochs=1, batch_size=512, live=False, lr=0.0)
    assert first.transfers["shipped_bytes"] > x.nbytes
    assert second.transfers["shipped_bytes"] < x.nbytes / 10, "the resident dataset must not travel again"
    # the same zero-lr model on the same data reports the same loss: the workers used the resident copy
    model = nn.Linear(256, 1)
    a = nbddp.dist_fit(model, (x, y), epochs=1, batch_size=512, live=False, lr=0.0, shuffle=False)
    y.mul_(2.0)  # changed in place: must be shipped again and used
    b = nbddp.dist_fit(model, (x, y), epochs=1, batch_size=512, live=False, lr=0.0, shuffle=False)
    assert b.transfers["shipped_bytes"] > y.nbytes
    with torch.no_grad():
        expected = torch.nn.functional.mse_loss(model(x), y).item()
    assert b.epochs[-1]["loss"] == pytest.approx(expected, rel=1e-5)
    assert b.epochs[-1]["loss"] != pytest.approx(a.epochs[-1]["loss"], rel=1e-3)
