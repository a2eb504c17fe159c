"""How ``nbddp.predict``'s outputs come back on one host: one shared file, each rank writing its rows in place.

The layout and the first-rank-claims rule without workers; then on the shared
2 CPU workers: the value views the file (gone from ``/dev/shm`` once mapped),
and outputs that do not fit the file's layout (a batch of another shape, ranks
whose outputs differ) come back exactly as a one-process loop gives them.
"""

from __future__ import annotations

import glob
import os
import stat
from collections import OrderedDict
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

import nbddp
from nbddp.shipping import output_file

pytestmark = pytest.mark.timeout(180)



def _our_output_files() -> list[str]:
    """This session's predict output files in /dev/shm (another test process's calls may have theirs there)."""
    from nbddp.session.session import get_session

    return glob.glob(f"/dev/shm/{get_session().file_prefix}-out-*")

def net() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def rows(n: int) -> torch.Tensor:
    """Sample ``i`` is ``[i, i, ..., i]``: a step can tell where in the dataset it is."""
    return torch.arange(n, dtype=torch.float32)[:, None].expand(n, 6).contiguous()


def loop(step, x: torch.Tensor, blocks: list[range], batch_size: int) -> list:
    """The one-process reference: each rank's block in batches, one output per batch, in rank order."""
    return [step(x[b.start + i:min(b.start + i + batch_size, b.stop)])
            for b in blocks for i in range(0, len(b), batch_size)]


def test_a_layout_places_each_leaf_on_its_own_pages_and_the_first_claim_wins(tmp_path, monkeypatch):
    monkeypatch.setattr("nbddp.shipping.shm_files.shm_dir", lambda: str(tmp_path))
    out = {"logits": torch.zeros(4, 3), "label": torch.zeros(4, dtype=torch.int64)}
    layout = output_file.layout_of(out, 97)
    assert [(f.key, f.shape, f.dtype, f.row_bytes) for f in layout.leaves] == [("logits", (3,), "float32", 12),
                                                                                ("label", (), "int64", 8)]
    assert layout.starts() == [0, 4096] and layout.nbytes == 4096 + 97 * 8
    assert output_file.layout_of(torch.tensor(1.0), 5) is None  # no sample dimension
    assert output_file.layout_of({"a": torch.zeros(2), "b": [1, 2]}, 5) is None
    assert output_file.Layout.from_json(layout.to_json()) == layout
    path = output_file.create("nbddp-test")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and output_file.claimed(path) is None
    assert output_file.claim(path, layout) == layout
    other = output_file.layout_of(torch.zeros(2, 5), 97)
    assert output_file.claim(path, other) == layout  # a peer got there first: its layout holds
    assert stat.S_IMODE(os.stat(output_file.note_path(path)).st_mode) == 0o600
    output_file.remove(path)
    assert os.listdir(tmp_path) == []
    assert output_file.claim(path, layout) is None  # the call is over: a late rank leaves no note behind
    assert os.listdir(tmp_path) == []


def test_the_value_views_the_shared_file_which_is_gone_once_mapped(workers):
    x = rows(97)
    first = nbddp.predict(net(), (x,), batch_size=10, live=False)
    assert torch.allclose(first, net()(x).detach(), atol=1e-6)
    assert not _our_output_files()  # mapped, then unlinked: the memory is the tensor's
    kept = first.clone()
    first += 1  # writable, and private to this value
    second = nbddp.predict(net(), (x * 2,), batch_size=10, live=False)
    assert torch.equal(first, kept + 1) and not torch.equal(second, first)
    both = nbddp.predict(net(), (x,), batch_size=7, live=False,
                         step_fn=lambda m, b: {"p": m(b[0]), "i": b[0][:, 0].long(), "half": m(b[0]).bfloat16()})
    assert list(both) == ["p", "i", "half"] and torch.equal(both["i"], torch.arange(97))
    assert both["half"].dtype == torch.bfloat16 and torch.allclose(both["p"], kept, atol=1e-6)


def wider_from_90(m: nn.Module, batch) -> torch.Tensor:
    """Two columns per sample, three for a batch holding sample 90 or later (rank 1's last batch)."""
    x = batch[0]
    return x[:, :3] if (x[:, 0] >= 90).any() else x[:, :2]


def by_rank(m: nn.Module, batch) -> torch.Tensor:
    """Two columns on rank 0's block (samples 0..47), three on rank 1's."""
    x = batch[0]
    return x[:, :2] if x[0, 0] < 48 else x[:, :3]


@pytest.mark.parametrize("step", [wider_from_90, by_rank])
def test_outputs_that_do_not_fit_the_files_layout_come_back_as_one_process_gives_them(workers, step):
    x = rows(97)
    got = nbddp.predict(net(), (x,), batch_size=10, live=False, step_fn=step)
    expected = loop(lambda b: step(None, (b,)), x, [range(0, 48), range(48, 97)], 10)
    assert isinstance(got, list) and len(got) == len(expected)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert not _our_output_files()


# ---- the default step on Hugging Face style outputs ------------------------------------------------------------------


class ModelOutputLike(OrderedDict):
    """As transformers' ``ModelOutput``: a dict whose entries are attributes too."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class Classifier(nn.Module):
    """``model(input_ids=..., labels=...)`` -> ``.loss`` (one number a batch), ``.logits``, maybe more, as HF's."""

    def __init__(self, extra: bool = False):
        super().__init__()
        torch.manual_seed(3)
        self.body, self.extra = nn.Linear(6, 3), extra
        self.config = SimpleNamespace(keys_to_ignore_at_inference=["past_key_values"])

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None):
        logits = self.body(input_ids)
        out = ModelOutputLike(loss=nn.functional.cross_entropy(logits, labels), logits=logits)
        if self.extra:
            out.update(hidden=input_ids * 2, attentions=None, past_key_values=((input_ids,),))
        return out


class Batches(torch.utils.data.Dataset):
    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "labels": self.y[i]}


def test_the_default_step_keeps_what_hf_trainer_predict_calls_predictions(workers):
    x, y = torch.randn(37, 6, generator=torch.Generator().manual_seed(1)), torch.arange(37) % 3
    logits = Classifier().body(x).detach()
    got = nbddp.predict(Classifier(), Batches(x, y), batch_size=8, live=False)
    assert isinstance(got, torch.Tensor) and torch.allclose(got, logits, atol=1e-6)  # the loss dropped: logits
    more = nbddp.predict(Classifier(extra=True), Batches(x, y), batch_size=8, live=False)
    assert list(more) == ["logits", "hidden"]  # None and the config's keys_to_ignore_at_inference dropped too
    assert torch.allclose(more["logits"], logits, atol=1e-6) and torch.equal(more["hidden"], x * 2)
    # an attribute-style output (.logits, .loss) gives its logits
    named = nbddp.predict(lambda: Wrapped(Classifier()), Batches(x, y), batch_size=8, live=False)
    assert torch.allclose(named, logits, atol=1e-6)
    # a step_fn's return is kept as it is: a dict with the batch's loss stays one entry per batch
    steps = nbddp.predict(Classifier(), Batches(x, y), batch_size=20, live=False, step_fn=lambda m, b: dict(m(**b)))
    assert [sorted(s) for s in steps] == [["logits", "loss"]] * 2 and steps[0]["loss"].dim() == 0


class Wrapped(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, **batch):
        out = self.inner(**batch)
        return SimpleNamespace(loss=out["loss"], logits=out["logits"])


def test_a_tensor_dataset_is_read_a_slice_per_batch_as_default_collate_would_give_it():
    from torch.utils.data import DataLoader, TensorDataset

    from nbddp.worker.inference.shards import TensorBlocks, collate_rows

    ds = TensorDataset(torch.randn(20, 3), torch.arange(20))
    for sampler in (range(4, 17), [5, 3, 9, 1, 12]):  # a rank's block; any other order
        plain = list(DataLoader(ds, batch_size=4, sampler=sampler))
        sliced = list(DataLoader(TensorBlocks(ds.tensors), batch_size=4, sampler=sampler, collate_fn=collate_rows))
        assert [type(b) for b in sliced] == [list] * len(plain)
        assert all(torch.equal(a, b) for p, s in zip(plain, sliced) for a, b in zip(p, s))
    batch = next(iter(DataLoader(TensorBlocks(ds.tensors), batch_size=4, sampler=range(4), collate_fn=collate_rows)))
    batch[0] += 1  # a copy, as default_collate's: the dataset is untouched
    assert not torch.equal(ds.tensors[0][:4], batch[0])


def test_a_full_shared_memory_is_named_with_the_sizes_and_the_fix(tmp_path, monkeypatch):
    import errno

    from nbddp.worker.inference.outputs import FileRows, OutputsDoNotFit

    path = str(tmp_path / "out")
    open(path, "w").close()
    rows_file = FileRows(path, output_file.layout_of(torch.zeros(4, 256), 2048), 0)

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(OutputsDoNotFit, match=r"outputs \(2\.0 MiB\) do not fit in .*: it is full \(.* MiB free\)\. "
                                              r"Pass to='a/directory'.*--shm-size"):
        rows_file.write(torch.zeros(4, 256), 4)
    rows_file.close()
