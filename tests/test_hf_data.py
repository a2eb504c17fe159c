"""Hugging Face ``datasets`` as dist_fit data (issue 24): map-style, DatasetDict splits, streams, factories.

Every file is written by the test into its temporary folder (parquet, JSON
lines); nothing is downloaded. Each sample is ``sample(i)``: features ``x``,
a target ``labels`` and its ``id``, so a step_fn can record which ids each
rank trained on.
"""

from __future__ import annotations

import json
import os
import sys

import cloudpickle
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nbddp

datasets = pytest.importorskip("datasets")

cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.timeout(240)

D = 4
FIT = dict(batch_size=8, live=False, log_every=1, optimizer=torch.optim.SGD, lr=0.05)


def sample(i: int) -> dict:
    g = torch.Generator().manual_seed(i)
    x = torch.randn(D, generator=g)
    return {"x": x.tolist(), "labels": float(x.sum() * 0.5), "id": i}


def rows(ids) -> dict:
    found = [sample(i) for i in ids]
    return {k: [r[k] for r in found] for k in ("x", "labels", "id")}


class DictModel(nn.Module):
    """``model(**batch)`` returns the loss, as a Hugging Face model does when given labels."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(D, 1)

    def forward(self, x, labels, id=None):
        return {"loss": F.mse_loss(self.lin(x.float()).squeeze(-1), labels.float())}


def mse_over(model: nn.Module, ids, grad: bool = False):
    """The model's loss over these samples, as one process computes it (a float, or a tensor with ``grad``)."""
    data = rows(ids)
    with torch.set_grad_enabled(grad):
        loss = model(torch.tensor(data["x"]), torch.tensor(data["labels"]))["loss"]
    return loss if grad else loss.item()


def recorder(folder: str):
    def step(model, batch):
        import torch.distributed as dist

        if model.training:  # validation runs the step_fn too
            with open(os.path.join(folder, f"ids-{dist.get_rank()}.txt"), "a") as f:
                f.write(" ".join(str(i) for i in batch["id"].tolist()) + "\n")
        return model(x=batch["x"], labels=batch["labels"])["loss"]

    return step


def read_ids(folder) -> dict[int, list[list[int]]]:
    out = {}
    for rank in (0, 1):
        path = os.path.join(folder, f"ids-{rank}.txt")
        with open(path) as f:
            out[rank] = [[int(i) for i in line.split()] for line in f if line.strip()]
        os.unlink(path)
    return out


def test_a_datasetdict_split_as_data_and_another_as_val_data_with_torch_format(workers):
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows(range(97))),
                               "test": datasets.Dataset.from_dict(rows(range(1000, 1013)))}).with_format("torch")
    h = nbddp.dist_fit(DictModel(), dd["train"], val_data=dd["test"], epochs=2, **FIT)
    assert h.status == "completed" and h.steps[-1]["step"] == 14  # 49 samples per rank (padded): 7 batches
    assert h.epochs[-1]["val_loss"] == pytest.approx(mse_over(h.model, range(1000, 1013)), rel=1e-5)
    assert h.epochs[-1]["loss"] < h.epochs[0]["loss"]
    with pytest.raises(ValueError, match=r"got a DatasetDict with the splits \['train', 'test'\]; pass one split as "
                                         r"data and another as val_data: dist_fit\(model, dd\['train'\], "
                                         r"val_data=dd\['test'\]\)"):
        nbddp.dist_fit(DictModel(), dd, **FIT)


def _parquet_files(folder, parts) -> list[str]:
    paths = []
    for k, ids in enumerate(parts):
        path = str(folder / f"part-{k}.parquet")
        datasets.Dataset.from_dict(rows(ids)).to_parquet(path)
        paths.append(path)
    return paths


def _jsonl(folder, ids) -> str:
    path = str(folder / "val.jsonl")
    with open(path, "w") as f:
        for i in ids:
            f.write(json.dumps(sample(i)) + "\n")
    return path


def test_a_streaming_parquet_dataset_each_sample_once_and_a_jsonl_stream_validated_exactly(workers, tmp_path):
    files = _parquet_files(tmp_path, [range(0, 48), range(48, 97)])  # two files: one per rank
    train = datasets.load_dataset("parquet", data_files=files, split="train", streaming=True).with_format("torch")
    val = datasets.load_dataset("json", data_files=_jsonl(tmp_path, range(1000, 1013)), split="train",
                                streaming=True).with_format("torch")
    h = nbddp.dist_fit(DictModel(), train, val_data=val, epochs=2, step_fn=recorder(str(tmp_path)), **FIT)
    ids = read_ids(tmp_path)
    assert len(ids[0]) == len(ids[1]) == 12  # rank 0's file has 48 rows (6 batches), rank 1's 49 (7)
    for epoch in range(2):
        mine = [[i for row in ids[r][6 * epoch: 6 * epoch + 6] for i in row] for r in (0, 1)]
        assert sorted(mine[0]) == list(range(48)) and sorted(mine[1]) == list(range(48, 96))
    assert [e["ended_on"] for e in h.epochs] == [[0], [0]]
    expected = mse_over(h.model, range(1000, 1013))  # one file of 13 rows, split every other example
    assert h.epochs[-1]["val_loss"] == pytest.approx(expected, rel=1e-5)


def test_a_streaming_dataset_resumes_through_its_own_state_dict(workers, tmp_path):
    files = _parquet_files(tmp_path, [range(0, 48), range(48, 97)])  # rank 0 reads file 0, rank 1 file 1
    stream = datasets.load_dataset("parquet", data_files=files, split="train", streaming=True).with_format("torch")
    fit = dict(epochs=1, step_fn=recorder(str(tmp_path)), **FIT)
    ckpt = tmp_path / "ckpt"
    nbddp.dist_fit(DictModel(), stream, max_steps=2, checkpoint_dir=ckpt, **fit)
    read_ids(tmp_path)
    saved = torch.load(ckpt / "step-00000002.pt", weights_only=False)["stream_per_rank"]
    assert [p["split"] for p in saved] == ["hf", "hf"] and all(p["states"] for p in saved)
    resumed = nbddp.dist_fit(DictModel(), stream, checkpoint_dir=ckpt, resume=True, **fit)
    ids = read_ids(tmp_path)
    batches = {r: [list(range(48 * r + 8 * b, 48 * r + 8 * b + 8)) for b in range(6)] for r in (0, 1)}
    assert ids == {r: batches[r][2:] for r in (0, 1)}  # right after the checkpointed batches
    model = DictModel()  # one process over the same global batches (each the mean of the two ranks' means)
    opt = torch.optim.SGD(model.parameters(), lr=FIT["lr"])
    for b in range(6):
        loss = sum(mse_over(model, batches[r][b], grad=True) for r in (0, 1)) / 2
        loss.backward()
        opt.step()
        opt.zero_grad()
    torch.testing.assert_close(resumed.model.lin.weight, model.lin.weight, atol=1e-6, rtol=1e-5)


def test_a_factory_that_loads_the_dataset_on_each_worker_ships_nothing(workers, tmp_path):
    files = _parquet_files(tmp_path, [range(97)])
    cache = str(tmp_path / "cache")
    h = nbddp.dist_fit(DictModel(), lambda: datasets.load_dataset("parquet", data_files=files,
                                                                   cache_dir=cache).with_format("torch"), **FIT)
    assert h.status == "completed" and h.steps[-1]["step"] == 7
    assert h.transfers["shipped_bytes"] < 64 * 1024, h.transfers  # the model, the function and its file names


@pytest.mark.heavy
def test_nbddp_imports_datasets_only_when_given_such_a_dataset():
    """Heavy: two fresh Python processes import torch and nbddp, one of them datasets."""
    import subprocess

    code = ("import sys, torch\n"
            "from torch.utils.data import IterableDataset, TensorDataset\n"
            "from nbddp.protocol.data_forms import data_spec\n"
            "class S(IterableDataset):\n    def __iter__(self): yield from ()\n"
            "data_spec(S(), 'data'); data_spec(TensorDataset(torch.zeros(3)), 'data'); data_spec(lambda: 0, 'data')\n"
            "import nbddp.worker.data.streams, nbddp.worker.training.loop\n"
            "assert 'datasets' not in sys.modules, 'nbddp imported datasets'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
