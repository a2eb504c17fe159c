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

import pytest
import torch
import torch.nn as nn

import nbddp
from nbddp.shipping import output_file

pytestmark = pytest.mark.timeout(180)


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


def test_the_value_views_the_shared_file_which_is_gone_once_mapped(workers):
    x = rows(97)
    first = nbddp.predict(net(), (x,), batch_size=10, live=False)
    assert torch.allclose(first, net()(x).detach(), atol=1e-6)
    assert not glob.glob("/dev/shm/nbddp-*-out-*")  # mapped, then unlinked: the memory is the tensor's
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
    assert not glob.glob("/dev/shm/nbddp-*-out-*")
