"""A checkpoint someone else wrote never runs code: refused with the file and the option that trusts it.

Each malicious file would, if unpickled in full, create a marker file (``os.system("touch ...")``); every test
shows the refusal and that the marker is absent. The kernel refuses before any worker works; the workers
refuse the same file on their own (a path only they see, or a file swapped after the kernel's check).
"""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch
import torch.nn as nn

import nbddp
from nbddp.worker.checkpoints import trust


class Marker:
    """Unpickled in full, it runs ``touch <path>``: the code a malicious checkpoint would run."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def _dcp_folder(folder, extra=None):
    """A sharded checkpoint as nbddp writes one (DCP's files and ``loop.pt``), of a tiny model, in this process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(1, 3)).sum().backward()
    optimizer.step()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state, **(extra or {})}, checkpoint_id=str(folder), no_dist=True)
    torch.save({"step": 1, "epoch": 0, "batches_done": 0, "world_size": 1, "batch_size": 4}, folder / "loop.pt")
    return folder


def _evil_file(tmp_path, marker):
    path = tmp_path / "step-00000001.pt"
    torch.save({"model": {}, "optimizer": {}, "step": 1, "epoch": 0, "payload": Marker(marker)}, path)
    return path


def test_a_file_checkpoint_that_runs_code_is_refused_before_any_worker_works(workers, tmp_path):
    marker = tmp_path / "ran"
    evil = _evil_file(tmp_path, marker)
    with pytest.raises(nbddp.UntrustedCheckpointError, match=rf"{evil}: this checkpoint holds more than tensors and "
                       r"plain data \(.*posix.system.*\).*pass dist_fit\(\.\.\., trust_checkpoint=True\)") as caught:
        nbddp.dist_fit(nn.Linear(4, 2), (torch.randn(8, 4), torch.randn(8, 2)), resume=str(evil), batch_size=4,
                       live=False)
    assert caught.value.path == str(evil)
    assert not marker.exists()


def test_the_workers_refuse_it_on_their_own(workers, tmp_path, monkeypatch):
    """As when the kernel cannot see the file (another host's disk): the ranks read it safely too."""
    from nbddp.worker.tasks import checkpoint_check

    monkeypatch.setattr(checkpoint_check, "check_resume", lambda *args: None)
    marker = tmp_path / "ran"
    evil = _evil_file(tmp_path, marker)
    with pytest.raises(nbddp.WorkerError, match=r"UntrustedCheckpointError: .*trust_checkpoint=True") as caught:
        nbddp.dist_fit(nn.Linear(4, 2), (torch.randn(8, 4), torch.randn(8, 2)), resume=str(evil), batch_size=4,
                       live=False)
    assert caught.value.exc_type == "UntrustedCheckpointError"
    assert not marker.exists()


def test_a_sharded_folder_that_runs_code_is_refused(workers, tmp_path, monkeypatch):
    """Its DCP ``.metadata`` and its ``loop.pt``, in the kernel; the metadata on the ranks too."""
    marker = tmp_path / "ran"
    folder = _dcp_folder(tmp_path / "step-00000001")
    data = (torch.randn(8, 4), torch.randn(8, 2))
    torch.save({"step": 1, "epoch": 0, "payload": Marker(marker)}, folder / "loop.pt")
    with pytest.raises(nbddp.UntrustedCheckpointError, match=r"loop.pt: this checkpoint holds more .*trust_checkpoint"):
        nbddp.dist_fit(nn.Linear(4, 2), data, resume=str(folder), strategy="fsdp", batch_size=4, live=False)
    torch.save({"step": 1, "epoch": 0}, folder / "loop.pt")
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(Marker(marker), f)
    with pytest.raises(nbddp.UntrustedCheckpointError, match=r"\.metadata: .*its metadata names posix.system"):
        nbddp.dist_fit(nn.Linear(4, 2), data, resume=str(tmp_path), checkpoint_dir=str(tmp_path), strategy="fsdp",
                       batch_size=4, live=False)
    from nbddp.worker.tasks import checkpoint_check

    monkeypatch.setattr(checkpoint_check, "check_resume", lambda *args: None)
    with pytest.raises(nbddp.WorkerError, match=r"UntrustedCheckpointError: .*\.metadata: .*posix.system"):
        nbddp.dist_fit(nn.Linear(4, 2), data, resume=str(folder), strategy="fsdp", batch_size=4, live=False)
    assert not marker.exists()


@pytest.mark.parametrize("part", ["metadata", "loop", "value"])
def test_export_checkpoint_refuses_a_folder_that_runs_code(tmp_path, part):
    marker = tmp_path / "ran"
    folder = _dcp_folder(tmp_path / "step-00000001", {"payload": Marker(marker)} if part == "value" else None)
    if part == "metadata":
        with open(folder / ".metadata", "wb") as f:
            pickle.dump(Marker(marker), f)
    if part == "loop":
        torch.save({"step": 1, "epoch": 0, "payload": Marker(marker)}, folder / "loop.pt")
    where = {"metadata": r"\.metadata", "loop": r"loop\.pt", "value": r"step-00000001 \(its value 'payload'\)"}[part]
    with pytest.raises(nbddp.UntrustedCheckpointError, match=rf"{where}: .*pass nbddp.export_checkpoint\(path, out, "
                                                            r"trust_checkpoint=True\)"):
        nbddp.export_checkpoint(folder, tmp_path / "out.pt")
    assert not marker.exists() and not (tmp_path / "out.pt").exists()


def test_export_checkpoint_reads_nbddp_folders_and_trusted_ones(tmp_path):
    folder = _dcp_folder(tmp_path / "step-00000001")
    out = nbddp.export_checkpoint(folder, tmp_path / "plain.pt")
    plain = torch.load(out, weights_only=True)
    assert set(plain["model"]) == {"weight", "bias"} and plain["step"] == 1
    marker = tmp_path / "ran"
    torch.save({"step": 1, "epoch": 0, "payload": Marker(marker)}, folder / "loop.pt")
    nbddp.export_checkpoint(folder, tmp_path / "trusted.pt", trust_checkpoint=True)
    assert marker.exists()  # the person vouched for it: read in full, as torch.load(weights_only=False) would
    with pytest.raises(TypeError, match=r"export_checkpoint\(trust_checkpoint=...\) must be True or False, got 1"):
        nbddp.export_checkpoint(folder, tmp_path / "x.pt", trust_checkpoint=1)


def test_trust_checkpoint_must_be_a_bool(workers):
    with pytest.raises(TypeError, match=r"dist_fit\(trust_checkpoint=...\) must be True or False, got str 'yes'"):
        nbddp.dist_fit(nn.Linear(4, 2), (torch.randn(8, 4), torch.randn(8, 2)), trust_checkpoint="yes", batch_size=4,
                       live=False)


def test_only_private_folders_of_this_user_are_trusted(tmp_path):
    """An elastic fit's own snapshot folder (0700, ours) is read in full; the same folder opened to others is not."""
    folder = tmp_path / "snapshots"
    folder.mkdir(mode=0o700)
    os.chmod(folder, 0o700)
    inside = str(folder / "step-00000001.pt")
    with trust.trusting(roots=(str(folder),)):
        assert trust.trusted(inside)
        assert not trust.trusted(str(tmp_path / "elsewhere.pt"))
        assert not trust.trusted(str(folder) + "-sibling/step-00000001.pt")
    os.chmod(folder, 0o755)
    with trust.trusting(roots=(str(folder),)):
        assert not trust.trusted(inside)
    assert not trust.trusted(inside)  # outside the block: nothing is


def test_a_compile_cache_someone_else_saved_is_refused(workers, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    unsigned = tmp_path / "cache.bin"
    unsigned.write_bytes(json.dumps({"format": "nbddp-compile-cache/1", "torch": torch.__version__, "sizes": [],
                                     "artifacts": {}}).encode() + b"\n")
    with pytest.raises(nbddp.UntrustedCheckpointError, match=r"compile_cache\(load=.*cache.bin'\): this file was not "
                       r"saved by your nbddp.compile_cache\(save=...\).*pass nbddp.compile_cache\(load=path, "
                       r"trust_checkpoint=True\)"):
        nbddp.compile_cache(load=unsigned)
    assert nbddp.compile_cache(load=unsigned, trust_checkpoint=True)["artifacts"] == {}
    with pytest.raises(TypeError, match=r"compile_cache\(trust_checkpoint=...\) must be True or False, got 'x'"):
        nbddp.compile_cache(load=unsigned, trust_checkpoint="x")


def test_signatures_are_this_users(tmp_path, monkeypatch):
    from nbddp.fit import signing

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "mine"))
    signature = signing.sign([b"graph"])
    assert signing.signed_here([b"graph"], signature)
    assert not signing.signed_here([b"other graph"], signature)
    assert os.stat(signing.key_path()).st_mode & 0o077 == 0
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "someone-else"))
    assert not signing.signed_here([b"graph"], signature)
