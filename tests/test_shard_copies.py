"""Sharded snapshots across hosts (issue 33): each rank's DCP files also on its peer's host, put together at a relaunch.

The end-to-end fit (a host lost with its memory, fake hosts in network
namespaces) is in tests/test_elastic_hosts.py. Here the same machinery runs
on the suite's 2 warm workers, each given a folder of its own as its host's
``/dev/shm``: real FSDP shards, DCP's async save, the copies over gloo, one
folder wiped, and the load from what the other holds.
"""

from __future__ import annotations

import os

import pytest
import torch

import nbddp
from nbddp.protocol.snapshot_pieces import newest_covered, path_of
from nbddp.worker.checkpoints import shard_copies
from nbddp.worker.checkpoints.shard_fetch import plan_transfers


def test_a_step_counts_when_the_hosts_hold_its_files_together():
    meta = [".metadata", "__0_0.distcp", "__1_0.distcp", "loop.pt"]
    a = {8: {"path": "/s/step-8", "have": meta, "needs": meta},
         12: {"path": "/s/step-12", "have": [".metadata", "__0_0.distcp", "loop.pt"], "needs": meta}}
    b = {8: {"path": "/s/step-8", "have": ["__1_0.distcp"], "needs": None}}
    assert newest_covered([a, b]) == 8 and path_of([a, b], 8) == "/s/step-8"  # 12: rank 1's file is nowhere
    assert newest_covered([a, {12: {"path": "/s/step-12", "have": ["__1_0.distcp"], "needs": None}}]) == 12
    assert newest_covered([b]) is None  # without .metadata nobody knows what a load reads
    assert newest_covered([{"4": {"path": "/s/step-4.pt", "have": ["step-4.pt"], "needs": ["step-4.pt"]}}]) == 4
    assert newest_covered([]) is None
    with pytest.raises(KeyError, match="no host lists step 9"):
        path_of([a], 9)


def test_each_missing_file_is_sent_once_to_each_host_that_lacks_it():
    hosts = ["a", "a", "b", "b"]
    have = [{"x", "y"}, {"x", "y"}, {"y"}, {"y"}]
    wants = [{"x"}, {"y"}, {"y"}, {"x", "y"}]
    assert plan_transfers(hosts, have, wants) == [("x", 0, 3)]  # host b's rank 3 wants x: one copy, from rank 0
    with pytest.raises(FileNotFoundError, match=r"snapshot file 'z'.*no host of the fit holds it"):
        plan_transfers(hosts, have, [{"z"}, set(), set(), set()])


def test_a_host_folder_lists_what_it_holds_and_what_a_resume_needs(tmp_path):
    (tmp_path / "step-00000004.pt").write_bytes(b"torn")
    assert shard_copies.listing(str(tmp_path)) == {}  # a torn file counts for nothing
    assert shard_copies.listing(str(tmp_path / "absent")) == {} and shard_copies.listing(None) == {}


def _two_hosts(root: str) -> dict:
    """On each rank: an FSDP model whose snapshots go to ``root/<host>`` (rank r on host "ab"[r]), the copies to
    the other; host b's folder wiped; its rank's reads fetched from host a, then loaded."""
    import shutil

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from nbddp.worker.checkpoints import background, files, sharded, shard_copies, shard_fetch

    rank, hosts = dist.get_rank(), ["a", "b"]
    directory = os.path.join(root, hosts[rank])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    mesh = init_device_mesh("cpu", (2,))
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    writer = background.Writer(torch.device("cpu"))
    copies = shard_copies.ShardCopies(rank, hosts, directory, keep=2)
    full = {}
    try:
        for step in (4, 8, 12):
            model(torch.randn(4, 8)).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
            full[step] = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
            before = os.umask(0o077)  # as SnapshotClock.write does
            copies.prepare(step)
            finish = sharded.save_async(directory, step, model, opt, {"step": step}, rank, writer)
            os.umask(before)
            # step 12 without the copies: what a host lost then would take with it
            plain = lambda: (finish(), rank == 0 and files.prune(directory, 2))  # noqa: E731 - SnapshotClock's own
            writer.submit(copies.job(finish, step, writer.side_group(None)) if step < 12 else plain)
            writer.wait()
    finally:
        writer.close()
    kept = sorted(os.listdir(directory))
    modes = {n: oct(os.stat(os.path.join(directory, "step-00000008", n)).st_mode & 0o777)
             for n in os.listdir(os.path.join(directory, "step-00000008"))}
    if rank == 1:
        shutil.rmtree(directory)  # host b lost with its memory; its replacement finds nothing
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    dist.barrier()
    path = shard_fetch.newest(directory, hosts[rank], 2)
    reads = sharded.reads(path, model, opt)
    moved = shard_fetch.fetch_reads(path, reads, hosts[rank], 2)
    extra = sharded.load(path, model, opt)
    got = {k: v.full_tensor() for k, v in model.state_dict().items()}
    diff = max((got[k] - full[8][k]).abs().max().item() for k in got)
    return {"path": os.path.basename(path), "step": extra["step"], "diff": diff, "reads": sorted(reads),
            "held": sorted(os.listdir(path)), "moved": moved, "kept": kept, "modes": modes,
            "folder_mode": oct(os.stat(path).st_mode & 0o777), "copy_bytes": copies.copy_bytes, }


def test_a_wiped_host_resumes_from_the_copies_on_its_peers_host(workers, tmp_path):
    """Step 12 was written without the copies, so with host b's folder gone it cannot be put together: step 8 is."""
    a, b = nbddp.run(_two_hosts, str(tmp_path))
    assert a["kept"] == ["step-00000008", "step-00000012"]  # the last two, on each host
    # host b: step 4 pruned at step 8; step 12, written without the copies, neither published nor pruned there
    assert b["kept"] == ["step-00000004", "step-00000008", "step-00000012.tmp"]
    assert set(a["modes"].values()) == set(b["modes"].values()) == {"0o600"} and b["folder_mode"] == "0o700"
    assert set(a["modes"]) == set(b["modes"]) == {".metadata", "loop.pt", "__0_0.distcp", "__1_0.distcp"}
    assert a["path"] == b["path"] == "step-00000008" and a["step"] == b["step"] == 8
    assert a["diff"] == 0.0 and b["diff"] == 0.0
    assert {".metadata", "loop.pt", "__1_0.distcp"} <= set(b["reads"]) and "__0_0.distcp" in a["reads"]
    assert b["held"] == b["reads"]  # host b got back every file its load reads, and only those:
    assert a["moved"] == b["moved"] == 1  # its shard (the index, .metadata and loop.pt, came first)
    assert a["copy_bytes"] > 0 and a["copy_bytes"] == b["copy_bytes"]  # what one sent, the other received
    assert not os.path.exists(tmp_path / "a" / "step-00000012" / "__1_0.distcp")

