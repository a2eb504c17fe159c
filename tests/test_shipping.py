"""Shipping by value: cloudpickle, tensors through one shared-memory file."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch
import torch.nn as nn

from nbddp.shipping import pickling as shipping
from nbddp.shipping import shm_files
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
        assert parcel.path is not None and parcel.path.startswith(shm_files.shm_dir())
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


@pytest.mark.heavy
def test_notebook_class_with_super_loads_in_a_process_without_it(tmp_path):
    """A class defined in __main__ (as in a notebook) travels by value. Heavy: two fresh Python processes import torch."""
    script = tmp_path / "make.py"
    script.write_text(
        "import torch.nn as nn, pickle, sys\n"
        "from nbddp.shipping import pickling as shipping\n"
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

    with pytest.raises(shipping.ShippingError, match=r"the model cannot be sent.*`model\.lock` \(lock\).*`model=lambda: \.\.\.`"):
        shipping.pack(Holder(), what="the model", label="model")
    with pytest.raises(shipping.ShippingError, match=r"data cannot be sent.*`data\[1\]` \(generator\)"):
        shipping.dumps([1, (x for x in range(3))], what="data", label="data")


def test_no_file_left_when_pickling_fails():
    before = set(os.listdir(shm_files.shm_dir()))
    with pytest.raises(shipping.ShippingError):
        shipping.pack({"w": torch.ones(3), "bad": threading.Lock()})
    leftover = {f for f in set(os.listdir(shm_files.shm_dir())) - before if f.startswith(f"nbddp-{os.getpid()}-")}
    assert not leftover


def test_pool_reuses_its_files_and_keeps_only_a_few():
    pool = shm_files.BufferPool(prefix=f"nbddp-test-{os.getpid()}-pool", keep=1)
    try:
        first = shipping.pack({"w": torch.randn(1000)}, pool=pool)
        assert first.pooled and first.path.startswith(os.path.join(shm_files.shm_dir(), pool.prefix))
        first.discard()  # back to the pool, not removed
        assert os.path.exists(first.path)
        second = shipping.pack({"w": torch.ones(2000)}, pool=pool)  # larger: the same file grows
        assert second.path == first.path
        third = shipping.pack({"w": torch.zeros(10)}, pool=pool)  # the first is busy: a second file
        assert third.path != second.path
        assert torch.equal(shipping.unpack(second)["w"], torch.ones(2000))
        second.discard()
        third.discard()  # keep=1: one of the two files is removed
        left = [p for p in (second.path, third.path) if os.path.exists(p)]
        assert len(left) == 1
    finally:
        pool.close()
    assert not any(os.path.exists(p) for p in (first.path, third.path))


def test_a_reader_never_removes_a_pooled_file():
    pool = shm_files.BufferPool(prefix=f"nbddp-test-{os.getpid()}-reader")
    try:
        parcel = shipping.pack(torch.ones(3), pool=pool)
        received = shipping.Parcel(parcel.data, parcel.path, parcel.tensors, pooled=True)  # as another process sees it
        shm_files._POOL_OF.pop(parcel.path)  # that process has no pool for it
        received.discard()
        assert os.path.exists(parcel.path)
    finally:
        pool.close()
        shm_files.remove_files(pool.prefix)
    assert not os.path.exists(parcel.path)


def test_remove_files_takes_every_file_of_a_prefix_only():
    prefix = f"nbddp-test-{os.getpid()}-rm"
    mine = [shipping.pack(torch.ones(2), prefix=prefix) for _ in range(3)]
    other = shipping.pack(torch.ones(2), prefix=f"{prefix}x"[::-1])
    try:
        assert shm_files.remove_files(prefix) == 3
        assert not any(os.path.exists(p.path) for p in mine)
        assert os.path.exists(other.path)
    finally:
        other.discard()


def test_a_foreign_persistent_id_is_refused():
    import io
    import pickle

    class Foreign(pickle.Pickler):
        def persistent_id(self, obj):
            return ("someone-else", 0) if obj == "x" else None

    buf = io.BytesIO()
    Foreign(buf).dump(["x"])
    parcel = shipping.Parcel(buf.getvalue(), path=shipping.pack({"t": torch.ones(1)}).path)
    try:
        with pytest.raises(pickle.UnpicklingError, match=r"unknown persistent id \('someone-else', 0\)"):
            shipping.unpack(parcel)
    finally:
        parcel.discard()
