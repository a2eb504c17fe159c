"""Shipping by value: cloudpickle, tensors through one shared-memory file."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch
import torch.nn as nn

from nbddp import shipping


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.out = nn.Linear(4, 10, bias=False)
        self.out.weight = self.emb.weight  # weight tying: one Parameter, two names
        self.register_buffer("count", torch.arange(3))


def test_pack_lifts_tensors_into_one_private_file_and_round_trips():
    model = Tied()
    parcel = shipping.pack(model)
    try:
        assert parcel.path is not None and parcel.path.startswith(shipping.shm_dir())
        assert os.stat(parcel.path).st_mode & 0o777 == 0o600
        # the pickle holds references only: far smaller than the tensors
        assert len(parcel.data) < sum(t.nbytes for t in parcel.tensors) + 4096
        clone = shipping.unpack(parcel)
    finally:
        parcel.discard()
    assert not os.path.exists(parcel.path)
    assert clone.out.weight is clone.emb.weight, "tied weights must stay one Parameter"
    assert isinstance(clone.emb.weight, nn.Parameter) and clone.emb.weight.requires_grad
    assert torch.equal(clone.emb.weight, model.emb.weight)
    assert torch.equal(clone.count, model.count)
    clone.emb.weight.data.add_(1)  # a copy, not a view of the file or of the original
    assert not torch.equal(clone.emb.weight, model.emb.weight)


def test_views_load_straight_into_an_existing_model():
    src, dst = nn.Linear(300, 200), nn.Linear(300, 200)
    parcel = shipping.pack(src.state_dict())
    try:
        state = shipping.unpack(parcel, copy=False)
        weight_before = dst.weight
        dst.load_state_dict(state)
        del state
    finally:
        parcel.discard()
    assert dst.weight is weight_before
    assert torch.equal(dst.weight, src.weight) and torch.equal(dst.bias, src.bias)


def test_remote_form_carries_tensors_inline():
    parcel = shipping.pack({"w": torch.ones(5)}, local=False)
    assert parcel.path is None and not parcel.tensors
    assert torch.equal(shipping.unpack(parcel)["w"], torch.ones(5))


def test_bf16_and_empty_tensors_survive():
    obj = {"b": torch.randn(7, 3).to(torch.bfloat16), "e": torch.empty(0, 4), "s": torch.tensor(3.5)}
    parcel = shipping.pack(obj)
    try:
        back = shipping.unpack(parcel)
    finally:
        parcel.discard()
    assert back["b"].dtype == torch.bfloat16 and torch.equal(back["b"], obj["b"])
    assert back["e"].shape == (0, 4) and back["s"].item() == 3.5


def test_notebook_class_with_super_loads_in_a_process_without_it(tmp_path):
    """A class defined in __main__ (as in a notebook) travels by value."""
    script = tmp_path / "make.py"
    script.write_text(
        "import torch.nn as nn, pickle, sys\n"
        "from nbddp import shipping\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.fc = nn.Linear(3, 2)\n"
        "    def forward(self, x):\n"
        "        return self.fc(x)\n"
        "p = shipping.pack(Net(), local=False)\n"
        "sys.stdout.buffer.write(p.data)\n"
    )
    data = subprocess.run([sys.executable, str(script)], capture_output=True, check=True).stdout
    model = shipping.unpack(shipping.Parcel(data))
    assert type(model).__name__ == "Net" and model(torch.ones(1, 3)).shape == (1, 2)


def test_unpicklable_attribute_is_named_with_a_fix():
    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 2)
            self.lock = threading.Lock()

    with pytest.raises(shipping.ShippingError, match=r"model cannot be sent.*model\.lock.*zero-argument function"):
        shipping.pack(Holder(), what="model")
    with pytest.raises(shipping.ShippingError, match=r"data cannot be sent.*data\[1\]"):
        shipping.dumps([1, (x for x in range(3))], what="data")


def test_no_file_left_when_pickling_fails():
    before = set(os.listdir(shipping.shm_dir()))
    with pytest.raises(shipping.ShippingError):
        shipping.pack({"w": torch.ones(3), "bad": threading.Lock()})
    leftover = {f for f in set(os.listdir(shipping.shm_dir())) - before if f.startswith(f"nbddp-{os.getpid()}-")}
    assert not leftover
